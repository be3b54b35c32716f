"""``vlguard bench``: the users' two-pass workload (primary then rescue prompt on the same image), its
inputs, and the side-by-side benchmarks. Needs the ``bench`` extra (``pip install 'vlguard[bench]'``);
nothing on the serving path imports this package but the shim below.

:func:`phase_trace_plugin` is the vLLM plugin entry point ``vlguard_phase_trace``: vLLM loads it in every
process, so it imports nothing and installs the phase tracer (:mod:`server.workload.phase_trace`) only
where ``vlguard bench`` asked for it (``VLGUARD_PHASE_TRACE`` names a file).
"""

import os

PHASE_TRACE_ENV = "VLGUARD_PHASE_TRACE"


def phase_trace_plugin() -> None:
    """Plugin entry point: the phase tracer's, when ``VLGUARD_PHASE_TRACE`` is set; else nothing."""
    if os.environ.get(PHASE_TRACE_ENV):
        from server.workload import phase_trace

        phase_trace.register()
