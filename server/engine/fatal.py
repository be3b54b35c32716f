"""Engine-core side: record the fatal exception, and the step it broke, before the engine core dies (vLLM
plugin ``vlguard_fatal``).

In the engine-core process it wraps ``EngineCoreProc.run_busy_loop``: the step log
(:mod:`server.engine.step_log`) knows which steps are in execution and which requests they carry (the
request ids vLLM's scheduler gave them), and a fatal exception's type and message are written with
the requests of the step(s) in execution (none when ``schedule()`` itself raised) as the engine's
:class:`~server.engine.protocol.FatalRecord` before vLLM reports the engine dead. The supervisor reads it to
label the death (``deepstack``, ``exception``) and to charge the quarantine only with the requests that
could have caused it (vLLM itself only tells the API process "engine dead"). The same wrapper installs
soft recovery (:mod:`server.engine.soft`), which absorbs most step faults before they get here.

The supervisor gives each engine it builds a directory of its own (:class:`EngineSettings`, written before
the build and inherited by the engine-core process), so a record always belongs to one engine.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from server.engine.protocol import EngineSettings, FatalRecord, format_traceback, write_fatal
from server.engine.step_log import remember_steps
from server.vllm_hooks import engine_core

logger = logging.getLogger("vllm.vlguard.fatal")
_registered = False


def register() -> None:
    """Plugin entry point. Idempotent; never raises into vLLM. Off outside ``vlguard serve`` (no state
    directory in :class:`EngineSettings`)."""
    global _registered
    if _registered or not EngineSettings.state_dir_of():
        return
    _registered = True

    def record_fatal(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run_busy_loop(self: Any) -> Any:
            log = remember_steps(self.scheduler, engine_core.steps_in_execution(self))
            try:
                from server.engine import soft

                soft.install(self, log, soft.SoftPolicy.from_settings(EngineSettings.from_environ()))
            except Exception:
                logger.exception("vlguard: soft recovery not installed; every step fault rebuilds the engine")
            try:
                return original(self)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    log.blame(exc, engine_core.held_requests(self))
                step_requests, new_requests = log.in_execution()
                record = FatalRecord(
                    type=type(exc).__name__,
                    message=str(exc)[:2000],
                    step_requests=step_requests,
                    new_requests=new_requests,
                    suspects=log.suspects,
                    named=bool(log.culprits),
                    traceback=format_traceback(exc),
                )
                try:
                    write_fatal(EngineSettings.state_dir_of(), record)
                except OSError:
                    logger.exception("vlguard: could not record the fatal error")
                raise

        return run_busy_loop

    try:
        engine_core.wrap_busy_loop(record_fatal)
    except Exception:
        logger.exception("vlguard: fatal-error recorder not installed")
