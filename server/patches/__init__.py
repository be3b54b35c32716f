"""vLLM general plugin (entry point ``vllm.general_plugins``: ``vlguard_patches``).

vLLM calls :func:`register` in the API, engine-core and worker processes.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Plugin entry point. Idempotent; never raises into vLLM."""
    return None
