"""Real ``vlguard serve`` / stock vLLM servers for the tests: :mod:`server.workload.servers`, run from
this checkout (the working directory decides which ``server`` package ``python -m server`` imports), on
the tiny model's profile."""

from __future__ import annotations

import functools
import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.workload import servers
from server.workload.servers import engine_env, free_port, metric_samples, vlguard_command

REPO = Path(__file__).resolve().parent.parent
TINY_PROFILE = REPO / "config" / "tiny-cpu.yaml"

__all__ = [
    "NO_COMPILE_WHEN_EAGER",
    "NO_SPARE",
    "REPO",
    "SPARE",
    "TINY_PROFILE",
    "ServerProcess",
    "SharedServer",
    "engine_env",
    "free_port",
    "metric_samples",
    "retire",
    "vlguard_argv",
    "wait_retired",
]


#: An eager engine's only ``torch.compile`` on the CPU platform is vLLM's sampler helper
#: (``compiled_random_sample``), first called in the start-up's dummy sampler run: 12-15 s per engine start
#: on 2 cores, nearly all of it inductor's vector-ISA probes (six ``python -c "import torch ..."``
#: subprocesses) and a header precompile, repeated by every launch and every rebuild (the caches do not
#: cover them). Eager test servers skip it; the model itself runs exactly as before (eager), and greedy
#: sampling never calls the helper. Measured: warm-up 15.6 s -> 1.2 s, "engine ready" 33.8 s -> 18.6 s.
NO_COMPILE_WHEN_EAGER = {"TORCH_COMPILE_DISABLE": "1"}

#: Test servers keep no spare engine process unless they ask (``--guard-spare on``): a spare costs ~16 CPU
#: seconds of imports right after every start, which on the 2-core CI machine compete with the test's
#: own work, and it only pays off at a rebuild after a process death. Measured: the default lane's pytest
#: with a spare in every server took 1770 s against 1452 s before spares existed (~70 s of that are the
#: two new spare tests; their setups grew most: the Docker test's 60 -> 83 s). test_guard's server kills
#: its engine every few seconds, before a new spare is ready, and each rebuild's next spare then imports
#: beside the next test (that module +150 s): no spare there either. The eager session server (the C5 kill
#: test asserts the rebuild runs in the spare, on every lane; the spare-kill test) and the SIGKILL lifecycle
#: tests ask for it; the Docker test and ``make serve`` run as shipped (spare on).
NO_SPARE = {"VLGUARD_SPARE": "off"}
SPARE = ("--guard-spare", "on")
#: Test servers admit without the queue-wait estimate unless they ask (``--guard-max-queue-wait``): the
#: fault tests crawl their engines (0.2 s a step) under batches sent at once, where the estimate would
#: refuse the late requests they count on; admission is tested in tests/unit/test_admission.py and
#: tests/api/test_overload.py, and by ``vlguard bench`` (servers as shipped).
NO_QUEUE_WAIT = {"VLGUARD_MAX_QUEUE_WAIT": "0"}


@dataclass
class ServerProcess(servers.ServerProcess):
    """:class:`server.workload.servers.ServerProcess` started in this checkout; ``--enforce-eager``
    servers get :data:`NO_COMPILE_WHEN_EAGER` unless their environment sets it, and servers not given
    ``--guard-spare`` get :data:`NO_SPARE`."""

    cwd: Path | None = REPO

    def __post_init__(self) -> None:
        require_test_plugins()
        if "--enforce-eager" in self.argv:
            self.env = {**NO_COMPILE_WHEN_EAGER, **self.env}
        if "--guard-spare" not in self.argv:
            self.env = {**NO_SPARE, **self.env}
        if "--guard-max-queue-wait" not in self.argv:
            self.env = {**NO_QUEUE_WAIT, **self.env}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its package is missing
        return False


@functools.cache
def require_test_plugins() -> None:
    """The test-only vLLM plugins (``tests/plugins``: faults, padding) load in this environment, as every
    server the tests start needs: vLLM only logs a plugin it cannot import, and a fault test would then
    fail as if the guard had missed the fault.

    Raises:
        RuntimeError: a plugin's module is not importable (the venv's editable install points at another,
            or a deleted, clone: ``scripts/venv.sh`` points it at this one).
    """
    from importlib.metadata import entry_points

    plugins = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name.startswith("vlguard_test_")]
    missing = [ep.value for ep in plugins if not _importable(ep.module)]
    if not plugins or missing:
        raise RuntimeError(
            f"the test-only vLLM plugins do not load here ({missing or 'not installed'}): "
            "run scripts/venv.sh <lane> to point this environment at this clone"
        )


@dataclass
class SharedServer(ServerProcess):
    """The session's shared server; ``first_text`` is the greedy answer to its first request (text-only)."""

    first_text: Any = None


def vlguard_argv(model: Path, *extra: str) -> list[str]:
    """``python -m server serve <model> --config tiny-cpu.yaml <extra>`` with this interpreter."""
    return vlguard_command(model, "--config", str(TINY_PROFILE), *extra)


_RETIRING: list[threading.Thread] = []


def retire(srv: servers.ServerProcess) -> None:
    """``srv.stop()`` in the background: a server's shutdown (5-8 s here, mostly vLLM waiting for its engine
    processes to exit) then overlaps the next test instead of adding to the run. For fixture teardowns
    only: a test that checks how a server stops stops it itself. :func:`wait_retired` (at the session's
    end) waits for every retired server to be gone."""

    def stop() -> None:
        try:
            srv.stop()
        except Exception as exc:  # reported, not raised into whichever test runs meanwhile
            print(f"could not stop {srv.argv}: {exc!r}")

    thread = threading.Thread(target=stop, name=f"stop {srv.url}")
    thread.start()
    _RETIRING.append(thread)


def wait_retired() -> None:
    """Wait for every server :func:`retire` is stopping (each ``stop()`` is bounded: SIGKILL after 60 s)."""
    while _RETIRING:
        _RETIRING.pop().join()
