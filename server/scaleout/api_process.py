"""One of the N API processes under ``--api-server-count N``: vlguard's server (app, door, guard) over the
engines the owner announces (:class:`~server.scaleout.remote.RemoteEngines`). Started by the owner
(:mod:`server.scaleout.tier`) with ``multiprocessing``'s spawn."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from multiprocessing.connection import Connection

from server.settings import GuardSettings


def main(
    args: argparse.Namespace,
    settings: GuardSettings,
    sock: socket.socket,
    index: int,
    count: int,
    conn: Connection,
    environ: dict[str, str],
) -> None:
    """Serve on ``sock`` (shared with the other API processes) until SIGTERM or until the guard gives up;
    exits with :func:`server.serve.serve_api`'s status (after a SIGTERM, by that signal).

    Arguments:
        index, count: this API process's client index, and N.
        conn: its control pipe from the owner.
        environ: set before anything reads it (its own ``NOTIFY_SOCKET``: :class:`~server.scaleout.owner.NotifyRelay`).
    """
    os.environ.update(environ)
    with contextlib.suppress(ImportError):  # as vLLM names its own (VLLM::ApiServer_<index>)
        import setproctitle

        setproctitle.setproctitle(f"vlguard::api_{index}")
    from vllm.utils.system_utils import set_ulimit

    from server import serve
    from server.engine.protocol import new_state_dir
    from server.metrics import definitions
    from server.scaleout.link import OwnerLink
    from server.scaleout.remote import OwnersSpare, RemoteEngines
    from server.scaleout.shared import SharedGuardState

    serve.configure_logging(f"api {index}")
    # one engine on /metrics: API process 0 writes the engine's metrics, the owner the spare's
    definitions.written_elsewhere(
        definitions.SPARE_METRICS if index == 0 else definitions.ENGINE_METRICS + definitions.SPARE_METRICS
    )
    serve.prepare_vllm_processes(args, settings)
    set_ulimit()
    link = OwnerLink(conn)
    engines = RemoteEngines(link, serve.engine_args(args, settings), index, count, settings.startup_timeout)
    shared = SharedGuardState(link, index)
    spare = OwnersSpare(link)
    link.start()
    # its own state directory (removed at its shutdown); the engines' records are in the owner's
    sys.exit(serve.serve_api(args, settings, sock, engines, new_state_dir(), spare, on_supervisor=shared.attach))
