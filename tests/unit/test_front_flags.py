"""#46 (part): every front-end flag of this lane's ``vllm serve`` parser is classified (honoured by vLLM's
serving layer or routes as vlguard builds them, honoured by vlguard, or refused at start); a flag vlguard
cannot honour is refused at start with its name and why, never accepted and dropped."""

from __future__ import annotations

import pytest

from server.args import build_parser, resolve_serve_args, serve_parser
from server.front_flags import FRONT_FLAGS, FlagKind, front_end_dests


def test_every_front_end_flag_of_this_vllm_is_classified() -> None:
    unclassified = [d for d in front_end_dests(serve_parser(build_parser())) if d not in FRONT_FLAGS]
    assert unclassified == [], "classify them in server/front_flags.py"


@pytest.mark.parametrize(
    "flags",
    [
        ["--headless"],
        ["--grpc"],
        ["--h11-max-header-count", "10"],
        ["--middleware", "no.such.module.Middleware"],  # vLLM's builder would fail on it after the engine was built
        ["--tool-parser-plugin", "/nonexistent/plugin.py"],
    ],
)
def test_a_flag_vlguard_cannot_honour_is_refused_at_start(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        resolve_serve_args(["serve", "m", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"vlguard serve: {flags[0]}" in err and ":" in err.split(flags[0], 1)[1]


def test_api_server_count_is_honoured_where_vlguard_drives_the_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    from server.scaleout.owner import unsupported_reason

    if (why := unsupported_reason()) is None:  # vLLM 0.20-0.22: an owner and N guarded API processes
        args, _ = resolve_serve_args(["serve", "m", "--api-server-count", "2"])
        assert args.api_server_count == 2
    else:  # a later vLLM binds its API processes' listeners itself: refused at start, saying why
        with pytest.raises(SystemExit) as exit_:
            resolve_serve_args(["serve", "m", "--api-server-count", "2"])
        assert exit_.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit):  # data parallel engines are not driven through the guard
        resolve_serve_args(["serve", "m", "--api-server-count", "2", "--data-parallel-size", "2"])
    with pytest.raises(SystemExit):  # a tensor queue only a child at its start can inherit
        resolve_serve_args(["serve", "m", "--api-server-count", "2", "--mm-tensor-ipc", "torch_shm"])


def test_launcher_flags_vlguard_honours_reach_its_uvicorn() -> None:
    from server.serve import uvicorn_extras

    args, _ = resolve_serve_args(["serve", "m"])
    assert "ssl_ciphers" not in uvicorn_extras(args)  # uvicorn's own cipher list, as stock
    args, _ = resolve_serve_args(["serve", "m", "--ssl-ciphers", "ECDHE-RSA-AES128-GCM-SHA256",
                                  "--h11-max-incomplete-event-size", "65536"])  # fmt: skip
    assert uvicorn_extras(args) == {
        "ssl_ciphers": "ECDHE-RSA-AES128-GCM-SHA256",
        "h11_max_incomplete_event_size": 65536,
    }


def test_honoured_and_default_flags_start() -> None:
    args, _ = resolve_serve_args(["serve", "m", "--api-server-count", "1", "--enable-server-load-tracking",
                                  "--allowed-origins", '["https://a.example"]', "--root-path", "/x",
                                  "--enable-request-id-headers", "--enable-offline-docs", "--log-error-stack",
                                  "--enable-ssl-refresh", "--disable-access-log-for-endpoints", "/health",
                                  "--middleware", "tests.api.test_front_parity.TaggingMiddleware"])  # fmt: skip
    assert args.enable_server_load_tracking and args.root_path == "/x" and args.enable_request_id_headers
    assert all(kind in FlagKind for kind, _ in FRONT_FLAGS.values())
