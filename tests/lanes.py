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

VLLM_VERSION: str = vllm.__version__


def expected_patches() -> list[str]:
    """The patches the installed vLLM needs. Fails for a vLLM version no lane describes."""
    assert VLLM_VERSION in EXPECTED_PATCHES, f"no engine lane describes vLLM {VLLM_VERSION}"
    return EXPECTED_PATCHES[VLLM_VERSION]


def has_defect(patch: str) -> bool:
    """Whether the installed vLLM still has the defect ``patch`` cures."""
    return patch in expected_patches()
