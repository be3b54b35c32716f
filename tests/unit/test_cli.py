"""``vlguard serve`` argument handling: vLLM's own parser plus guard flags, profiles and env."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server.args import describe_config, resolve_serve_args

REPO = Path(__file__).resolve().parents[2]
PRODUCTION_LINE = (
    "--model Qwen/Qwen3-VL-30B-A3B-Instruct-FP8 --quantization fp8 --kv-cache-dtype fp8_e4m3 --max-model-len 8192 "
    "--gpu-memory-utilization 0.50 --enable-prefix-caching --enable-chunked-prefill --max-num-seqs 40 --seed 0"
).split()


def test_production_line_prints_config_without_loading(tmp_path: Path) -> None:
    # A separate process with no network and no GPU: parsing must not load or download anything.
    out = subprocess.run(
        [sys.executable, "-m", "server", "serve", *PRODUCTION_LINE, "--print-config"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    engine = cfg["engine"]
    assert engine["model"] == "Qwen/Qwen3-VL-30B-A3B-Instruct-FP8"
    assert engine["quantization"] == "fp8"
    assert engine["kv_cache_dtype"] == "fp8_e4m3"
    assert engine["max_model_len"] == 8192
    assert engine["gpu_memory_utilization"] == 0.5
    assert engine["enable_prefix_caching"] is True
    assert engine["enable_chunked_prefill"] is True
    assert engine["max_num_seqs"] == 40
    assert engine["seed"] == 0
    assert cfg["guard"]["patches"] is True
    assert engine["mm_processor_cache_gb"] > 0  # vLLM's default: left on, in its replay-safe form
    assert engine["additional_config"] == {"vlguard_deepstack_patches": "v1"}
    changes = cfg["vlguard_changes"]  # every change to vLLM's behaviour, one line each
    assert set(changes) == {"scheduler_cls", "additional_config", "mm_processor_cache_type", "model", "compile_cache"}
    assert {"keep_alive", "shutdown", "errors", "routes"} <= set(cfg["front_differences"])  # each with why
    assert changes["mm_processor_cache_type"].startswith("lru (shm becomes lru), its API half kept")


@pytest.mark.full_only  # vlguard's own order of start-up (bind, then build): the same on every lane; 14-22 s
def test_a_port_in_use_fails_the_start_before_the_engine_is_built(tmp_path: Path) -> None:
    """The HTTP port is bound before the engine is built (as ``vllm serve`` does): a port in use ends the
    start at once with status 3, and the engine's processes can never take the port while they start (a CI
    run lost a server that way: "address already in use" after 39 s of engine start-up)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "server", "serve", *PRODUCTION_LINE, "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)},
        )  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "EngineCore" not in out.stderr and "engine start" not in out.stderr


def test_production_profile_equals_production_line() -> None:
    profile = REPO / "config" / "qwen3-vl-30b-a3b-fp8.yaml"
    # The users' line, plus the per-prompt media limit the profile adds (#44: vLLM's default is 999 a prompt).
    media = ["--limit-mm-per-prompt", '{"image": 4, "video": 0}']
    from_line = describe_config(*resolve_serve_args(["serve", *PRODUCTION_LINE, *media]))
    from_profile = describe_config(*resolve_serve_args(["serve", "--config", str(profile)]))
    assert from_profile["engine"] == from_line["engine"]


def test_guard_flag_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLGUARD_PATCHES", "off")
    _, settings = resolve_serve_args(["serve", "m", "--guard-patches", "on"])
    assert settings.patches is True
    _, settings = resolve_serve_args(["serve", "m"])
    assert settings.patches is False


def test_guard_option_in_profile(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text('guard-patches: "off"\nguard-startup-timeout: 60\nmax-model-len: 1024\n')
    args, settings = resolve_serve_args(["serve", "m", "--config", str(profile)])
    assert settings.patches is False and settings.startup_timeout == 60
    assert args.max_model_len == 1024


def test_invalid_guard_value_is_refused() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        resolve_serve_args(["serve", "m", "--guard-startup-timeout", "-5"])


def test_an_invalid_guard_value_is_a_usage_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.cli import main
    from server.metrics import registry

    # `serve` switches this process's metrics to multiprocess mode: not in the test process
    monkeypatch.setattr(registry, "prepare_multiprocess_dir", lambda: None)

    with pytest.raises(SystemExit) as exited:
        main(["serve", "m", "--guard-body-share", "1.5", "--guard-hold-timeout", "-5"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--guard-body-share: Input should be less than or equal to 1" in err and "--guard-hold-timeout" in err
    assert "Traceback" not in err


def test_unknown_flag_is_refused() -> None:
    with pytest.raises(SystemExit):
        resolve_serve_args(["serve", "m", "--no-such-flag"])


@pytest.mark.parametrize("profile", ["tiny-cpu.yaml", "qwen3-vl-30b-a3b-fp8.yaml"])
def test_shipped_profiles_also_parse_for_stock_vllm(profile: str) -> None:
    # Rollback to stock `vllm serve --config <profile>` must keep working: no guard-* keys in them.
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.vllm_hooks.locations import vllm_symbol

    make_arg_parser = vllm_symbol("make_arg_parser")

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--config", str(REPO / "config" / profile)])
    assert args.enable_prefix_caching is True


def test_keep_alive_flag_then_vllm_variable_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.serve import DEFAULT_KEEP_ALIVE_S, keep_alive_timeout
    from server.settings import GuardSettings

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert keep_alive_timeout(GuardSettings()) == DEFAULT_KEEP_ALIVE_S == 75
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "30")
    assert keep_alive_timeout(GuardSettings()) == 30
    assert keep_alive_timeout(GuardSettings(keep_alive_timeout=620)) == 620


def test_vllm_shutdown_timeout_is_the_drain_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLGUARD_DRAIN_TIMEOUT", raising=False)
    assert resolve_serve_args(["serve", "m", "--shutdown-timeout", "90"])[1].drain_timeout == 90
    assert resolve_serve_args(["serve", "m"])[1].drain_timeout == 30  # vLLM's 0 ("abort") changes nothing
    both = ["serve", "m", "--shutdown-timeout", "90", "--guard-drain-timeout", "5"]
    assert resolve_serve_args(both)[1].drain_timeout == 5
