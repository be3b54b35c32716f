"""Run the vlguard HTTP server (uvicorn) for parsed ``vlguard serve`` arguments."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from server import launcher, run_dirs
from server.alignment import SCHEDULER_CLS
from server.engine.protocol import ServeSettings
from server.settings import GuardSettings

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from server.guard.forensics import Forensics
    from server.guard.lifecycle import EngineFactory
    from server.guard.spare import Spares
    from server.guard.supervisor import Supervisor

#: Process exit statuses. Anything non-zero makes systemd's ``Restart=on-failure`` fire.
EXIT_OK = 0
EXIT_STARTUP_FAILED = 3
EXIT_ENGINE_FAILED = 4  # restarts kept failing or the restart budget was spent
EXIT_API_PROCESS_ENDED = 5  # --api-server-count N: an API process ended on its own (a crash, a kill)

logger = logging.getLogger("server")


def configure_logging(process: str = "") -> None:
    """vlguard's log lines: ``LEVEL time [vlguard <process> <logger>] message`` (``process``: which of several
    processes of one server writes, e.g. ``api 1``)."""
    handler = logging.StreamHandler()
    where = f"{process} " if process else ""
    handler.setFormatter(
        logging.Formatter(f"%(levelname)s %(asctime)s [vlguard {where}%(name)s] %(message)s", "%m-%d %H:%M:%S")
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
    - ``scheduler_cls`` is vlguard's aligned scheduler when alignment is on (unless the user gave one).

    vLLM's multimodal processor cache is left as configured; :mod:`server.vllm_hooks.processor_cache` (installed
    by :func:`run`) makes vLLM build it in the form replays survive.
    """
    overrides: dict[str, Any] = {}
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


def vllm_changes(args: argparse.Namespace, settings: GuardSettings) -> dict[str, str]:
    """What vlguard changes in vLLM's behaviour for ``args``, one line each (``--print-config`` shows it)."""
    changes = {name: f"{value!r} (vlguard)" for name, value in engine_overrides(args, settings).items()}
    # with several API processes vLLM keeps the cache in them alone (processor_only): nothing of vlguard's to say
    if getattr(args, "mm_processor_cache_gb", 0) > 0 and api_server_count(args) == 1:
        changes["mm_processor_cache_type"] = (
            "lru (shm becomes lru), its API half kept with the images' data: the guard sends a repeated image "
            "as its hash only to an engine core that holds it, so replays reach any engine core with their "
            "data; host memory up to twice --mm-processor-cache-gb (server/vllm_hooks/processor_cache.py, ipc_cache.py)"
        )
    if settings.patches:
        changes["model"] = "deepstack backports where the installed vLLM has the defects (server/patches)"
        changes["compile_cache"] = (
            "stored inductor artifacts (the CPU platform's) load instead of compiling again at every start "
            "(server/patches/aot_cache.py)"
        )
    return changes


def engine_config(args: argparse.Namespace, settings: GuardSettings) -> dict[str, Any]:
    """The engine arguments vLLM would build from ``args`` (exactly the fields ``AsyncEngineArgs.from_cli_args``
    hands to the constructor) with vlguard's :func:`engine_overrides`, without building them."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = {f.name: getattr(args, f.name) for f in dataclasses.fields(AsyncEngineArgs) if hasattr(args, f.name)}
    engine.update(engine_overrides(args, settings))
    return engine


def forensics(args: argparse.Namespace, settings: GuardSettings) -> Forensics | None:
    """The forensic recorder ``--guard-forensics-dir`` asks for (:mod:`server.guard.forensics`), or None."""
    if not settings.forensics_dir:
        return None
    from server.guard.forensics import Forensics, engine_facts

    max_bytes = int(settings.forensics_max_mb * 1024 * 1024)
    facts = engine_facts(engine_config(args, settings))
    return Forensics(settings.forensics_dir, settings.forensics_media, settings.forensics_max_records, max_bytes, facts)


def engine_args(args: argparse.Namespace, settings: GuardSettings) -> AsyncEngineArgs:
    """vLLM's engine arguments for ``args`` with :func:`engine_overrides` applied."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    result = AsyncEngineArgs.from_cli_args(args)
    for name, value in engine_overrides(args, settings).items():
        setattr(result, name, value)
    return result


#: vlguard's vLLM general plugins (entry points in pyproject.toml).
VLGUARD_PLUGINS = ("vlguard_patches", "vlguard_fatal", "vlguard_parent_watch", "vlguard_replay_cache")


