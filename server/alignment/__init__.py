"""Per-request chunk alignment: steps that carry image tokens never need CUDA-graph padding.

- :mod:`server.alignment.capture`: capture sizes and the rounding helpers;
- :mod:`server.alignment.plan`: the pure decision (what to change in one step);
- :mod:`server.alignment.scheduler`: vLLM's scheduler with the decision applied (``--scheduler-cls``).

The scheduler runs in vLLM's engine-core process; the API process only names it.
"""

#: Largest capture size to align to when the engine itself pads nothing (CPU, padding emulation in tests).
from server.engine.protocol import ALIGNMENT_MAX_CAPTURE_ENV as MAX_CAPTURE_ENV

#: What vlguard passes as vLLM's ``--scheduler-cls`` when alignment is on.
SCHEDULER_CLS = "server.alignment.scheduler.AlignedScheduler"

__all__ = ["MAX_CAPTURE_ENV", "SCHEDULER_CLS"]
