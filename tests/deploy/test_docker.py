"""The Docker image's build file and entrypoint, checked without building it (fast). The image built and
run by a real Docker engine: test_docker_engine.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
BIN = Path(sys.executable).parent
#: The users' launch line (config/qwen3-vl-30b-a3b-fp8.yaml reproduces it), as the stock image's arguments.
LAUNCH_LINE = (
    "--model Qwen/Qwen3-VL-30B-A3B-Instruct-FP8 --quantization fp8 --kv-cache-dtype fp8_e4m3 "
    "--max-model-len 8192 --gpu-memory-utilization 0.50 --enable-prefix-caching --enable-chunked-prefill "
    "--max-num-seqs 40 --seed 0"
)
#: What vlguard adds to vLLM's engine arguments (server.serve.engine_overrides), and nothing else.
OVERRIDES = {"scheduler_cls", "additional_config"}
STOCK_PACKAGES = re.compile(r"^(vllm|torch|torchvision|torchaudio|triton|xformers|flashinfer|nvidia-)", re.I)


def _run_lines() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]


def test_hadolint_passes() -> None:
    result = subprocess.run([str(BIN / "hadolint"), str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_stock_image_is_the_base() -> None:
    text = DOCKERFILE.read_text()
    assert "ARG VLLM_IMAGE=vllm/vllm-openai:v0.20.0" in text
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", text, re.M)
    assert 'ENTRYPOINT ["dumb-init", "--single-child", "--", "vlguard-entrypoint"]' in text
    assert "HEALTHCHECK" in text and "/health" in text


def test_the_image_runs_as_a_non_root_user_that_owns_only_its_home() -> None:
    """#47: the last USER is uid 10001 (group 0), the caches live in its home."""
    text = DOCKERFILE.read_text()
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] == "10001:0"
    assert "HF_HOME=/home/vlguard/.cache/huggingface" in text and 'VOLUME ["/home/vlguard/.cache/huggingface"]' in text


def test_the_image_never_reinstalls_vllm_or_torch() -> None:
    """Every pip install is --no-deps and names no vLLM, torch or CUDA package: the stock builds stay."""
    installs = [cmd for line in _run_lines() for cmd in line.split("&&") if "pip install" in cmd]
    assert installs, "no pip install found"
    for cmd in installs:
        words = shlex.split(cmd)
        assert "--no-deps" in words, cmd
        packages = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
        assert not [p for p in packages if STOCK_PACKAGES.match(p)], cmd
        assert not [w for w in words if w in ("-U", "--upgrade", "--force-reinstall")], cmd


#: The entrypoint's dry runs: the users' flags, the model positional (as ``docker run
#: vllm/vllm-openai:... MODEL ...``), the shipped profile.
DRY_RUNS = {
    "flags": LAUNCH_LINE,
    "positional-model": LAUNCH_LINE.replace("--model ", ""),
    "profile": f"--config {REPO / 'config' / 'qwen3-vl-30b-a3b-fp8.yaml'}",
}


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, dict[str, Any]]:
    """Each of :data:`DRY_RUNS` through the entrypoint, all at once (each imports vLLM: ~9 s alone)."""
    env = dict(os.environ, VLGUARD_DRY_RUN="1", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    runs = {
        name: subprocess.Popen(
            ["sh", str(ENTRYPOINT), *shlex.split(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for name, args in DRY_RUNS.items()
    }
    resolved = {}
    try:
        for name, run in runs.items():
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, f"{name}: exit {run.returncode}\n{err[-3000:]}"
            resolved[name] = json.loads(out)
    finally:
        for run in runs.values():  # none outlives a failure
            run.kill()
            run.wait()
    return resolved


def _vllm_serve_engine_args(args: str) -> dict[str, Any]:
    """The engine arguments vLLM's own ``vllm serve`` parser builds from ``args`` (as JSON, like the dry run)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.vllm_hooks.locations import vllm_symbol

    make_arg_parser = vllm_symbol("make_arg_parser")

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    parser.add_argument("model_tag", nargs="?")
    ns = parser.parse_args(shlex.split(args))
    if ns.model_tag:
        ns.model = ns.model_tag
    engine = {f.name: getattr(ns, f.name) for f in dataclasses.fields(AsyncEngineArgs) if hasattr(ns, f.name)}
    return json.loads(json.dumps(engine, sort_keys=True, default=repr))  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", DRY_RUNS)
def test_entrypoint_resolves_the_engine_arguments_vllm_serve_would(name: str, dry_runs: dict[str, Any]) -> None:
    args, resolved = DRY_RUNS[name], dry_runs[name]
    engine = resolved["engine"]
    # The profile is the launch line plus a per-prompt media limit (#44: vLLM's default is 999 a prompt).
    media = """ --limit-mm-per-prompt '{"image": 4, "video": 0}'""" if args.startswith("--config") else ""
    stock = _vllm_serve_engine_args(LAUNCH_LINE + media)
    assert set(engine) == set(stock)
    differing = {k for k in engine if engine[k] != stock[k]}
    assert differing <= OVERRIDES, {k: (engine[k], stock[k]) for k in differing - OVERRIDES}
    assert engine["model"] == "Qwen/Qwen3-VL-30B-A3B-Instruct-FP8" and engine["max_num_seqs"] == 40
    assert engine["scheduler_cls"] == "server.alignment.scheduler.AlignedScheduler"
    assert resolved["frontend"]["port"] == 8000  # the stock image's port