def plugin_allowlist(value: str | None) -> str | None:
    """``VLLM_PLUGINS`` with vlguard's own plugins added, or ``None`` when it is unset (vLLM then loads
    every installed plugin). A user who restricts vLLM's plugins must not switch off the backports."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    return ",".join(dict.fromkeys([*names, *VLGUARD_PLUGINS]))


#: Idle keep-alive seconds when neither --guard-keep-alive-timeout nor VLLM_HTTP_TIMEOUT_KEEP_ALIVE is set:
#: above the 60 s idle timeout of nginx upstream pools and AWS/Azure load balancers.
DEFAULT_KEEP_ALIVE_S = 75


def keep_alive_timeout(settings: GuardSettings) -> int:
    """Seconds uvicorn keeps an idle connection: ``--guard-keep-alive-timeout``, else vLLM's own
    ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` when the operator set it, else :data:`DEFAULT_KEEP_ALIVE_S`."""
    if settings.keep_alive_timeout is not None:
        return math.ceil(settings.keep_alive_timeout)
    if "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" in os.environ:
        import vllm.envs as envs

        return envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    return DEFAULT_KEEP_ALIVE_S


def uvicorn_extras(args: argparse.Namespace) -> dict[str, Any]:
    """The ``vllm serve`` flags vLLM's launcher hands to uvicorn that vlguard's server honours the same way
    (:mod:`server.front_flags`): ``--ssl-ciphers`` when set, ``--h11-max-incomplete-event-size`` (vLLM's
    default, 4 MiB, as stock passes it; it bounds a request's header block under the h11 parser), the log
    configuration (``--log-config-file``, ``--disable-access-log-for-endpoints``: :mod:`server.launcher`)."""
    extras: dict[str, Any] = {}
    if args.ssl_ciphers:
        extras["ssl_ciphers"] = args.ssl_ciphers
    if args.h11_max_incomplete_event_size is not None:
        extras["h11_max_incomplete_event_size"] = args.h11_max_incomplete_event_size
    if (log_config := launcher.uvicorn_log_config(args)) is not None:
        extras["log_config"] = log_config
    return extras


def listen_socket(args: argparse.Namespace) -> socket.socket:
    """The server's socket, bound (not yet listening) before the engine is built, as ``vllm serve`` does.

    Bound first so that a port in use fails the start at once (not after minutes of model loading), and
    so that the engine's own processes, which pick free ports for their ZMQ sockets while they start, can
    never take the HTTP port (vLLM issue #8204). ``SO_REUSEADDR`` only: a second server on the same port
    is an error, not a silent share (``vllm serve`` also sets ``SO_REUSEPORT``).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    if getattr(args, "uds", None):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(args.uds)
        return sock
    host = args.host or "0.0.0.0"  # vllm serve's default: all interfaces
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, args.port))
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server that also tells the supervisor at once when SIGTERM/SIGINT arrives (uvicorn itself
    looks at its exit flag only once the application has started, which can take minutes), and that
    starts uvicorn's shutdown (stop accepting, close idle connections, drain) ``delay_s`` seconds after the
    first signal (``--guard-shutdown-delay``; at once on a second signal)."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_signal: Callable[[], None],
        delay_s: float = 0.0,
        args: argparse.Namespace | None = None,
    ) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.delay_s = delay_s
        self.args = args
        self.signals: list[int] = []
        self._delayed: threading.Timer | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's ``serve``, with ``--enable-ssl-refresh``'s certificate refresher running meanwhile."""
        if not self.config.loaded:
            self.config.load()
        refresher = launcher.start_ssl_refresh(self.config, self.args) if self.args is not None else None
        try:
            await super().serve(sockets)
        finally:
            if refresher is not None:
                refresher.stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, which ends the process by the signal it caught on its way out (its default action runs
        no exit handler): this server's temp folders are removed first (:mod:`server.run_dirs`)."""
        with super().capture_signals():
            try:
                yield
            finally:
                if self.signals:
                    run_dirs.remove_all()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        self.on_signal()  # /ready turns 503; only schedules work on the event loop: safe in a signal handler
        if self.delay_s > 0 and len(self.signals) == 1 and self.started:
            # uvicorn only reads its exit flag, so setting it from a timer thread is safe.
            self._delayed = threading.Timer(self.delay_s, super().handle_exit, args=(sig, None))
            self._delayed.daemon = True
            self._delayed.start()
            return
        if self._delayed is not None:
            self._delayed.cancel()
        super().handle_exit(sig, frame)


def api_server_count(args: argparse.Namespace) -> int:
    """``--api-server-count`` (1 when unset)."""
    return int(getattr(args, "api_server_count", None) or 1)


def serve_api(
    args: argparse.Namespace,
    settings: GuardSettings,
    sock: socket.socket,
    factory: EngineFactory,
    state_dir: str,
    spares: Spares | None = None,
    reap_children: bool = False,
    on_supervisor: Callable[[Supervisor], None] | None = None,
) -> int:
    """Serve vlguard's app on ``sock`` with a supervisor over the engines ``factory`` builds, until
    SIGINT/SIGTERM or until the supervisor gives up; the exit status (see :func:`run`).

    Arguments:
        state_dir: the supervisor's (removed at its shutdown).
        spares, reap_children: as :class:`~server.guard.supervisor.Supervisor` takes them.
        on_supervisor: called with the supervisor once it is made, before the app.
    """
    import vllm

    from server.app import create_app
    from server.guard.supervisor import Supervisor
    from server.http_protocol import http_protocol
    from server.vllm_hooks import missing_hooks

    if missing := missing_hooks():  # the plugins ran in this process too: a hook that found nothing
        for target, why in missing.items():
            logger.critical("vlguard cannot hook vLLM %s: %s", target, why)
        logger.critical("vLLM %s is not supported by this vlguard (docs/architecture.md)", vllm.__version__)
        sock.close()
        shutil.rmtree(state_dir, ignore_errors=True)
        return EXIT_STARTUP_FAILED
    supervisor = Supervisor(
        factory,
        settings,
        state_dir=state_dir,
        reap_children=reap_children,
        spares=spares,
        forensics=forensics(args, settings),
    )
    if on_supervisor is not None:
        on_supervisor(supervisor)
    try:
        app = create_app(args, settings, supervisor)
    except ValueError as exc:  # what vlguard cannot honour (a media connector of a plugin's): refused at start
        logger.critical("cannot start: %s", exc)
        sock.close()
        shutil.rmtree(state_dir, ignore_errors=True)
        return EXIT_STARTUP_FAILED
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=keep_alive_timeout(settings),
        forwarded_allow_ips=settings.forwarded_allow_ips,  # None: FORWARDED_ALLOW_IPS, else 127.0.0.1
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout),  # SIGTERM: drain in-flight requests, bounded
        # a request's headers within --guard-header-timeout and --guard-max-header-kb
        http=http_protocol(settings.header_timeout, settings.max_header_kb * 1024),
        **uvicorn_extras(args),
    )
    server = _Server(config, on_signal=supervisor.request_stop, delay_s=settings.shutdown_delay, args=args)

    def give_up() -> None:
        server.should_exit = True

    supervisor.on_failed = give_up
    return _serve(server, sock, supervisor)


def prepare_vllm_processes(args: argparse.Namespace, settings: GuardSettings) -> None:
    """What every vLLM process of this server reads, written before vLLM loads its plugins here (when the
    engine arguments are built); spawned engine processes inherit it: vlguard's plugins allowed, the
    :class:`ServeSettings`, and the replay-safe processor cache (its API half installed here; off, with
    ``args.mm_processor_cache_gb = 0``, where it cannot be installed)."""
    from server.vllm_hooks import processor_cache as replay_cache

    allowed = plugin_allowlist(os.environ.get("VLLM_PLUGINS"))
    if allowed is not None:
        os.environ["VLLM_PLUGINS"] = allowed
    serve_settings = ServeSettings(settings.patches, True, settings.alignment_max_capture_size or 0)
    serve_settings.apply()
    # Replays need the processor cache's API half to keep the images' data: installed here, where it lives;
    # the engine processes (the plugin, told by ServeSettings.replay_cache) keep vLLM's receiver cache, shm
    # made lru.
    try:
        logger.info("replay-safe processor cache: %s wrapped", replay_cache.install())
        if not replay_cache.plugin_installed():
            raise ImportError("entry point vlguard_replay_cache missing: reinstall vlguard")
    except ImportError as exc:
        logger.warning("processor cache off, so that replays stay safe: %s", exc)
        args.mm_processor_cache_gb = 0
        dataclasses.replace(serve_settings, replay_cache=False).apply()  # the engines have nothing to install


def _serve(server: _Server, sock: socket.socket, supervisor: Supervisor) -> int:
    """Run uvicorn on ``sock`` until it stops; the exit status (see :func:`run`)."""
    from server.guard.states import EngineState

    try:
        # After a signal-initiated shutdown uvicorn re-raises the signal: the process ends here.
        server.run(sockets=[sock])
    except SystemExit:
        if not server.signals:
            raise
        # A stop requested during start-up ends the start-up with uvicorn's "startup failed" exit;
        # end as a stop instead, like uvicorn does after a normal shutdown (SIGTERM: status 143).
    for sig in reversed(server.signals):  # this server's temp folders are gone (_Server.capture_signals)
        # by its default action: a process started with SIGINT ignored (a background job of a script)
        # would otherwise go on, and exit 3 as if the start-up had failed
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)
    if not server.started:
        logger.error("server did not start (engine state: %s)", supervisor.state.value)
        return EXIT_STARTUP_FAILED
    if supervisor.state is EngineState.FAILED:
        logger.critical("engine could not be restarted; exiting with status %d", EXIT_ENGINE_FAILED)
        return EXIT_ENGINE_FAILED
    return EXIT_OK
