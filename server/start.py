"""``vlguard serve``: what every launch does first (the listening socket, vLLM's processes' environment, the
state directory), then one API process that owns its engine (:func:`server.serve.serve_api`) or, with
``--api-server-count N`` (N > 1), an owner of the engine and N API processes (:mod:`server.scaleout.tier`)."""

from __future__ import annotations

import argparse
import functools
import os

from server import front_flags
from server.engine import parent_watch
from server.engine.protocol import STATE_DIR_ENV, new_state_dir
from server.serve import (
    EXIT_STARTUP_FAILED,
    api_server_count,
    configure_logging,
    engine_args,
    listen_socket,
    logger,
    prepare_vllm_processes,
    serve_api,
)
from server.settings import GuardSettings


def run(args: argparse.Namespace, settings: GuardSettings) -> int:
    """Serve until SIGINT/SIGTERM: one API process that owns its engine, or, with ``--api-server-count N``
    (N > 1), an owner of the engine and N API processes (:mod:`server.scaleout`).

    Returns:
        The exit status when the server stopped on its own: 3 when the engine never came up, 4 when it
        could not be restarted, 5 when one of N API processes ended (:func:`server.scaleout.tier.run`), 0
        otherwise. A SIGTERM/SIGINT does not return: after the shutdown the
        process ends by that signal (status 143 / 130), as uvicorn does.
    """
    from vllm.utils.system_utils import set_ulimit

    from server.guard.lifecycle import build_async_llm
    from server.guard.spare import SpareKeeper
    from server.scaleout import tier

    configure_logging()
    differences = ", ".join(front_flags.DIFFERENCES)
    logger.info("differs from vllm serve on purpose in: %s (--print-config says why)", differences)
    try:
        sock = listen_socket(args)
    except OSError as exc:
        logger.error("cannot listen on %s: %s", args.uds or f"{args.host or '0.0.0.0'}:{args.port}", exc)
        return EXIT_STARTUP_FAILED
    prepare_vllm_processes(args, settings)
    set_ulimit()

    # Engine cores record their fatal errors below this (each engine in a directory of its own; the
    # supervisor removes it at shutdown). Set before vLLM loads its plugins here (building the engine
    # arguments does), so the recorder is installed in this process too: a forked engine core inherits it
    # without loading plugins again.
    state_dir = new_state_dir()
    os.environ[STATE_DIR_ENV] = state_dir
    parent_watch.enable_for_children()  # engine processes end when this process is gone, however it ends
    if (count := api_server_count(args)) > 1:
        return tier.run(args, settings, sock, state_dir, count)
    spares = SpareKeeper() if settings.spare else None
    # vLLM loads its plugins here; the spare is spawned as soon as a build has its configuration
    on_config = spares.on_config if spares is not None else None
    factory = functools.partial(build_async_llm, engine_args(args, settings), on_config=on_config)
    return serve_api(args, settings, sock, factory, state_dir, spares, reap_children=True)
