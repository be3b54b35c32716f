"""Request fields that vLLM's serving layer accepts but then mishandles, fixed before it uses them.

``/v1/completions`` with ``"max_tokens": null``: vLLM 0.20.0 and 0.22.1 pass the null on, compute a
generation limit from it, and then their response builders ``assert request.max_tokens is not None``: the
request ends in a 500. vLLM 0.32.0 fixed it in the request model (``CompletionRequest.
normalize_null_max_tokens``: null means the field's default, 16, as in the OpenAI API reference for
completions, "Defaults to 16"). Backport: the same, applied to the parsed request before it is rendered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from server.vllm_hooks import async_llm


def install_completion_fixes(serving: Any) -> None:
    """Wrap ``render_completion_request`` of vLLM's ``OpenAIServingCompletion`` instance ``serving``
    (:func:`server.vllm_hooks.async_llm.wrap_completion_rendering`) so a ``max_tokens: null`` request is
    rendered with the field's default instead (see the module docstring). A no-op on vLLM versions whose
    request model already does it (the null never reaches the wrapper)."""

    def fixed(render: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(render)
        async def render_completion_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            if request.max_tokens is None:
                request.max_tokens = type(request).model_fields["max_tokens"].default
            return await render(request, *args, **kwargs)

        return render_completion_request

    async_llm.wrap_completion_rendering(serving, fixed)
