"""The embedded default model: a deterministic tiny Qwen3-VL built offline.

vLLM 0.20.0 loads the result as ``Qwen3VLForConditionalGeneration`` with deepstack (two deepstack
visual layers), so both deepstack bugs are reachable on a CPU in seconds. Nothing is downloaded: the
byte-level BPE tokenizer is trained here on a generated corpus and the weights are random with a fixed
seed, so two builds give byte-identical weight files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 0
VOCAB_SIZE = 1024  # embedding rows; the trained tokenizer uses fewer
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Longest image edge budget: a 512x512 image is (512/16)^2 / 2^2 = 256 tokens after the 2x2 merge.
MAX_PIXELS = 512 * 512
MIN_PIXELS = 32 * 32

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_WORDS = (
    "the a an image photo picture camera scene person people worker helmet vest hazard safety fire smoke "
    "ladder forklift door window floor wall road car truck sign light dark left right top bottom near far "
    "is are was not no yes there here what which where who describe list count check report alert ok "
    "primary rescue monitor frame zone area risk unsafe safe wearing standing sitting walking running red "
    "green blue yellow white black one two three four five many few small large inside outside of in on "
    "with without and or to from for by at this that these those answer question please carefully again"
).split()


def _corpus(lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        sentence = " ".join(words).capitalize() + rng.choice((".", "?", "!", ","))
        out.append(sentence + f" {rng.randint(0, 999)}")
    return out


def _build_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 64,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    return Qwen2Tokenizer(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,  # type: ignore[arg-type]  # Qwen tokenizers have no unk token
        bos_token=None,
    )


def build_tiny_model(out_dir: str | Path) -> Path:
    """Write the tiny Qwen3-VL (config, weights, tokenizer, processors, chat template) to ``out_dir``.

    Dimensions: text hidden 128, intermediate 256, 4 layers, 2 heads, 1 KV head, head_dim 64,
    mrope_section [12, 10, 10]; vision depth 2, hidden 64, patch 16, spatial merge 2, deepstack
    layers [0, 1]. Weights are bfloat16 (~3 MB). Deterministic: same bytes on every build.

    Returns:
        The output directory.
    """
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    config = Qwen3VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "max_position_embeddings": 8192,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [12, 10, 10],
                "mrope_interleaved": True,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 128,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [0, 1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]

    torch.manual_seed(SEED)
    model = Qwen3VLForConditionalGeneration(config).to(dtype=torch.bfloat16).eval()  # type: ignore[call-arg]
    model.save_pretrained(out, safe_serialization=True)

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids["<|im_end|>"], "do_sample": False}, indent=2) + "\n"
    )
    return out
