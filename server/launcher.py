"""What vLLM's launcher does around its app (``setup_server``, ``build_and_serve``, ``serve_http``), done
for vlguard's server with vLLM's own helpers, so that the flags read only there behave as stock:

* before the engine is built: ``--tool-parser-plugin`` imported into vLLM's tool parser registry, the tool and
  reasoning parser names checked (vLLM's ``validate_api_server_args``), every ``--middleware`` importable
  (stock finds a bad one only after the engine was built; vLLM's builder imports it again then);
* uvicorn's log configuration: ``--log-config-file``, else ``--disable-access-log-for-endpoints`` (vLLM's
  ``get_uvicorn_log_config``);
* ``--enable-ssl-refresh``: the served certificate, key and CA reloaded when their files change (vLLM's
  ``SSLCertRefresher`` over uvicorn's SSL context).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
from typing import Any, Protocol

import uvicorn


class Stoppable(Protocol):
    def stop(self) -> None: ...


def prepare(args: argparse.Namespace) -> None:
    """Check and load what vLLM's launcher loads before it builds the engine.

    Raises:
        ValueError: a ``--tool-parser-plugin`` file that is not there, a tool or reasoning parser name
            vLLM does not know (after the plugin), a ``--middleware`` that does not import or is neither a
            class nor a coroutine function (as vLLM's builder requires).
    """
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    from server.vllm_hooks.locations import vllm_symbol

    plugin = getattr(args, "tool_parser_plugin", "") or ""
    if len(plugin) > 3:  # vLLM's own test for "given" (its default is "")
        if not os.path.isfile(plugin):
            raise ValueError(f"--tool-parser-plugin {plugin}: no such file")
        ToolParserManager.import_tool_parser(plugin)
    try:
        vllm_symbol("validate_api_server_args")(args)
    except KeyError as exc:
        raise ValueError(exc.args[0] if exc.args else str(exc)) from None
    for path in getattr(args, "middleware", None) or []:
        _check_middleware(path)


def _check_middleware(path: str) -> None:
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--middleware {path}: does not import ({exc})") from None
    if not (inspect.isclass(found) or inspect.iscoroutinefunction(found)):
        raise ValueError(f"--middleware {path}: must be a class or a coroutine function")


def uvicorn_log_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """uvicorn's ``log_config`` for ``args`` as vLLM's launcher builds it; None: uvicorn's own."""
    from server.vllm_hooks.locations import vllm_symbol

    found: dict[str, Any] | None = vllm_symbol("get_uvicorn_log_config")(args)
    return found


def start_ssl_refresh(config: uvicorn.Config, args: argparse.Namespace) -> Stoppable | None:
    """With ``--enable-ssl-refresh`` and TLS on, vLLM's certificate refresher over ``config``'s loaded SSL
    context (call inside the server's event loop; ``stop()`` it at shutdown); else None."""
    if not getattr(args, "enable_ssl_refresh", False) or config.ssl is None:
        return None
    from server.vllm_hooks.locations import vllm_symbol

    refresher: Stoppable = vllm_symbol("SSLCertRefresher")(
        ssl_context=config.ssl, key_path=config.ssl_keyfile, cert_path=config.ssl_certfile, ca_path=config.ssl_ca_certs
    )
    return refresher
