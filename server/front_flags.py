"""What vlguard does with each front-end flag of ``vllm serve``: one table, checked at start.

The engine flags (``AsyncEngineArgs``) reach vLLM's engine as they are. The others (``vllm serve``'s front
end) are read by vLLM's serving layer, by vLLM's routes, by vlguard's own server code, or by vLLM's launcher,
which vlguard does not run. Each is one of:

* ``VLLM``: read by vLLM's serving layer (``init_app_state``) or by vLLM's own routes, which vlguard builds
  and serves as they are: stock behaviour by construction;
* ``VLGUARD``: vlguard's server honours it itself (address, TLS files, CORS, API key, root path, docs);
* ``REFUSED``: read only by vLLM's launcher or app builder, which vlguard does not run yet: a launch line
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
    )},
    # vlguard's own server
    **{dest: (_G, "") for dest in (
        "host", "port", "uds", "api_key", "root_path", "allow_credentials", "allowed_origins", "allowed_methods",
        "allowed_headers", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "uvicorn_log_level",
        "disable_uvicorn_access_log", "disable_fastapi_docs", "print_config", "ssl_ciphers",
        "h11_max_incomplete_event_size",
    )},
    "api_server_count": (_R, "one API process only: the guard does not span several yet"),
    "headless": (_R, "vlguard serves the API it guards; a headless engine has none"),
    "headless_client_handshake_address": (_R, _LAUNCHER),
    "grpc": (_R, "vlguard serves HTTP only"),
    "grpc_port": (_R, "vlguard serves HTTP only"),
    "data_parallel_supervisor_port": (_R, _LAUNCHER),
    "dp_supervisor_probe_interval_s": (_R, _LAUNCHER),
    "dp_supervisor_probe_timeout_s": (_R, _LAUNCHER),
    "dp_supervisor_probe_failure_threshold": (_R, _LAUNCHER),
    "middleware": (_R, "vLLM's app builder imports it and vlguard does not run that builder yet"),
    "enable_request_id_headers": (_R, "vLLM's app builder adds the header middleware and vlguard does not run it yet"),
    "tool_parser_plugin": (_R, "vLLM's launcher imports the plugin (without it the parser name fails after the "
                               "engine was built)"),
    "log_config_file": (_R, _LAUNCHER),
    "disable_access_log_for_endpoints": (_R, _LAUNCHER),
    "log_error_stack": (_R, "vLLM's own exception handler reads it; vlguard's maps errors itself"),
    "enable_ssl_refresh": (_R, _LAUNCHER + " (vlguard would keep the old certificate)"),
    "enable_offline_docs": (_R, "vLLM's app builder serves the docs offline and vlguard does not run it yet"),
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
        if kind is _R and value != default and not (dest == "api_server_count" and value in (None, 1)):
            lines.append(f"--{dest.replace('_', '-')} {value!r}: {why}")
    return lines
