"""Deepstack backports against a real vLLM engine, under emulated CUDA-graph padding.

The test-only plugin ``vlguard_test_padding`` rounds every step up to the next CUDA-graph capture size
in every vLLM process, as a GPU does. Each fault is shown on stock behaviour first (patches off: the
test can see the bug on vLLM 0.20.0, and its absence on lanes fixed upstream), then cured (patches on).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from server.patches.deepstack import EMPTY_BUFFER, PADDED_READ
from tests.conftest import early_server
from tests.integration.outputs import IMAGE_PROMPTS, assert_same, greedy, two_pass_workload
from tests.lanes import VLLM_VERSION, expected_patches, has_defect
from tests.servers import ServerProcess, engine_env, metric_samples, retire, vlguard_argv

pytestmark = pytest.mark.lane  # in every engine lane's focused suite

PADDING = {"VLGUARD_TEST_EMULATE_PADDING": "1"}
CRASH = "Requested more deepstack tokens than available in buffer"


def samples(srv: ServerProcess) -> dict[str, float]:
    """Every sample on ``/metrics``, summed over labels."""
    return metric_samples(srv.url)


def _client(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _launch_padded_stock(tiny_model: Path, logs: Path) -> ServerProcess:
    argv = vlguard_argv(tiny_model, "--guard-patches", "off", "--guard-alignment", "off", "--enforce-eager")
    return ServerProcess(argv, logs / "padded-stock.log", env=engine_env(**PADDING)).start()


EARLY_LAUNCHERS = {"padded_stock": _launch_padded_stock}  # tests/conftest.py starts it after collection


@pytest.fixture(scope="module")
def padded_stock(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Patches and alignment off, padding emulated: behaves like stock vLLM on a GPU. Own launch: on
    0.20.0 its first image steps raise the deepstack ValueError, so no other test can share it."""
    srv = early_server("padded_stock", tiny_model, tmp_path_factory, _launch_padded_stock)
    yield srv
    retire(srv)


@pytest.fixture(scope="module")
def padded_patched(server: ServerProcess) -> ServerProcess:
    """Patches on (default), compiled (default), padding emulated: vlguard on a GPU (the session's server)."""
    return server


def test_stock_behaviour_crashes_under_padding(padded_stock: ServerProcess, model_name: str) -> None:
    version = httpx.get(padded_stock.url + "/version").json()
    assert version["patches"]["enabled"] is False and version["patches"]["active"] == []
    client = _client(padded_stock)
    statuses = []
    for _, messages in two_pass_workload()[:2]:
        try:
            client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)  # type: ignore[arg-type]
            statuses.append(200)
        except Exception as exc:
            statuses.append(getattr(exc, "status_code", -1))
    if has_defect(PADDED_READ):
        # The crash is deterministic for the request (its replay is chunked the same way): soft recovery
        # absorbs it twice, then the request is quarantined. Only the backports or alignment avoid it.
        assert 200 not in statuses
        assert CRASH in padded_stock.log_path.read_text()
        kinds = metric_samples(padded_stock.url, "vlguard_engine_recoveries_total", by_label="kind")
        assert kinds["vlguard_engine_recoveries_total{rebuild}"] == 0
        assert kinds["vlguard_engine_recoveries_total{soft}"] >= 2
    else:  # fixed upstream on this lane
        assert statuses == [200, 200]
        assert CRASH not in padded_stock.log_path.read_text()


def test_patched_two_pass_workload_matches_unpadded(
    padded_patched: ServerProcess, eager_server: ServerProcess, model_name: str
) -> None:
    """CASES C1: under emulated padding every request is 200, no engine death, no deepstack error, and
    the greedy outputs equal an unpadded run's (the eager reference: token ids, logprobs within 1e-4).

    The concurrent round (primary and rescue passes of several images sharing steps with each other's
    decodes) is checked for errors only: batch composition changes CPU GEMM shapes, so its logprobs are
    not comparable run to run, padded or not.
    """
    version = httpx.get(padded_patched.url + "/version").json()
    assert version["patches"]["active"] == expected_patches()
    work = two_pass_workload()
    padded_client, unpadded_client = _client(padded_patched), _client(eager_server)
    for label, messages in work:
        padded_out = greedy(padded_client, model_name, messages, 4)
        unpadded_out = greedy(unpadded_client, model_name, messages, 4)
        assert padded_out.token_ids == unpadded_out.token_ids, label
        assert_same(padded_out, unpadded_out)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        concurrent_results = list(pool.map(lambda item: greedy(padded_client, model_name, item[1], 4), work))
    assert all(len(g.token_ids) == 4 for g in concurrent_results)
    assert CRASH not in padded_patched.log_path.read_text()
    assert samples(padded_patched).get("vlguard_engine_deaths_total", 0.0) == 0.0
    if expected_patches():  # vlguard's read wrapper counts them (none installed where nothing is patched)
        assert samples(padded_patched)["vlguard_deepstack_padded_reads_total"] > 0  # padding really happened
    assert httpx.get(padded_patched.url + "/ready").status_code == 200


def test_padded_reads_are_counted(padded_patched: ServerProcess, eager_server: ServerProcess, model_name: str) -> None:
    if not expected_patches():
        pytest.skip(f"vLLM {VLLM_VERSION} needs no deepstack patch: vlguard leaves the buffer (and its metrics) alone")
    greedy(_client(padded_patched), model_name, IMAGE_PROMPTS["astronaut.png"], 2)
    padded = samples(padded_patched)
    assert padded["vlguard_deepstack_padded_reads_total"] > 0
    assert padded["vlguard_deepstack_padding_tokens_total"] > 0
    assert padded["vlguard_deepstack_occupancy_ratio_count"] > 0
    assert padded["vlguard_deepstack_written_tokens_count"] > 0
    assert padded["vlguard_deepstack_buffer_capacity_tokens"] >= 1024  # max_num_batched_tokens
    # The same traffic without padding: occupancy is recorded, padded reads never happen.
    greedy(_client(eager_server), model_name, IMAGE_PROMPTS["astronaut.png"], 2)
    unpadded = samples(eager_server)
    assert unpadded["vlguard_deepstack_written_tokens_count"] > 0
    assert unpadded.get("vlguard_deepstack_padded_reads_total", 0.0) == 0.0


def test_patch_metrics_report_active_patches(padded_patched: ServerProcess) -> None:
    text = httpx.get(padded_patched.url + "/metrics").text
    for patch in (PADDED_READ, EMPTY_BUFFER):
        value = "1.0" if has_defect(patch) else "0.0"
        assert f'vlguard_patch_active{{patch="{patch}",vllm_version="{VLLM_VERSION}"}} {value}' in text
