"""What the installed vLLM (the engine lane) is expected to get wrong, so tests assert the right thing on
every lane: the upstream defect where it still exists, its absence where upstream fixed it.

Read from the vLLM wheels (the raise went in vllm PR 40932, released in 0.20.2; the ``None`` branch in
vllm PR 43617, released in 0.23.0):

=======  ==================================  ======================================
lane     padded read raises (ValueError)      empty buffer returns None (compile)
=======  ==================================  ======================================
0.20.0   yes                                 yes
0.22.1   no                                  yes
0.32.0   no                                  no
0.34.0   no                                  no (front lane: probed, no engine run)
=======  ==================================  ======================================

Besides the deepstack defects: with ``--disable-chunked-mm-input``, vLLM's scheduler up to 0.32.0 still
cuts an image whose placeholders start exactly at a chunk's first token when the step's budget is short
(vlguard's aligned scheduler keeps it whole); 0.34.0 schedules nothing for such a request until the whole
item fits (``Scheduler._try_schedule_encoder_inputs``: "the chunk starts on or inside the item").
"""

from __future__ import annotations

import vllm

from server.patches.deepstack import EMPTY_BUFFER, PADDED_READ

#: vLLM version -> the deepstack patches vlguard must activate on it (sorted, as /version reports them).
EXPECTED_PATCHES: dict[str, list[str]] = {
    "0.20.0": sorted([EMPTY_BUFFER, PADDED_READ]),
    "0.22.1": [EMPTY_BUFFER],
    "0.32.0": [],
    "0.34.0": [],
}

#: vLLM version -> whether its scheduler cuts an image starting a chunk under --disable-chunked-mm-input.
SPLITS_IMAGE_AT_CHUNK_START: dict[str, bool] = {"0.20.0": True, "0.22.1": True, "0.32.0": True, "0.34.0": False}

#: vLLM version -> whether its CPU sampler keeps every seed of a step that also holds an unseeded sampling
#: request. 0.20.0 and 0.22.1 drop them all for that step (0.32.0 rewrote the sampler; CUDA always kept
#: them); which requests share a step depends on timing, so there a seeded stream is reproducible in one
#: batch and not in the next, uninterrupted or re-run.
CPU_SAMPLER_KEEPS_SEEDS: dict[str, bool] = {"0.20.0": False, "0.22.1": False, "0.32.0": True, "0.34.0": True}

VLLM_VERSION: str = vllm.__version__


def expected_patches() -> list[str]:
    """The patches the installed vLLM needs. Fails for a vLLM version no lane describes."""
    assert VLLM_VERSION in EXPECTED_PATCHES, f"no engine lane describes vLLM {VLLM_VERSION}"
    return EXPECTED_PATCHES[VLLM_VERSION]


def has_defect(patch: str) -> bool:
    """Whether the installed vLLM still has the defect ``patch`` cures."""
    return patch in expected_patches()
