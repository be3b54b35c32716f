"""#46: what vLLM's launcher does around its app, done by vlguard's server with vLLM's own helpers
(:mod:`server.launcher`): the tool parser plugin, parser names and ``--middleware`` checked before the
engine is built; uvicorn's log configuration; the TLS certificate refreshed from its files."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.args import resolve_serve_args
from server.serve import uvicorn_extras

PLUGIN = """
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager


@ToolParserManager.register_module("vlguard_parity_parser")
class ParityParser(ToolParser):
    pass
"""


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        resolve_serve_args(["serve", "m", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_tool_parser_plugin_is_loaded_before_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "vlguard_parity_parser"]
    assert "invalid tool call parser: vlguard_parity_parser" in refusal(tools, capsys)  # as stock, before the engine
    plugin = tmp_path / "parity_plugin.py"
    plugin.write_text(PLUGIN)
    args, _ = resolve_serve_args(["serve", "m", *tools, "--tool-parser-plugin", str(plugin)])
    assert args.tool_call_parser == "vlguard_parity_parser"
    assert "no such file" in refusal(["--tool-parser-plugin", str(tmp_path / "absent.py")], capsys)


@pytest.mark.parametrize(
    ("path", "why"),
    [("no.such.module.Middleware", "does not import"), ("json.nothing", "does not import"),
     ("json.JSONDecoder.__doc__", "does not import"), ("json.dumps", "class or a coroutine function")],
)  # fmt: skip
def test_a_middleware_that_vllm_would_not_take_is_refused_at_start(
    path: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert why in refusal(["--middleware", path], capsys)


def test_uvicorn_log_config_as_vllms_launcher(tmp_path: Path) -> None:
    args, _ = resolve_serve_args(["serve", "m"])
    assert "log_config" not in uvicorn_extras(args)  # uvicorn's own
    args, _ = resolve_serve_args(["serve", "m", "--disable-access-log-for-endpoints", "/health,/metrics"])
    config = uvicorn_extras(args)["log_config"]
    logging.config.dictConfig(config)
    access = logging.getLogger("uvicorn.access")
    filters = [f for handler in access.handlers for f in handler.filters] + list(access.filters)
    assert filters, config

    def shown(path: str) -> bool:
        record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                   ("127.0.0.1:1", "GET", path, "1.1", 200), None)  # fmt: skip
        return all(f.filter(record) for f in filters)

    assert not shown("/health") and not shown("/metrics") and shown("/v1/models")
    own = {"version": 1, "disable_existing_loggers": False, "loggers": {"uvicorn": {"level": "WARNING"}}}
    path = tmp_path / "log.json"
    path.write_text(json.dumps(own))
    args, _ = resolve_serve_args(["serve", "m", "--log-config-file", str(path)])
    assert uvicorn_extras(args)["log_config"] == own


def _certificate(directory: Path, name: str) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", f"/CN={name}", "-keyout", str(directory / "key.pem"),
         "-out", str(directory / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip


def _served_name(port: int) -> str:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).subject.rfc4514_string()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """vlguard's uvicorn server with ``--enable-ssl-refresh`` on a throwaway certificate (127.0.0.1)."""
    import uvicorn

    from server.serve import _Server

    _certificate(tmp_path, "first")

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        return None

    args, _ = resolve_serve_args(["serve", "m", "--enable-ssl-refresh", "--ssl-keyfile", str(tmp_path / "key.pem"),
                                  "--ssl-certfile", str(tmp_path / "cert.pem")])  # fmt: skip
    config = uvicorn.Config(app, lifespan="off", ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    server = _Server(config, on_signal=lambda: None, args=args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        for _ in range(500):  # up to 5 s for uvicorn to start
            if server.started:
                break
            threading.Event().wait(0.01)
        assert server.started
        yield sock.getsockname()[1], tmp_path
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_ssl_refresh_serves_the_new_certificate(tls_server: tuple[int, Path]) -> None:
    port, directory = tls_server
    assert _served_name(port) == "CN=first"
    _certificate(directory, "second")
    for _ in range(300):  # the file watcher reloads within a few seconds; up to 30 s
        if _served_name(port) == "CN=second":
            break
        threading.Event().wait(0.1)
    assert _served_name(port) == "CN=second"
