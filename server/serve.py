"""Run the vlguard HTTP server (uvicorn) for parsed ``vlguard serve`` arguments."""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from server.alignment import MAX_CAPTURE_ENV, SCHEDULER_CLS
from server.settings import GuardSettings

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

#: Process exit statuses. Anything non-zero makes systemd's ``Restart=on-failure`` fire.
EXIT_OK = 0
EXIT_STARTUP_FAILED = 3
EXIT_ENGINE_FAILED = 4  # restarts kept failing or the restart budget was spent

logger = logging.getLogger("server")


def _configure_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [vlguard %(name)s] %(message)s", "%m-%d %H:%M:%S")
    )
    root = logging.getLogger("server")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


#: Added to vLLM's ``additional_config`` when patches are on. It enters vLLM's config hash, so the
#: torch.compile cache of a patched engine never reuses one compiled by stock vLLM, whose graph was traced
#: without the deepstack additions (vLLM's AOT compile cache loads a stored graph without re-tracing).
COMPILE_CACHE_KEY = {"vlguard_deepstack_patches": "v1"}


def engine_overrides(args: argparse.Namespace, settings: GuardSettings) -> dict[str, Any]:
    """The engine arguments vlguard sets on top of the parsed ``vllm serve`` flags.

    - ``additional_config`` gains vlguard's compile-cache key when patches are on;
    - ``scheduler_cls`` is vlguard's aligned scheduler when alignment is on (unless the user gave one);
    - ``mm_processor_cache_gb`` is 0: replays re-submit already processed inputs to a new engine core,
      which holds no cached images, and the API-side processor cache would have stripped the image data
      from them (vLLM's "Expected a cached item for mm_hash" assertion). The engine core's encoder cache
      still saves the vision encoder's work.
    """
    overrides: dict[str, Any] = {"mm_processor_cache_gb": 0}
    if settings.alignment:
        custom = getattr(args, "scheduler_cls", None)
        if custom in (None, SCHEDULER_CLS):
            overrides["scheduler_cls"] = SCHEDULER_CLS
        else:
            logger.warning("--scheduler-cls %s given: vlguard's chunk alignment is off", custom)
    additional = getattr(args, "additional_config", None)
    if settings.patches and isinstance(additional, dict):
        overrides["additional_config"] = {**additional, **COMPILE_CACHE_KEY}
    return overrides


def engine_args(args: argparse.Namespace, settings: GuardSettings) -> AsyncEngineArgs:
    """vLLM's engine arguments for ``args`` with :func:`engine_overrides` applied."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    result = AsyncEngineArgs.from_cli_args(args)
    for name, value in engine_overrides(args, settings).items():
        setattr(result, name, value)
    return result


#: vlguard's vLLM general plugins (entry points in pyproject.toml).
VLGUARD_PLUGINS = ("vlguard_patches", "vlguard_fatal")


def plugin_allowlist(value: str | None) -> str | None:
    """``VLLM_PLUGINS`` with vlguard's own plugins added, or ``None`` when it is unset (vLLM then loads
    every installed plugin). A user who restricts vLLM's plugins must not switch off the backports."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    return ",".join(dict.fromkeys([*names, *VLGUARD_PLUGINS]))


def run(args: argparse.Namespace, settings: GuardSettings) -> int:
    """Serve until SIGINT/SIGTERM.

    Returns:
        The process exit status: 0 after a clean shutdown, non-zero when the engine never came up.
    """
    import uvicorn
    import vllm.envs as envs
    from vllm.utils.system_utils import set_ulimit

    from server.app import create_app
    from server.guard.fatal import ENV as FATAL_ENV
    from server.guard.supervisor import EngineState, Supervisor

    _configure_logging()
    # The patch plugin runs in every vLLM process; spawned engine processes inherit this. It must be set
    # before vLLM loads its plugins (when the engine arguments are built below).
    os.environ["VLGUARD_PATCHES"] = "on" if settings.patches else "off"
    allowed = plugin_allowlist(os.environ.get("VLLM_PLUGINS"))
    if allowed is not None:
        os.environ["VLLM_PLUGINS"] = allowed
    if settings.alignment_max_capture_size:
        os.environ[MAX_CAPTURE_ENV] = str(settings.alignment_max_capture_size)
    set_ulimit()

    state_dir = tempfile.mkdtemp(prefix="vlguard-state-")
    os.environ[FATAL_ENV] = state_dir  # engine cores record their fatal errors here
    supervisor = Supervisor(engine_args(args, settings), settings, state_dir=state_dir)
    app = create_app(args, settings, supervisor)
    config = uvicorn.Config(
        app,
        host=args.host or "0.0.0.0",  # vllm serve's default: all interfaces
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout),  # SIGTERM: drain in-flight requests, bounded
    )
    server = uvicorn.Server(config)

    def give_up() -> None:
        server.should_exit = True

    supervisor.on_failed = give_up
    try:
        server.run()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    if not server.started:
        logger.error("server did not start (engine state: %s)", supervisor.state.value)
        return EXIT_STARTUP_FAILED
    if supervisor.state is EngineState.FAILED:
        logger.critical("engine could not be restarted; exiting with status %d", EXIT_ENGINE_FAILED)
        return EXIT_ENGINE_FAILED
    return EXIT_OK
