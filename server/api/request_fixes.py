"""Request fields that vLLM's serving layer accepts but then mishandles, made explicit before it uses them.

``/v1/completions`` with ``"max_tokens": null``: vLLM computes the generation limit correctly (the rest of
the context, as on ``/v1/chat/completions``) but its response builders then ``assert request.max_tokens
is not None`` and the request ends in a 500 (vLLM 0.20.0 to 0.32.0, ``completion/serving.py``). vlguard
sets ``max_tokens`` to the limit vLLM itself would compute, right after the prompt is rendered and before
the engine sees the request: for several prompts in one request, the limit of the longest.
"""

from __future__ import annotations

import functools
from typing import Any


def null_max_tokens_limit(serving: Any, engine_inputs: list[Any]) -> int:
    """The ``max_tokens`` vLLM uses for a request without one: the context left after the longest prompt,
    capped by the model's generation config and ``--override-generation-config`` (tokens)."""
    longest = max((serving._extract_prompt_len(i) for i in engine_inputs), default=0)
    limits = [serving.model_config.max_model_len - longest]
    limits += [v for v in (serving.default_sampling_params.get("max_tokens"), serving.override_max_tokens) if v]
    return max(1, min(limits))  # a prompt that fills the context: vLLM's own 400 says so


def install_completion_fixes(serving: Any) -> None:
    """Wrap ``render_completion_request`` of vLLM's ``OpenAIServingCompletion`` instance ``serving`` so a
    ``max_tokens: null`` request leaves rendering with the explicit limit (see the module docstring)."""
    render = serving.render_completion_request

    @functools.wraps(render)
    async def render_completion_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = await render(request, *args, **kwargs)
        if request.max_tokens is None and isinstance(result, list):
            request.max_tokens = null_max_tokens_limit(serving, result)
        return result

    serving.render_completion_request = render_completion_request
