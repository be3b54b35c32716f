"""Run the vlguard HTTP server (uvicorn) for parsed ``vlguard serve`` arguments."""

from __future__ import annotations

import argparse
import logging
import os

from server.settings import GuardSettings

#: Process exit statuses. Anything non-zero makes systemd's ``Restart=on-failure`` fire.
EXIT_OK = 0
EXIT_STARTUP_FAILED = 3

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


def run(args: argparse.Namespace, settings: GuardSettings) -> int:
    """Serve until SIGINT/SIGTERM.

    Returns:
        The process exit status: 0 after a clean shutdown, non-zero when the engine never came up.
    """
    import uvicorn
    import vllm.envs as envs
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.system_utils import set_ulimit

    from server.app import create_app
    from server.guard.supervisor import Supervisor

    _configure_logging()
    # The patch plugin runs in every vLLM process; spawned engine processes inherit this.
    os.environ["VLGUARD_PATCHES"] = "on" if settings.patches else "off"
    set_ulimit()

    supervisor = Supervisor(AsyncEngineArgs.from_cli_args(args), settings)
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
    )
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        logger.error("server did not start (engine state: %s)", supervisor.state.value)
        return EXIT_STARTUP_FAILED
    return EXIT_OK
