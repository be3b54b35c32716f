"""Chunk alignment on a real vLLM 0.20.0 engine under emulated CUDA-graph padding, deepstack patches off.

The control (both off: the engine dies on the first image step) is
``test_deepstack.py::test_stock_behaviour_crashes_under_padding``.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.conftest import Launcher, early_server
from tests.integration.outputs import assert_same, greedy, two_pass_workload
from tests.servers import ServerProcess, engine_env, metric_samples, retire, vlguard_argv

pytestmark = pytest.mark.lane  # in every engine lane's focused suite

CRASH = "Requested more deepstack tokens than available in buffer"


CHUNKING = {
    "chunked": [],
    # CASES C2: no chunked prefill (which needs a budget of max-model-len); other requests' decodes share steps.
    "unchunked": ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"],
}


def _launcher(chunking: str) -> Launcher:
    """Alignment on (default), deepstack patches off, padding emulated, every step recorded by the test plugin
    in ``steps.jsonl`` beside the log. Eager: without the patches the compiled model drops deepstack (the
    other bug)."""

    def launch(tiny_model: Path, logs: Path) -> ServerProcess:
        env = engine_env(VLGUARD_TEST_EMULATE_PADDING="1", VLGUARD_TEST_STEP_LOG=str(logs / "steps.jsonl"))
        argv = vlguard_argv(tiny_model, "--guard-patches", "off", "--guard-alignment-max-capture-size", "512",
                            "--enforce-eager", *CHUNKING[chunking])  # fmt: skip
        return ServerProcess(argv, logs / "server.log", env=env).start()

    return launch


# tests/conftest.py starts them after collection (the chunked one where its budget allows)
EARLY_LAUNCHERS = {f"aligned_unpatched[{chunking}]": _launcher(chunking) for chunking in CHUNKING}


# Unchunked (CASES C2) on the default lane only: one launch fewer on the others (alignment's code path is
# the same; the scheduler's budget is what differs).
@pytest.fixture(
    scope="module",
    params=[pytest.param("chunked"), pytest.param("unchunked", marks=pytest.mark.full_only)],
)
def aligned_unpatched(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    """Own launch per chunking mode (patches off and a step log: no other test's configuration), with the
    path of its step log."""
    key = f"aligned_unpatched[{request.param}]"
    srv = early_server(key, tiny_model, tmp_path_factory, EARLY_LAUNCHERS[key])
    yield srv, srv.log_path.parent / "steps.jsonl"
    retire(srv)


def _client(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _alignment_samples(srv: ServerProcess) -> dict[str, float]:
    return metric_samples(srv.url, "vlguard_alignment_", "vlguard_engine_deaths", by_label="outcome")


def test_two_pass_workload_survives_without_the_patch(
    aligned_unpatched: tuple[ServerProcess, Path], eager_server: ServerProcess, model_name: str
) -> None:
    """CASES C1/C2 on unpatched vLLM: zero deepstack errors, zero deaths; every step that carries image
    tokens needed no padding (recorded in the worker); greedy outputs equal an unpadded run's."""
    srv, step_log = aligned_unpatched
    version = httpx.get(srv.url + "/version").json()
    assert version["patches"]["active"] == []
    aligned, reference = _client(srv), _client(eager_server)
    work = two_pass_workload()
    for label, messages in work:
        got, want = greedy(aligned, model_name, messages, 4), greedy(reference, model_name, messages, 4)
        assert got.token_ids == want.token_ids, label
        assert_same(got, want)
    # Concurrent: passes of several images share steps with each other's decodes and residuals.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda item: greedy(aligned, model_name, item[1], 4), work * 2))
    assert all(len(g.token_ids) == 4 for g in results)

    assert CRASH not in srv.log_path.read_text()
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    image_steps = [s for s in steps if s["mm"]]
    assert image_steps, "the recorder saw no image step"
    assert [s for s in image_steps if s["padded"] != s["tokens"]] == []
    assert any(s["padded"] != s["tokens"] for s in steps)  # padding did happen, on steps without images

    metrics = _alignment_samples(srv)
    assert metrics.get("vlguard_engine_deaths_total", 0.0) == 0.0
    assert metrics.get("vlguard_alignment_steps_total{unaligned}", 0.0) == 0.0
    changed = metrics.get("vlguard_alignment_steps_total{filled}", 0.0) + metrics.get(
        "vlguard_alignment_steps_total{trimmed}", 0.0
    )
    assert changed > 0  # alignment acted: without it these steps would have been padded
    assert metrics["vlguard_alignment_steps_total{aligned}"] + changed >= len(image_steps)
    assert httpx.get(srv.url + "/ready").status_code == 200
