"""The served model's facts the door's poison rules need (:class:`server.api.poison.PoisonRules`), read
from vLLM's configs and tokenizer once the engine is up, and the structured-output compile check.

The compile check (:func:`server.vllm_hooks.structured_output.xgrammar_compiler`) runs vLLM's own code for
the backend the engine compiles with: the API-side validation
(``validate_xgrammar_grammar``: choices become a grammar, Lark becomes EBNF), the engine's key
(``get_structured_output_key``) and ``XgrammarBackend.compile_grammar`` over the served tokenizer, as the
engine core's ``StructuredOutputManager`` does (vllm#43920; the engine-side fix is vllm PR #47312).
With ``auto`` the engine latches onto xgrammar for its first constraint, so a constraint xgrammar
cannot compile is refused even though vLLM's per-request validation would fall back to guidance.
Other configured backends (guidance, outlines, lm-format-enforcer) are not compiled at the door: their
faults are charged to the request by the engine guard.
"""

from __future__ import annotations

from typing import Any

from server.api.poison import PoisonRules
from server.vllm_hooks import structured_output

#: hf_config attributes naming multimodal placeholder tokens (Qwen2/2.5/3-VL and most VLMs).
_PLACEHOLDER_ATTRS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "image_token_index",
    "video_token_index",
)


def placeholder_tokens(hf_config: Any, tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's strings for the model's multimodal placeholder tokens (``<|image_pad|>`` ...)."""
    ids = {getattr(hf_config, a, None) for a in _PLACEHOLDER_ATTRS}
    ids |= {getattr(getattr(hf_config, "text_config", None), a, None) for a in _PLACEHOLDER_ATTRS}
    found = []
    for token_id in sorted(i for i in ids if isinstance(i, int)):
        try:
            token = tokenizer.convert_ids_to_tokens(token_id)
        except Exception:
            continue
        if isinstance(token, str) and token:
            found.append(token)
    return tuple(found)


def poison_rules(model_config: Any, vllm_config: Any, tokenizer: Any) -> PoisonRules:
    """The door's facts about the served model (see :mod:`server.api.poison`); without a tokenizer
    (``--skip-tokenizer-init``) no placeholder strings and no compile check."""
    vocab_size, max_model_len = int(model_config.get_vocab_size()), int(model_config.max_model_len)
    if tokenizer is None:
        return PoisonRules(vocab_size=vocab_size, max_model_len=max_model_len)
    return PoisonRules(
        vocab_size=vocab_size,
        placeholders=placeholder_tokens(model_config.hf_config, tokenizer),
        compile_constraint=structured_output.xgrammar_compiler(vllm_config, tokenizer, vocab_size),
        max_prompt_chars=max_prompt_chars(max_model_len, tokenizer),
        max_model_len=max_model_len,
    )


def max_prompt_chars(max_model_len: int, tokenizer: Any) -> int | None:
    """``max_model_len`` times the longest token in characters, for a byte-level BPE tokenizer (Qwen's: every
    byte of any text is covered by tokens, a token's string holds a character per byte, so no token covers
    more characters of text than its string is long). None for other tokenizers (a WordPiece ``[UNK]`` may
    cover a whole word) or when the tokenizer lists no vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if "ByteLevel" not in repr(getattr(backend, "pre_tokenizer", None)):
        return None
    try:
        longest = max(map(len, tokenizer.get_vocab()))
    except Exception:  # a tokenizer without a vocabulary listing (a Mistral tokenizer, say)
        return None
    return max_model_len * max(longest, 1)
