"""The FastAPI application: vlguard's shell around vLLM's own app over the guarded engine client.

``create_app(args, settings, supervisor)`` assembles the shell (transport, CORS, door, admission, vlguard's
routes); its lifespan owns the engine through the supervisor's async context manager (always shut down on
exit) and, once the engine is up, has vLLM's builder make vLLM's app over a :class:`GuardedEngineClient`
(:mod:`server.api.stock_app`), which answers every request vlguard's own routes do not.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from server.api import parsed_body
from server.api.admin import router as admin_router
from server.api.admission import AdmissionMiddleware
from server.api.errors import install_error_handlers
from server.api.health import router as health_router
from server.api.input_guard import InputGuardMiddleware
from server.api.media import BOUNDS_PENDING, PixelBounds, server_pixel_bounds
from server.api.media_policy import MediaPolicy
from server.api.model_facts import poison_rules
from server.api.overload import AdmissionGate, QueueCaps
from server.api.stock_app import StockApp, ToStockApp, build_stock_app, route_lines
from server.api.transport import TransportMiddleware
from server.guard.engine_client import GuardedEngineClient
from server.guard.supervisor import EngineState, Supervisor
from server.guard.systemd import Notifier
from server.settings import GuardSettings
from server.vllm_hooks import hf_processor, media_connector

logger = logging.getLogger(__name__)


def _tokenizer(client: GuardedEngineClient) -> Any:
    """The served tokenizer, or None (``--skip-tokenizer-init``)."""
    try:
        return client.renderer.get_tokenizer()
    except ValueError:
        return None


def _api_keys(args: argparse.Namespace) -> list[str]:
    """The API keys the server requires (``--api-key``, else ``VLLM_API_KEY``); empty: none."""
    import vllm.envs as envs

    return [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]


def _add_cors(app: FastAPI, args: argparse.Namespace) -> None:
    """CORS as ``vllm serve`` applies it (vLLM's app leaves it to this shell: :mod:`server.api.stock_app`)."""
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )


async def _report_state_forever(supervisor: Supervisor, notifier: Notifier) -> None:
    """``STATUS=`` for systemctl status: the engine state and generation, on every change."""
    last = None
    while True:
        now = (supervisor.state.value, supervisor.generation)
        if now != last:
            notifier.status(f"engine {now[0]} (generation {now[1]})")
            last = now
        await asyncio.sleep(supervisor.settings.watchdog_interval)


def _pixel_bounds(model_config: Any) -> PixelBounds | None:
    """The processed image size bounds of the served model: its image processor's configuration
    (``preprocessor_config.json``, or ``image_processor`` in the newer ``processor_config.json``)
    overridden by ``--mm-processor-kwargs``; ``None`` when the model states none."""
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    config: dict[str, Any] = {}
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        try:
            found = get_hf_file_to_dict(name, model_config.model, model_config.revision)
        except Exception:  # the hub unreachable for a file it never had: try the next
            found = None
        if isinstance(found, dict):
            config = found.get(key, {}) if key else found
            break
    multimodal = getattr(model_config, "multimodal_config", None)
    bounds = server_pixel_bounds(config, getattr(multimodal, "mm_processor_kwargs", None))
    if bounds is None:
        logger.warning("%s states no image pixel bounds: per-request pixel bounds not enforced", model_config.model)
    return bounds


#: The modalities whose per-prompt item limits the door applies (:func:`server.api.media.count_items`).
_MODALITIES = ("image", "video", "audio")


def _item_limits_from_args(args: argparse.Namespace) -> dict[str, int]:
    """The per-prompt media limits ``--limit-mm-per-prompt`` sets (a count, or ``{"count": N, ...}``),
    before the engine is up; modalities it leaves out keep vLLM's default (not applied until then)."""
    limits: dict[str, int] = {}
    for modality, value in (getattr(args, "limit_mm_per_prompt", None) or {}).items():
        count = value.get("count") if isinstance(value, dict) else value
        if isinstance(count, int):
            limits[modality] = count
    return limits


def _item_limits(model_config: Any) -> dict[str, int]:
    """The engine's per-prompt media limits (vLLM's ``MultiModalConfig.get_limit_per_prompt``: 0 for a
    modality a text-only model or ``--language-model-only`` refuses); empty for a model without one."""
    multimodal = getattr(model_config, "multimodal_config", None)
    if multimodal is None:
        return {}
    return {modality: int(multimodal.get_limit_per_prompt(modality)) for modality in _MODALITIES}


