"""transformers' check of a processor call's keyword arguments, with its compiled form kept (API process).

Backport of huggingface/transformers PR #45807 (in transformers 5.19.0 here; not in 5.6.2, the version vLLM
0.20.0 and 0.22.1 install). At every call of a Hugging Face processor (vLLM's renderer calls Qwen3-VL's for
every request with an image), ``ProcessorMixin._merge_kwargs`` checks each modality's keyword arguments with
huggingface_hub's ``validate_typed_dict(schema, kwargs)``. That builds a strict dataclass from the schema
(a ``TypedDict``) and keeps it by the schema object (``functools.lru_cache``). For a modality whose
preprocessor declares its own ``valid_kwargs`` (images, videos), 5.6.2 merges the two into a **new**
``TypedDict`` at every call, so the kept dataclass is never found again: every processor call makes and
compiles one such dataclass a modality (``make_dataclass``, ``exec`` of its ``__init__``): two for Qwen3-VL,
whose image and video processors both declare theirs, an image-only request too. A profile of the front
scenario put it at about a tenth of the API process's worker-thread CPU.

:func:`install` replaces ``validate_typed_dict`` as transformers' processing module calls it: the schema
is exchanged for the first one seen with the same content (name, totality, annotations), so equal merged
schemas share one kept dataclass. The check is the same: the same fields, types, validators and
requiredness, only carried by an earlier, equal class object. A schema whose annotations cannot be hashed
is passed on as it came; at most :data:`MAX_SCHEMAS` contents are kept (the rest pass on as they came).
Upstream keys the merged ``TypedDict`` by the two classes it merges; this keys it by content, which needs no
change inside ``_merge_kwargs``. Annotations compare by equality: ``Union[int, str]`` equals
``Union[str, int]``, so a schema listing a union's members in another order would name them in the first's
order in its error message (transformers' schemas are not total, and huggingface_hub's own wrapping of
their fields already goes through typing's cache keyed the same way).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

from server.vllm_hooks import wrap

MODULE = "transformers.processing_utils"
#: Distinct schema contents kept (a process serves one model: a few per modality).
MAX_SCHEMAS = 256

#: schema content -> the first schema seen with it
_schemas: dict[Hashable, Any] = {}


def _content(schema: Any) -> Hashable | None:
    """What a ``TypedDict`` checks: its name, totality and annotations; None when they cannot be hashed."""
    try:
        annotations = inspect.get_annotations(schema)  # its own, as huggingface_hub reads them
        key = (getattr(schema, "__name__", None), getattr(schema, "__total__", True), tuple(annotations.items()))
        hash(key)
    except (TypeError, ValueError):  # not a class, annotations not a dict, or one that cannot be hashed
        return None
    return key


def canonical(schema: Any) -> Any:
    """The first schema seen with ``schema``'s content (``schema`` itself when it is the first, when its
    content cannot be hashed, or when :data:`MAX_SCHEMAS` contents are kept already)."""
    key = _content(schema)
    if key is None:
        return schema
    found = _schemas.get(key)
    if found is not None:
        return found
    if len(_schemas) >= MAX_SCHEMAS:
        return schema
    return _schemas.setdefault(key, schema)


def upstream_fixed() -> bool:
    """Whether the installed transformers builds each merged schema once itself (PR #45807: its processing
    module then has ``_merge_typed_dict``)."""
    import importlib

    return hasattr(importlib.import_module(MODULE), "_merge_typed_dict")


def install() -> str:
    """Hand transformers' per-call check equal schemas as one object, where transformers lacks PR #45807.
    Idempotent.

    Returns:
        What was done, for the start-up log.
    Raises:
        HookTargetMissing: transformers' processing module has no ``validate_typed_dict``.
    """
    import importlib

    if upstream_fixed():
        return "transformers keeps each merged processor schema itself (PR #45807): not needed"
    module = importlib.import_module(MODULE)

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def validate_typed_dict(schema: Any, data: dict[str, Any]) -> None:
            original(canonical(schema), data)

        return validate_typed_dict

    wrap(module, "validate_typed_dict", make, f"{MODULE}.validate_typed_dict")
    return "transformers' processor schemas kept by content (backport of transformers PR #45807)"
