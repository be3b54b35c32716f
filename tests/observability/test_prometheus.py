"""A real Prometheus server (Debian's package, loopback, temporary data dir) scrapes a running vlguard on
the tiny model while image traffic flows; every PromQL expression of the dashboard and the alert rules
must evaluate through Prometheus's HTTP API, and the core panels must return data."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import definitions
from server.workload.images import variant_uri
from server.workload.twopass import primary_messages, rescue_messages
from tests.helpers import poll
from tests.servers import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "docker" / "grafana" / "dashboards" / "vlguard-engine-health.json"
RULES = REPO / "deploy" / "docker" / "prometheus" / "rules" / "vlguard.rules.yml"
#: Grafana's variables, as Grafana would expand them for "All instances" and a 15 s scrape interval.
GRAFANA_VARS = {"$__rate_interval": "1m", "$instance": ".*"}


def dashboard_exprs() -> dict[str, str]:
    """``panel title / refId -> PromQL`` of every dashboard query, Grafana variables expanded."""
    out = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def rule_exprs() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"]}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (``vllm:*`` and ``vlguard_*``)."""
    return set(re.findall(r"\b(vllm:[a-z0-9_]+|vlguard_[a-z0-9_]+)", expr))


def _family_names(text: str) -> list[str]:
    return [family.name for family in text_string_to_metric_families(text)]


class Prometheus:
    """``prometheus`` on 127.0.0.1 scraping one target every second, with vlguard's alert rules."""

    def __init__(self, target: str, workdir: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus not found: run scripts/system-tools.sh (make test does)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "vlguard", "static_configs": [{"targets": [target]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        argv = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.proc = subprocess.Popen(argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        poll(ready, timeout_s, "Prometheus to be ready", 0.5)

    def query(self, expr: str) -> dict[str, Any]:
        resp = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body: dict[str, Any] = resp.json()
        return body

    def wait_for(self, expr: str, timeout_s: float = 60) -> list[dict[str, Any]]:
        """Poll (at the scrape interval) until ``expr`` returns at least one sample."""

        def samples() -> list[dict[str, Any]]:
            result = self.query(expr)
            return result["data"]["result"] if result["status"] == "success" else []  # type: ignore[no-any-return]

        found: list[dict[str, Any]] = poll(samples, timeout_s, f"data for {expr}", 1.0)
        return found

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _image_traffic(srv: ServerProcess, model: str, images: tuple[str, ...]) -> None:
    """Primary and rescue passes on images this server has never seen (the session's server may have
    served the bundled photos already: fully cached prompts would carry no image tokens in any step)."""
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    uris = [variant_uri(name, 17 + i) for i, name in enumerate(images)]
    work = [m for uri in uris for m in (primary_messages(uri), rescue_messages(uri))]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda msgs: client.chat.completions.create(model=model, messages=msgs, max_tokens=4), work))


@pytest.fixture(scope="module")
def scraped(
    eager_server: ServerProcess, model_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """Prometheus scraping the eager server (the padded shared server's padded reads are an alert)."""
    prom = Prometheus(f"127.0.0.1:{eager_server.port}", tmp_path_factory.mktemp("prometheus"))
    try:
        prom.wait_ready()
        prom.wait_for('up{job="vlguard"} == 1')
        # Traffic after the first scrapes, so rates and increases see it.
        _image_traffic(eager_server, model_name, ("astronaut.png", "coffee.png"))
        prom.wait_for("vlguard_deepstack_occupancy_ratio_count > 0")
        prom.wait_for("rate(vllm:request_success_total[1m]) > 0")
        yield prom
    finally:
        prom.stop()


def test_metrics_endpoint_parses_with_both_families_and_no_duplicates(eager_server: ServerProcess) -> None:
    names = _family_names(httpx.get(eager_server.url + "/metrics").text)
    assert any(n.startswith("vllm:") for n in names) and any(n.startswith("vlguard_") for n in names)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_dashboard_and_rule_expression_evaluates(scraped: Prometheus) -> None:
    exprs = {**dashboard_exprs(), **rule_exprs()}
    failures = {}
    for name, expr in exprs.items():
        result = scraped.query(expr)
        if result["status"] != "success":
            failures[name] = result.get("error")
    assert failures == {}
    assert len(exprs) >= 40


def test_every_series_the_dashboard_reads_exists(eager_server: ServerProcess) -> None:
    """vLLM 0.20's names are checked against a live scrape; vlguard's against its one metrics module
    (labelled vlguard series appear only once their event happened, e.g. a death)."""
    live = set(_family_names(httpx.get(eager_server.url + "/metrics").text))
    defined = {m._name for m in vars(definitions).values() if hasattr(m, "_name")}
    wanted = set().union(*(metric_names(e) for e in {**dashboard_exprs(), **rule_exprs()}.values()))
    missing_vllm = {n for n in wanted if n.startswith("vllm:") and re.sub(r"_(total|bucket)$", "", n) not in live}
    missing_vlguard = {
        n for n in wanted if n.startswith("vlguard_") and re.sub(r"_(total|bucket|count|sum)$", "", n) not in defined
    }
    assert missing_vllm == set() and missing_vlguard == set()
    # And every vlguard metric is on the dashboard.
    on_dashboard = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in wanted}
    assert defined - on_dashboard == set()


def test_core_panels_return_data(scraped: Prometheus) -> None:
    exprs = dashboard_exprs()
    up = scraped.wait_for(exprs["Engine up / A"])
    assert float(up[0]["value"][1]) == 1.0
    assert scraped.wait_for(exprs["Request rate / A"])
    occupancy = scraped.wait_for(exprs["Deepstack occupancy per image step / A"])
    assert sum(float(s["value"][1]) for s in occupancy) > 0
    assert scraped.wait_for(exprs["Time to first token / B"])
    assert scraped.wait_for(exprs["Active backports / A"])


def test_no_alert_fires_on_a_healthy_server(scraped: Prometheus) -> None:
    firing = [a for a in scraped.query("ALERTS")["data"]["result"] if a["metric"].get("alertstate") == "firing"]
    assert firing == []
