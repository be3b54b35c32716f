"""The embedded tiny Qwen3-VL is deterministic and shaped as vLLM expects."""

from __future__ import annotations

import json
from pathlib import Path

from server.devmodel import build_tiny_model


def test_two_builds_are_byte_identical(tmp_path: Path, tiny_model: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_config_has_deepstack_and_token_ids(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [12, 10, 10]
    tokenizer = json.loads((tiny_model / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert config["image_token_id"] == added["<|image_pad|>"]
    assert config["vision_start_token_id"] == added["<|vision_start|>"]


def test_chat_template_puts_image_placeholder(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>user\nhi<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"


def test_the_cli_builds_the_cached_model_once_without_importing_vllm(tmp_path: Path) -> None:
    """``vlguard tiny-model`` (what ``make serve`` runs): the stable cache path, built on the first call,
    found on the second, and no vLLM import (it runs before every ``make serve``)."""
    import os
    import subprocess
    import sys

    code = "import sys; from server.cli import main; main(['tiny-model']); assert 'vllm' not in sys.modules"
    env = {**os.environ, "VLGUARD_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]  # fmt: skip
    first, second = (Path(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert first == second and first.parent == tmp_path and first.name.startswith("tiny-qwen3-vl-")
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no second build left behind
    assert (first / "model.safetensors").exists()
