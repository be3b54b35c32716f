"""The forensic record (server/guard/forensics.py, #48): what a record holds and leaves out, its bounds, a
failing disk, and the record of a request the guard quarantined over the fake engine."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from server.engine.protocol import FatalRecord, SoftFault
from server.forensics_cli import list_lines, replay
from server.guard.errors import QuarantinedRequestError
from server.guard.forensics import Charge, Evidence, Forensics, build_record, read_records
from tests.fakes import FakeEngineFactory, GuardHarness

IMAGE = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake image bytes" * 50).decode()
BODY = {"model": "m", "messages": [{"role": "user", "content": [
    {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}]}  # fmt: skip
ENGINE = {"vllm_version": "0.20.0", "vlguard_version": "t", "args": {"model": "m"}}


def evidence(body: dict[str, Any] = BODY) -> Evidence:
    prompt = {"prompt_token_ids": [1, 2, 3], "mm_hashes": {"image": ["abc"]}}
    return Evidence("POST /v1/chat/completions", json.dumps(body).encode(), prompt, "SamplingParams(n=1)", "addr:x")


def fault(kind: str = "soft") -> Charge:
    record = SoftFault("ValueError", "boom", ["r-0a0a0a0a"], [], ["r-0a0a0a0a"], 0.01, named=True, traceback="Tb")
    return Charge(kind, record, [("peer", "fp-peer")], quarantined=False, at=1000.0)


def test_a_record_holds_the_request_and_the_fault_but_not_the_media_unless_asked() -> None:
    first = build_record(None, "r", "fp1", evidence(), fault(), keep_media=False, engine=ENGINE)
    assert first["prompt_token_ids"] == [1, 2, 3] and first["route"] == "POST /v1/chat/completions"
    part = first["body"]["messages"][0]["content"][1]["image_url"]["url"]
    assert part.startswith("<vlguard forensics: media omitted, sha256=") and str(len(IMAGE)) in part
    assert IMAGE not in json.dumps(first)
    assert first["faults"][0]["traceback"] == "Tb" and first["faults"][0]["step_peers"] == [
        {"request_id": "peer", "fingerprint": "fp-peer"}
    ]
    quarantined = Charge("fatal", FatalRecord("RuntimeError", "again"), quarantined=True, at=1001.0)
    second = build_record(first, "r2", "fp1", evidence(), quarantined, keep_media=False, engine=ENGINE)
    assert [f["kind"] for f in second["faults"]] == ["soft", "fatal"] and second["quarantined"]
    assert second["first_at"] == 1000.0 and second["last_at"] == 1001.0
    kept = build_record(None, "r", "fp1", evidence(), fault(), keep_media=True, engine=ENGINE)
    assert kept["body"] == BODY


def test_engine_facts_leave_secrets_out() -> None:
    from server.guard.forensics import engine_facts

    facts = engine_facts({"model": "m", "api_key": "sk-secret", "hf_token": "hf_x", "max_model_len": 8})
    assert facts["args"] == {"max_model_len": 8, "model": "m"} and "sk-secret" not in json.dumps(facts)


def test_engine_facts_redact_secrets_inside_values() -> None:
    """#61: a credential inside an argument's value (a URL's user information, a token in a JSON or query
    string) was written into every record."""
    from server.guard.forensics import REDACTED, engine_facts

    secret_args = {
        "model": "https://user:pw-1@models.example/qwen",
        "hf_overrides": {"hub_token": "hf_2", "rope": {"factor": 2}},
        "otlp_traces_endpoint": "https://otel.example/v1?api_key=k3&x=1",
        "kv_transfer_config": '{"auth_token": "t4", "port": 7}',
        "middleware": ["--secret=s5", "plain"],
    }
    args = engine_facts(secret_args)["args"]
    text = json.dumps(args)
    assert not any(s in text for s in ("pw-1", "hf_2", "k3", "t4", "s5")), text
    assert args["model"] == f"https://{REDACTED}@models.example/qwen" and args["hf_overrides"]["rope"] == {"factor": 2}
    assert "x=1" in args["otlp_traces_endpoint"] and '"port": 7' in args["kv_transfer_config"]


def _written(f: Forensics, fp: str) -> None:
    f.charged("r", fp, evidence(), fault())
    f.close()


def fp(i: int) -> str:
    """A fingerprint as the quarantine makes them (16 hex characters)."""
    return f"{i:016x}"


def test_records_are_pruned_oldest_first_by_count_and_by_bytes(tmp_path: Path) -> None:
    """Only its own records (#61: pruning deleted any ``*.json`` in the folder)."""
    (tmp_path / "operator-notes.json").write_text("{}")
    f = Forensics(tmp_path, keep_media=False, max_records=3, max_bytes=10**9, engine=ENGINE)
    for i in range(5):
        f.charged(f"r{i}", fp(i), evidence(), fault())
    f.close()
    names = [f"{fp(i)}.json" for i in range(10)]
    assert sorted(p.name for p in tmp_path.glob("*")) == [*names[2:5], "operator-notes.json"]  # no temp file left
    size = (tmp_path / names[4]).stat().st_size
    g = Forensics(tmp_path, keep_media=False, max_records=100, max_bytes=int(size * 2.5), engine=ENGINE)
    g.charged("r9", fp(9), evidence(), fault())
    g.close()
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [names[4], names[9], "operator-notes.json"]
    alone = Forensics(tmp_path / "small", keep_media=True, max_records=10, max_bytes=2000, engine=ENGINE)
    _written(alone, "big")  # alone over the bound: kept, without the request's content
    record = json.loads((tmp_path / "small" / "big.json").read_text())
    assert record["body"] is None and record["truncated"] > 2000 and record["faults"]


def test_a_failing_disk_costs_the_record_never_the_caller(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    f = Forensics(blocker / "records", keep_media=False, max_records=10, max_bytes=10**6, engine=ENGINE)
    for i in range(200):  # more than MAX_PENDING at once: dropped, not queued without bound
        f.charged("r", f"fp{i}", evidence(), fault())
    f.close()
    assert f.written == 0 and not (blocker / "records").exists()


def test_list_and_replay_read_a_record(tmp_path: Path) -> None:
    _written(Forensics(tmp_path, keep_media=False, max_records=10, max_bytes=10**6, engine=ENGINE), "fp1")
    lines = list_lines(tmp_path)
    assert len(lines) == 2 and "fp1" in lines[1] and "soft ValueError" in lines[1] and "/v1/chat" in lines[1]
    (record,) = read_records(tmp_path)
    with pytest.raises(ValueError, match="media were not kept"):
        replay(record, "http://127.0.0.1:9")


async def test_a_quarantined_request_has_its_record(tmp_path: Path) -> None:
    forensics = Forensics(tmp_path, keep_media=False, max_records=10, max_bytes=10**6, engine=ENGINE)
    g = GuardHarness(FakeEngineFactory(poison=[7, 7, 7]), forensics=forensics, quarantine_deaths=2)
    await g.sup.start()
    try:
        with pytest.raises(QuarantinedRequestError):
            await asyncio.wait_for(g.collect([5, 7, 7, 7], rid="poison"), g.wait_s)
        assert await asyncio.wait_for(g.collect([5, 6], rid="fine"), g.wait_s)  # the engine serves on
    finally:
        await g.sup.shutdown()
    forensics.close()
    (record,) = read_records(tmp_path)
    assert record["prompt_token_ids"] == [5, 7, 7, 7] and record["quarantined"]
    assert len(record["faults"]) == 2 and all(f["request_id"] == "poison" for f in record["faults"])
