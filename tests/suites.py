"""Which tests each lane runs (``make test SUITE=full|lane|engine|front``), decided here and in the
Makefile's folders for each suite (``engine``: unit and integration; ``front``: unit and API) and nowhere
else: the ``lane`` marker by folder (:func:`marks_lane`), and the unit modules the other lanes skip. Imports
no vLLM (the root ``conftest`` reads it at collection on every lane)."""

from __future__ import annotations

from pathlib import Path

#: Unit modules of vlguard's own logic that import no vLLM (checked: a run of each alone leaves ``vllm``
#: out of ``sys.modules``, ``tests/unit/test_lane_split.py``): another lane would only repeat them, so the
#: default lane (SUITE=full) runs them alone.
NO_VLLM = frozenset(
    {
        "test_alignment_plan.py",
        "test_decode_pool.py",
        "test_devmodel.py",
        "test_errors.py",
        "test_fatal.py",
        "test_house.py",
        "test_input_guard.py",
        "test_lane_split.py",
        "test_layout.py",
        "test_kill_tree.py",
        "test_media.py",
        "test_metrics_archive.py",
        "test_metrics_doc.py",
        "test_output_faults.py",
        "test_parent_watch.py",
        "test_phase_trace.py",
        "test_pixels.py",
        "test_poison.py",
        "test_run_dirs.py",
        "test_scaleout.py",
        "test_shm.py",
        "test_spare.py",
        "test_workload.py",
    }
)

TESTS = Path(__file__).parent
#: Folders every engine lane runs whole (``lane`` marker), but for ``NO_VLLM`` in ``unit``: the unit tests
#: that touch vLLM and the in-process API tests (vLLM's front end differs between lanes).
LANE_FOLDERS = (TESTS / "unit", TESTS / "api")


def marks_lane(path: Path) -> bool:
    """Whether the test module at ``path`` belongs to every lane's focused suite by its folder (others mark
    their tests ``lane`` one by one)."""
    return any(folder in path.parents for folder in LANE_FOLDERS) and path.name not in NO_VLLM


#: The default lane's modules that start servers of their own, or none, and use neither session server
#: (``tests/conftest.py``): CI runs them as one half of the default lane beside the other, whose modules
#: share those servers (``VLGUARD_TEST_HALF=own|shared``; unset: both). Two pytest processes of one lane
#: fit in the machine's memory where two engine lanes did not: this half holds one server at a time (20.5
#: of 23.5 GB used at most, measured). test_overload's own server runs in the shared half, which was 6
#: minutes shorter.
OWN_SERVERS = frozenset(
    {
        "deploy/test_docker.py",
        "deploy/test_docker_engine.py",
        "deploy/test_kubernetes.py",
        "deploy/test_systemd.py",
        "integration/test_api_servers.py",
        "integration/test_guard.py",
        "integration/test_lifecycle.py",
        "observability/test_alert_rules.py",
        "observability/test_compose.py",
    }
)
HALF_ENV = "VLGUARD_TEST_HALF"


def in_half(path: Path, half: str) -> bool:
    """Whether the test module at ``path`` belongs to ``half`` (``own`` or ``shared``) of the default lane."""
    own = path.resolve().relative_to(TESTS).as_posix() in OWN_SERVERS
    return own if half == "own" else not own
