"""Request shapes of the users' two-pass safety-monitoring traffic.

Each image is sent twice. The primary pass is one user turn, the question first and the image last.
The rescue pass repeats that turn unchanged and adds a follow-up user turn with longer instructions, so
it is longer and shares the primary's whole prefix up to and including the image. With prefix caching
(block size 16 on GPU, 32 on CPU) the cache hit ends on a block boundary *inside* the image and the
step prefills a small residual that starts there: the step shape that crashes vLLM 0.20.0 under
CUDA-graph padding (``Requested more deepstack tokens than available in buffer``).
"""

from __future__ import annotations

from typing import Any

PRIMARY_PROMPT = "Check this camera frame for safety hazards. Answer yes or no."
RESCUE_PROMPT = (
    "The first answer was unclear. Look again carefully: list every person, whether each one is wearing "
    "a helmet and a vest, and any fire, smoke or blocked door you can see."
)


def primary_messages(image_uri: str, prompt: str = PRIMARY_PROMPT) -> list[dict[str, Any]]:
    """First pass: one user turn, the text first and the image last."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": prompt},
                {"type": "image_url", "image_url": {"url": image_uri}},
            ],
        }
    ]


def rescue_messages(image_uri: str, prompt: str = PRIMARY_PROMPT, rescue: str = RESCUE_PROMPT) -> list[dict[str, Any]]:
    """Second pass on the same image: the primary turn unchanged, then the longer rescue instructions."""
    return [*primary_messages(image_uri, prompt), {"role": "user", "content": rescue}]
