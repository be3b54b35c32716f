"""What vlguard does with each front-end flag of ``vllm serve``: one table, checked at start.

The engine flags (``AsyncEngineArgs``) reach vLLM's engine as they are. The others (``vllm serve``'s front
end) are read by vLLM's serving layer, by vLLM's routes, by vlguard's own server code, or by vLLM's launcher,
which vlguard does not run. Each is one of:

* ``VLLM``: read by vLLM's app builder (``build_app``), serving layer (``init_app_state``) or routes, whose
  app vlguard serves behind its shell (:mod:`server.api.stock_app`): stock behaviour by construction;
* ``VLGUARD``: vlguard's server honours it itself (address, TLS, CORS, the API key of body requests, root
  path), or does what vLLM's launcher does with vLLM's own helpers (:mod:`server.launcher`);
* ``REFUSED``: read only by parts of vLLM's launcher vlguard does not do yet: a launch line
  that sets it to anything but its default is refused at start (exit 2, the flag and why named), never
  accepted and dropped.

A flag not in the table (a later vLLM's) is refused at start when set, and ``tests/unit/test_front_flags.py``
fails on that vLLM's lane until it is classified.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum


class FlagKind(enum.Enum):
    VLLM = "vllm"
    VLGUARD = "vlguard"
    REFUSED = "refused"


_V, _G, _R = FlagKind.VLLM, FlagKind.VLGUARD, FlagKind.REFUSED
_LAUNCHER = "vLLM's launcher reads it and vlguard does not run that launcher yet"

#: Front-end flag (its ``dest``) -> (kind, why it is refused).
FRONT_FLAGS: dict[str, tuple[FlagKind, str]] = {
    # vLLM's serving layer (init_app_state) and routes, as vlguard builds and serves them
    **{dest: (_V, "") for dest in (
        "chat_template", "chat_template_content_format", "default_chat_template_kwargs", "enable_auto_tool_choice",
        "enable_force_include_usage", "enable_log_deltas", "enable_log_outputs", "enable_prompt_tokens_details",
        "enable_tokenizer_info_endpoint", "exclude_tools_when_tool_choice_none", "lora_modules", "max_log_len",
        "response_role", "return_tokens_as_token_ids", "tool_call_parser", "tool_server", "trust_request_chat_template",
        "enable_server_load_tracking", "anthropic_disabled_thinking_effort", "cohere_format",
        "cohere_is_reasoning_model", "reasoning_effort_map", "tool_strict_level", "trust_request_mm_kwargs",
        "sse_keep_alive_interval", "enable_per_request_metrics", "fingerprint_mode", "fingerprint_value",
        "enable_scale_out", "enable_flash_late_interaction", "model_tag", "config",
        # vLLM's app builder, whose app vlguard serves (server/api/stock_app.py)
        "middleware", "enable_request_id_headers", "enable_offline_docs", "disable_fastapi_docs", "log_error_stack",
    )},
    # vlguard's own server
    **{dest: (_G, "") for dest in (
        "host", "port", "uds", "api_key", "root_path", "allow_credentials", "allowed_origins", "allowed_methods",
        "allowed_headers", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "uvicorn_log_level",
        "disable_uvicorn_access_log", "print_config", "ssl_ciphers",
        "h11_max_incomplete_event_size",
        # what vLLM's launcher does, done with its own helpers (server/launcher.py)
        "tool_parser_plugin", "log_config_file", "disable_access_log_for_endpoints", "enable_ssl_refresh",
        # vLLM 0.32's queue caps (engine flags there), backported by vlguard's door where vLLM lacks them
        "max_num_queued_reqs", "max_num_queued_tokens",
    )},
    "api_server_count": (_G, ""),  # an owner of the engine and N guarded API processes (server/scaleout)
    "headless": (_R, "vlguard serves the API it guards; a headless engine has none"),
    "headless_client_handshake_address": (_R, _LAUNCHER),
    "grpc": (_R, "vlguard serves HTTP only"),
    "grpc_port": (_R, "vlguard serves HTTP only"),
    "data_parallel_supervisor_port": (_R, _LAUNCHER),
    "dp_supervisor_probe_interval_s": (_R, _LAUNCHER),
    "dp_supervisor_probe_timeout_s": (_R, _LAUNCHER),
    "dp_supervisor_probe_failure_threshold": (_R, _LAUNCHER),
    "h11_max_header_count": (_R, _LAUNCHER),
}  # fmt: skip


def front_end_dests(serve_parser: argparse.ArgumentParser) -> list[str]:
    """The ``dest`` of every front-end flag of ``serve_parser`` (vLLM's serve parser as vlguard builds it):
    every flag but the engine's (``AsyncEngineArgs``), ``--help`` and vlguard's own ``--guard-*``."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    dests = {action.dest for action in serve_parser._actions}
    return sorted(d for d in dests if d not in engine and d != "help" and not d.startswith("guard_"))


def refused(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> list[str]:
    """One line per front-end flag ``args`` sets that vlguard cannot honour (``--flag``: why); empty when
    every flag set is honoured."""
    lines = []
    for dest in front_end_dests(serve_parser):
        kind, why = FRONT_FLAGS.get(dest, (_R, "a front-end flag vlguard does not know yet"))
        value, default = getattr(args, dest, None), serve_parser.get_default(dest)
        if kind is _R and value != default:
            lines.append(f"--{dest.replace('_', '-')} {value!r}: {why}")
    if (count := getattr(args, "api_server_count", None) or 1) > 1 and (why := _scale_out_refused(args)):
        lines.append(f"--api-server-count {count}: {why}")
    return lines


def _scale_out_refused(args: argparse.Namespace) -> str:
    """Why vlguard cannot run ``args``'s N > 1 API processes here ("" when it can: :mod:`server.scaleout`)."""
    if (getattr(args, "data_parallel_size", 1) or 1) > 1:
        return "vlguard scales out the API processes of one engine core; data parallel is not driven"
    if getattr(args, "mm_tensor_ipc", None) == "torch_shm":
        return "--mm-tensor-ipc torch_shm: its queue can only be inherited, and the owner relaunches engines"
    import vllm.envs as envs

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        return "VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with several API processes (as vllm serve refuses it)"
    from server.scaleout.owner import unsupported_reason

    return unsupported_reason() or ""


#: Where vlguard's front end differs from ``vllm serve``'s on purpose, each with why: what ``--print-config``
#: shows under ``front_differences`` and the start-up log names (the README's table of differences lists
#: these and the engine side's, ``server.serve.vllm_changes``).
DIFFERENCES: dict[str, str] = {
    "keep_alive": "idle keep-alive 75 s, not 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE or --guard-keep-alive-timeout set it): "
    "a pooling proxy reuses connections after its own idle timeout, 60 s typically",
    "shutdown": "SIGTERM drains in-flight requests for 30 s (--shutdown-timeout, --guard-drain-timeout), not abort",
    "health": "/health (and /ping) is liveness, 200 while the guard can recover the engine; /ready is readiness",
    "errors": "vlguard's exception map replaces vLLM's handlers: a client's bad input is 4xx where vLLM answers "
    "some 500, an engine death is 503 + Retry-After and the server serves on (vLLM's handler stops it); a "
    "client's error vLLM's Anthropic route logs with its stack is one INFO line (--log-error-stack keeps it)",
    "routes": "internal and operator POST routes, and POST routes vlguard does not know yet, are 404 "
    "(server/api/routes.py)",
    "api_key": "with --api-key every request with a body needs the key, refused before its body is read "
    "(vLLM: /v1 only)",
    "headers": "a repeated Authorization, X-Request-Id or Content-Type header is 400; a request's headers must "
    "arrive within --guard-header-timeout",
    "door": "request bodies, media, prompt length and known poison are bounded before vLLM sees them "
    "(docs/input.md): 4xx in the OpenAI error envelope",
    "middleware_order": "vLLM's app, its middleware (--middleware, request-id headers) included, runs behind "
    "vlguard's shell: a request the shell refuses, and the shell's own routes (/health, /ping, /ready, /metrics, "
    "/version, /admin), never reach it",
    "images": "EXIF orientation, transparency on white and 16-bit scaling applied where the installed vLLM "
    "lacks them (docs/input.md)",
    "media": "every media item vLLM loads meets the media policy in its connector: schemes, remote media, "
    "pixels, frames, media_io_kwargs; a part's uuid is dropped (--guard-trust-client-uuids keeps it)",
    "refused_inputs": "image_embeds, audio_embeds and image_pil parts, and structured-output constraints the "
    "engine's backend would crash on, are 400",
    "admin": "/admin/quarantine lists and clears quarantined fingerprints (closed without a key)",
}
