"""Engine-core side: vLLM's structured-output backend keeps no compiled grammars (vLLM plugin
``vlguard_grammar_cache``).

Distinct constraints, one request each, grew the engine core by ~1.6 MB apiece past xgrammar's cache bound
(:func:`server.vllm_hooks.structured_output.forget_compiled_grammars` has the figures): one client could
grow it until the OOM killer ended it with every request in flight. Each constraint is compiled afresh
instead (~1.2 ms for a typical JSON schema, against ~0.6 ms from the cache).
"""

from __future__ import annotations

import logging

from server.engine.protocol import EngineSettings
from server.vllm_hooks import HookTargetMissing
from server.vllm_hooks.structured_output import forget_compiled_grammars

logger = logging.getLogger("vllm.vlguard.grammar_cache")


def register() -> None:
    """Plugin entry point. Idempotent; never raises into vLLM. Off outside ``vlguard serve`` (no state
    directory in :class:`EngineSettings`)."""
    if not EngineSettings.state_dir_of():
        return
    try:
        forget_compiled_grammars()
    except HookTargetMissing as exc:  # recorded: vlguard serve refuses to start (server.vllm_hooks.missing_hooks)
        logger.warning("vlguard: compiled grammars are kept (%s)", exc)
