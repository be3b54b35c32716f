"""Engine-core side: record the fatal exception before the engine core dies (vLLM plugin).

Entry point ``vllm.general_plugins``: ``vlguard_fatal``. In the engine-core process it wraps
``EngineCoreProc.run_busy_loop`` so that a fatal exception's type and message are written to
``$VLGUARD_STATE_DIR/fatal-<pid>.json`` before vLLM reports the engine dead. The supervisor reads it to
label the death (``deepstack``, ``exception``); vLLM itself only tells the API process "engine dead".
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

ENV = "VLGUARD_STATE_DIR"
logger = logging.getLogger("vllm.vlguard.fatal")
_registered = False


def fatal_path(state_dir: str | Path, pid: int) -> Path:
    """Where the engine core with ``pid`` records its fatal error."""
    return Path(state_dir) / f"fatal-{pid}.json"


def read_fatal(state_dir: str | Path, pids: list[int]) -> str | None:
    """``"<Type>: <message>"`` recorded by any of the engine cores ``pids``, or None."""
    for pid in pids:
        path = fatal_path(state_dir, pid)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return f"{data.get('type')}: {data.get('message')}"
    return None


def register() -> None:
    """Plugin entry point. Idempotent; never raises into vLLM."""
    global _registered
    if _registered or not os.environ.get(ENV):
        return
    _registered = True
    try:
        from vllm.v1.engine.core import EngineCoreProc

        original = EngineCoreProc.run_busy_loop

        def run_busy_loop(self: Any) -> Any:
            try:
                return original(self)
            except Exception as exc:
                try:
                    path = fatal_path(os.environ[ENV], os.getpid())
                    path.write_text(json.dumps({"type": type(exc).__name__, "message": str(exc)[:2000]}))
                except OSError:
                    logger.exception("vlguard: could not record the fatal error")
                raise

        EngineCoreProc.run_busy_loop = run_busy_loop
    except Exception:
        logger.exception("vlguard: fatal-error recorder not installed")