def admission_gate(args: argparse.Namespace, settings: GuardSettings, supervisor: Supervisor) -> AdmissionGate:
    """Admission under load (:mod:`server.api.overload`) over the supervisor's measure of its engine: the
    queue caps (``--max-num-queued-reqs``/``-tokens``, this API process's share), ``--guard-max-queue-wait``,
    and after the body's parse under ``--scheduling-policy priority``."""
    caps = QueueCaps.of(
        getattr(args, "max_num_queued_reqs", None),
        getattr(args, "max_num_queued_tokens", None),
        getattr(args, "api_server_count", None) or 1,
    )
    after_parse = getattr(args, "scheduling_policy", "fcfs") == "priority"
    supervisor.load.processes = getattr(args, "api_server_count", None) or 1
    return AdmissionGate(supervisor.load, settings.max_queue_wait, settings.inflight_share, caps, after_parse)


def create_app(args: argparse.Namespace, settings: GuardSettings, supervisor: Supervisor) -> FastAPI:
    """Build the vlguard app.

    Arguments:
        args: parsed ``vlguard serve`` arguments (vLLM's serve namespace).
        settings: vlguard's own options.
        supervisor: owns the engine; started by the app's lifespan, shut down when it ends.
    """

    notifier = Notifier()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        notifier.status("loading engine")
        async with supervisor.running():
            client = GuardedEngineClient(supervisor)
            tasks = await client.get_supported_tasks()
            stock.app = vllm_app = await build_stock_app(args, client, tasks)
            logger.info("serving vLLM's app: %s", ", ".join(route_lines(vllm_app)))
            app.state.pixel_bounds = _pixel_bounds(client.model_config)
            app.state.item_limits = _item_limits(client.model_config)
            app.state.poison_rules = poison_rules(client.model_config, client.vllm_config, _tokenizer(client))
            background = [asyncio.create_task(notifier.watchdog_forever(supervisor.healthy))]
            background.append(asyncio.create_task(_report_state_forever(supervisor, notifier)))
            # vLLM's app's own lifespan, as vllm serve runs it: its stats logging (unless --disable-log-stats),
            # the start-up heap moved out of the collector's reach (without it the API process spent 21.1
            # vs stock's 17.2 ms CPU per image request: docs/benchmarks.md), its shutdown hooks
            async with vllm_app.router.lifespan_context(vllm_app):
                notifier.ready()
                try:
                    yield
                finally:
                    notifier.stopping()
                    for task in background:
                        task.cancel()
                    media.decoder.shutdown()

    # Every media item vLLM loads (any route, any part shape) meets the media policy inside vLLM's media layer.
    media = MediaPolicy.of(settings, args)
    media_connector.install(media, trust_client_uuids=settings.trust_client_uuids)
    if settings.patches:  # a backport: --guard-patches off leaves transformers as it is, like the others
        logger.info("%s", hf_processor.install())
    parsed_body.install()  # vLLM's routes take the door's parse of a body: parsed once
    # The docs are vLLM's app's (--disable-fastapi-docs, --enable-offline-docs as stock)
    app = FastAPI(title="vlguard", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    stock = StockApp()
    app.router.default = stock  # what vlguard's own routes do not answer: vLLM's app (503 until it is built)
    app.state.supervisor = supervisor
    app.state.settings = settings
    app.state.args = args
    app.state.media = media  # the media policy (its decode pool: tests spy on it)
    app.state.pixel_bounds = BOUNDS_PENDING  # read from the model's processor once the engine is up
    app.state.poison_rules = None  # likewise
    app.state.item_limits = _item_limits_from_args(args)  # the engine's own once it is up
    app.root_path = args.root_path
    app.include_router(health_router)
    app.include_router(admin_router)
    # Starlette puts each added middleware in front: on the way in, the transport (repeated headers, the API
    # key of a body request), CORS (as vllm serve), input guard (limits, media), admission (engine ready); then
    # vlguard's routes, else vLLM's app with its own middleware (the API key on /v1, request ids, --middleware),
    # reached directly (ToStockApp) for a path none of vlguard's routes has.
    own_paths = [route.path for route in (*health_router.routes, *admin_router.routes) if hasattr(route, "path")]
    app.add_middleware(ToStockApp, stock=stock, paths=own_paths)  # vLLM's routes: past the shell's router
    app.add_middleware(AdmissionMiddleware, supervisor=supervisor, keys=len(_api_keys(args)))
    app.add_middleware(
        InputGuardMiddleware,
        settings=settings,
        media=media,
        pixel_bounds=lambda: app.state.pixel_bounds,
        item_limits=lambda: app.state.item_limits,
        poison_rules=lambda: app.state.poison_rules,
        engine_ready=lambda: supervisor.state is EngineState.READY,
        expose=lambda guard: setattr(app.state, "input_guard", guard),
        keys=len(_api_keys(args)),
        gate=admission_gate(args, settings, supervisor),
    )
    _add_cors(app, args)
    app.add_middleware(TransportMiddleware, keys=_api_keys(args))  # outermost: before anything reads the request
    install_error_handlers(app, log_error_stack=bool(args.log_error_stack))
    return app
