"""Unit tests are fast and pure (or drive vLLM's classes without a server). Every engine lane runs those
that touch vLLM; the modules below test vlguard's own logic without importing vLLM at all (checked: a
run of each alone leaves ``vllm`` out of ``sys.modules``), so another lane would only repeat them and
the default lane (SUITE=full) runs them alone."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent

#: test modules of vlguard's own logic, no vLLM import: default lane only
NO_VLLM = frozenset(
    {
        "test_alignment_plan.py",
        "test_decode_pool.py",
        "test_devmodel.py",
        "test_errors.py",
        "test_fatal.py",
        "test_input_guard.py",
        "test_lane_split.py",
        "test_kill_tree.py",
        "test_media.py",
        "test_metrics_doc.py",
        "test_output_faults.py",
        "test_parent_watch.py",
        "test_phase_trace.py",
        "test_pixels.py",
        "test_poison.py",
        "test_spare.py",
        "test_workload.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents and Path(item.path).name not in NO_VLLM:
            item.add_marker(pytest.mark.lane)
