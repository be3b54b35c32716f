"""Defect detection by behaviour: classes shaped like each upstream state get exactly their patches."""

from __future__ import annotations

from typing import Any

import torch

from server.patches import detect
from server.patches.deepstack import EMPTY_BUFFER, PADDED_READ


class Stock020:
    """Behaves like vLLM 0.20.0: raises on padded reads and clears, None on an empty buffer."""

    def _get_deepstack_input_embeds(self, num_tokens: int) -> Any:
        if self.deepstack_input_embeds_num_tokens == 0:  # type: ignore[attr-defined]
            return None
        if num_tokens > self.deepstack_input_embeds_num_tokens:  # type: ignore[attr-defined]
            raise ValueError("Requested more deepstack tokens than available in buffer")
        return {"x": torch.zeros(num_tokens)}

    def _clear_deepstack_input_embeds(self, num_tokens: int) -> None:
        if self.deepstack_input_embeds_num_tokens and num_tokens > self.deepstack_input_embeds_num_tokens:  # type: ignore[attr-defined]
            raise ValueError("Requested to clear more deepstack tokens than available")


class Stock022:
    """Behaves like vLLM 0.22.1: padded reads fine, None on an empty buffer."""

    def _get_deepstack_input_embeds(self, num_tokens: int) -> Any:
        if self.deepstack_input_embeds_num_tokens == 0:  # type: ignore[attr-defined]
            return None
        return {"x": torch.zeros(num_tokens)}

    def _clear_deepstack_input_embeds(self, num_tokens: int) -> None:
        return None


class Fixed:
    """Behaves like vLLM >= 0.23: always tensors, never raises."""

    def _get_deepstack_input_embeds(self, num_tokens: int) -> Any:
        return {"x": torch.zeros(num_tokens)}

    def _clear_deepstack_input_embeds(self, num_tokens: int) -> None:
        return None


class Unknown:
    """A future layout that reads attributes the probe does not provide: never patched."""

    def _get_deepstack_input_embeds(self, num_tokens: int) -> Any:
        return self.some_new_buffer[:num_tokens]  # type: ignore[attr-defined]

    def _clear_deepstack_input_embeds(self, num_tokens: int) -> None:
        self.some_new_buffer.zero_()  # type: ignore[attr-defined]


def test_each_upstream_state_gets_exactly_its_patches() -> None:
    assert detect.defects(Stock020) == [PADDED_READ, EMPTY_BUFFER]
    assert detect.defects(Stock022) == [EMPTY_BUFFER]
    assert detect.defects(Fixed) == []
    assert detect.defects(Unknown) == []
    assert detect.defects(object) == []


def test_patch_model_class_respects_the_switch(monkeypatch: Any) -> None:
    import server.patches as plugin
    from server.patches import deepstack

    monkeypatch.setattr(plugin, "_applied", {})
    off, on = type("Off", (Stock020,), {}), type("On", (Stock020,), {})
    monkeypatch.setenv(plugin.ENV, "off")
    assert plugin.patch_model_class(off) == []
    assert off._get_deepstack_input_embeds is Stock020._get_deepstack_input_embeds
    monkeypatch.setenv(plugin.ENV, "on")
    assert plugin.patch_model_class(on) == [PADDED_READ, EMPTY_BUFFER]
    assert on._get_deepstack_input_embeds is deepstack.get_deepstack_input_embeds
    assert plugin.patch_model_class(on) == [PADDED_READ, EMPTY_BUFFER]  # idempotent
