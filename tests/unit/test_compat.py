"""server.vllm_hooks.locations: each moved vLLM name resolves on the installed lane, from the location that lane uses,
and behaves as vlguard expects. (The scheduler's 4-vs-5-value encoder schedule is covered by
test_aligned_scheduler on every lane; the padding emulation's keyword arguments by the padded servers.)"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest

from server.vllm_hooks import locations as compat
from tests.lanes import VLLM_VERSION

#: vLLM version -> whether the OpenAI front end has moved to its 0.32 layout.
NEW_LAYOUT = {"0.20.0": False, "0.22.1": False, "0.32.0": True, "0.34.0": True}
#: names that moved again in 0.34 (0.32 has them at their second location)
MOVED_IN_034 = {"make_arg_parser", "validate_parsed_serve_args", "validate_api_server_args"}


@pytest.mark.parametrize("name", sorted(compat.MOVED))
def test_each_moved_name_comes_from_the_lanes_location(name: str) -> None:
    locations = compat.MOVED[name]
    if not NEW_LAYOUT[VLLM_VERSION]:
        expected = locations[-1]
    elif name in MOVED_IN_034 and VLLM_VERSION == "0.32.0":
        expected = locations[1]
    else:
        expected = locations[0]
    assert compat.source_of(name) == expected
    assert compat.vllm_symbol(name) is getattr(sys.modules[compat.source_of(name)], name)


def test_serve_parser_and_validation() -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = compat.vllm_symbol("make_arg_parser")(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--max-model-len", "64", "--enable-prefix-caching"])
    assert (args.model, args.max_model_len, args.enable_prefix_caching) == ("m", 64, True)
    compat.vllm_symbol("validate_parsed_serve_args")(args)  # raises on invalid combinations only


def test_error_envelope_and_vllms_error_classification() -> None:
    info = compat.vllm_symbol("ErrorInfo")(message="m", type="Bad Request", param="p", code=400)
    body = compat.vllm_symbol("ErrorResponse")(error=info).model_dump()
    assert body["error"] == {"message": "m", "type": "Bad Request", "param": "p", "code": 400}
    err = compat.vllm_symbol("create_error_response")(ValueError("bad value"))
    assert err.error.code == 400 and "bad value" in err.error.message


def test_auth_middleware_and_app_state_initialiser() -> None:
    middleware = compat.vllm_symbol("AuthenticationMiddleware")
    assert "tokens" in inspect.signature(middleware).parameters
    init_app_state = compat.vllm_symbol("init_app_state")
    assert asyncio.iscoroutinefunction(init_app_state)
    assert list(inspect.signature(init_app_state).parameters)[:3] == ["engine_client", "state", "args"]


def test_a_broken_location_is_an_error_not_a_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A module that exists but fails on one of its own imports must surface, not be skipped silently.
    (tmp_path / "vlguard_broken_mod.py").write_text("import vlguard_no_such_dependency\n")
    (tmp_path / "vlguard_ok_mod.py").write_text("thing = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(compat.MOVED, "thing", ("vlguard_absent_pkg.mod", "vlguard_ok_mod"))
    assert compat.vllm_symbol("thing") == 42  # absent newer location: falls back
    monkeypatch.setitem(compat.MOVED, "thing", ("vlguard_broken_mod", "vlguard_ok_mod"))
    with pytest.raises(ModuleNotFoundError, match="vlguard_no_such_dependency"):
        compat.vllm_symbol("thing")
    monkeypatch.setitem(compat.MOVED, "thing", ("vlguard_absent_pkg.mod",))
    with pytest.raises(ImportError, match="unsupported vLLM version"):
        compat.vllm_symbol("thing")


#: where each lane's renderer chooses and builds its processor cache (0.32 layout, older layout).
CACHE_HOOKS = {
    "_get_cache_type": (
        "vllm.multimodal.cache.factories._get_cache_type",
        "vllm.multimodal.registry.MultiModalRegistry._get_cache_type",
    ),
    "processor_cache_from_config": (
        "vllm.renderers.base.processor_cache_from_config",
        "vllm.multimodal.registry.MultiModalRegistry.processor_cache_from_config",
    ),
}


@pytest.mark.parametrize("name", sorted(CACHE_HOOKS))
def test_processor_cache_hooks_are_wrapped_where_the_lane_defines_them(name: str) -> None:
    from server.vllm_hooks.processor_cache import engine_receiver, replay_safe

    expected = CACHE_HOOKS[name][0 if NEW_LAYOUT[VLLM_VERSION] else 1]
    owner_path, _, attr = expected.rpartition(".")
    module, _, cls = owner_path.rpartition(".")
    target: Any = (
        importlib.import_module(owner_path) if cls.islower() else getattr(importlib.import_module(module), cls)
    )
    original = getattr(target, attr)
    wrap = compat.wrap_mm_cache_type if name == "_get_cache_type" else compat.wrap_mm_processor_cache_factory
    try:
        assert wrap(engine_receiver if name == "_get_cache_type" else replay_safe) == expected
        assert getattr(target, attr).__wrapped__ is original
    finally:
        setattr(target, attr, original)


@pytest.mark.parametrize(("chosen", "engine_choice"), [
    ("lru", "lru"), ("shm", "lru"), ("processor_only", "processor_only"), (None, None),
])  # fmt: skip
def test_engine_processes_keep_a_receiver_cache(chosen: str | None, engine_choice: str | None) -> None:
    from server.vllm_hooks.processor_cache import engine_receiver

    def method(self: object, vllm_config: object) -> str | None:  # the 0.20 - 0.22 signature
        return chosen

    def function(vllm_config: object) -> str | None:  # the 0.32 signature
        return chosen

    assert engine_receiver(method)(object(), object()) == engine_choice
    assert engine_receiver(function)(object()) == engine_choice


def test_the_renderer_gets_processor_only_where_vllm_builds_its_lru_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from vllm.multimodal.cache import MultiModalProcessorOnlyCache

    from server.vllm_hooks import processor_cache as replay_cache

    monkeypatch.setattr(replay_cache, "_replaced", False)
    mm = SimpleNamespace(mm_processor_cache_gb=0.01)
    config = SimpleNamespace(model_config=SimpleNamespace(get_multimodal_config=lambda: mm))
    sender = compat.lru_sender_cache(config.model_config)
    assert type(sender).__name__ == compat.LRU_SENDER_CACHES[0 if NEW_LAYOUT[VLLM_VERSION] else -1]

    def method(self: object, vllm_config: object) -> object:  # the 0.20 - 0.22 signature
        return sender

    def function(vllm_config: object) -> object:  # the 0.32 signature
        return None

    assert replay_cache.replay_safe(function)(config) is None and not replay_cache.engine_keeps_cache()
    assert isinstance(replay_cache.replay_safe(method)(object(), config), MultiModalProcessorOnlyCache)
    assert replay_cache.engine_keeps_cache()
