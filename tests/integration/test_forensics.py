"""#48 on the real engine: a poison request is quarantined and its forensic record is there, with what an
operator needs to reproduce it (prompt token ids, the traceback) and no credential; replayed with
``vlguard forensics replay`` against the same server it gets the quarantine's 400, and once the quarantine
is cleared the replay reproduces the fault (two more step faults absorbed, quarantined again)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import EAGER_POISON_WORD, OPERATOR_KEY, forensics_dir
from tests.helpers import labelled, poll
from tests.servers import ServerProcess

pytestmark = pytest.mark.lane  # in every engine lane's focused suite

SECRET = "sk-forensics-must-not-keep-this"


def _soft(srv: ServerProcess) -> float:
    return labelled(srv, "vlguard_engine_recoveries_total", "kind")["soft"]


def _replay(record: str, srv: ServerProcess) -> str:
    out = subprocess.run([sys.executable, "-m", "server", "forensics", "replay", record, "--base", srv.url],
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return out.stdout


def test_a_quarantined_request_is_recorded_and_replays(eager_server: ServerProcess, model_name: str) -> None:
    operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    body = {"model": model_name, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"Forensics{EAGER_POISON_WORD} probe."}]}  # fmt: skip
    before = _soft(eager_server)
    refused = httpx.post(eager_server.url + "/v1/chat/completions", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {SECRET}", "Cookie": f"session={SECRET}"})  # fmt: skip
    assert refused.status_code == 400 and "quarantined" in refused.json()["error"]["message"]
    assert _soft(eager_server) == before + 2
    fp = refused.json()["error"]["message"].split("fingerprint ")[1].split(")")[0]
    path = forensics_dir(eager_server) / f"{fp}.json"
    poll(lambda: path.is_file() and len(json.loads(path.read_text())["faults"]) == 2, 30, "the record")
    text = path.read_text()
    record = json.loads(text)
    assert record["quarantined"] and record["route"] == "POST /v1/chat/completions"
    assert record["body"]["messages"] == body["messages"] and len(record["prompt_token_ids"]) > 5
    assert all("Traceback" in f["traceback"] and f["kind"] == "soft" for f in record["faults"])
    assert SECRET not in text and OPERATOR_KEY not in text
    listed = httpx.get(eager_server.url + "/admin/quarantine", headers=operator, timeout=30).json()["entries"]
    assert {e["fingerprint"]: e["record"] for e in listed}[fp] == str(path)

    assert "HTTP 400" in (again := _replay(str(path), eager_server)) and "quarantined" in again
    assert _soft(eager_server) == before + 2  # refused at the door: the engine never saw it

    cleared = httpx.delete(eager_server.url + f"/admin/quarantine/{fp}", headers=operator, timeout=30)
    assert cleared.json() == {"cleared": 1}
    reproduced = _replay(str(path), eager_server)
    assert "HTTP 400" in reproduced and "quarantined" in reproduced
    assert _soft(eager_server) == before + 4  # the fault, reproduced twice, absorbed twice
    poll(lambda: len(json.loads(path.read_text())["faults"]) == 4, 30, "the reproduced faults recorded")
