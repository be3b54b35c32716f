"""docs/metrics.md lists exactly the metrics that server/metrics/definitions.py defines."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from server.metrics import definitions

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_doc_and_code_agree() -> None:
    kinds = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
    in_code = {
        metric._name: kinds[type(metric)]
        for metric in vars(definitions).values()
        if isinstance(metric, (Counter, Gauge, Histogram))
    }
    in_doc = dict(re.findall(r"^\| `(vlguard_\w+)` \| (\w+) \|", DOC.read_text(), flags=re.MULTILINE))
    assert in_doc == in_code
