"""Prometheus config and alert rules: ``promtool check`` and ``promtool test rules`` for every alert.

Each scenario feeds synthetic series for two instances, ``bad:8000`` (the alert must fire) and
``good:8000`` (it must stay silent), and evaluates before the ``for:`` period (nothing yet) and after it.
The promtool test file is generated here: expected annotations are the rules' own runbook text plus the
summary rendered for the firing instance, so the test also checks the templates.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "docker" / "prometheus"
RULES = PROMETHEUS / "rules" / "vlguard.rules.yml"
BAD, GOOD = "bad:8000", "good:8000"


def _series(name: str, bad: str, good: str, **labels: str) -> list[dict[str, str]]:
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return [
        {"series": f'{name}{{job="vlguard", instance="{BAD}"{extra}}}', "values": bad},
        {"series": f'{name}{{job="vlguard", instance="{GOOD}"{extra}}}', "values": good},
    ]


#: alert -> (input series, evaluation time before it may fire, evaluation time when it fires)
SCENARIOS: dict[str, tuple[list[dict[str, str]], str, str]] = {
    "VlguardTargetDown": (_series("up", "1 1 0x8", "1x10"), "3m", "5m"),
    "VlguardEngineDown": (_series("vlguard_engine_up", "1 0x10", "1x11"), "4m", "7m"),
    "VlguardEngineDeaths": (_series("vlguard_engine_deaths_total", "0 1 2 3 3", "0x4", cause="hang"), "2m", "4m"),
    "VlguardSoftRecoveryStorm": (
        _series("vlguard_engine_recoveries_total", "0 3 6 9 9", "0 1 1 1 1", kind="soft"),
        "1m",
        "3m",
    ),
    "VlguardRestartLoop": (
        _series("vlguard_engine_restarts_total", "0 1 2 3 4 4", "0 0 1 1 1 1", outcome="success")
        + _series("vlguard_engine_restart_budget", "5x5", "5x5"),
        "2m",
        "5m",
    ),
    "VlguardNoSpareEngineProcess": (
        _series("vlguard_engine_up", "1x25", "1x25")
        + _series("vlguard_engine_spare_up", "0x25", "0 0 1x23")
        + _series("vlguard_engine_spare_events_total", "1+1x25", "1x25", event="spawned"),
        "10m",
        "20m",
    ),
    "VlguardRequestsHeld": (_series("vlguard_requests_held", "0 3x6", "0x7"), "2m", "4m"),
    "VlguardSheddingLoad": (
        _series("vlguard_requests_rejected_total", "0+60x20", "0x20", reason="saturated"),
        "8m",
        "16m",
    ),
    "VlguardRequestsQuarantined": (_series("vlguard_requests_quarantined_total", "0 0 0 1 1", "0x4"), "1m", "4m"),
    "VlguardReadinessFlapping": (_series("vlguard_engine_up", "1 0 1 0 1 0 1 0", "1 0 1 1 1 1 1 1"), "3m", "7m"),
    "VlguardDeepstackPaddedReads": (_series("vlguard_deepstack_padded_reads_total", "0 0 0 5 5", "0x4"), "1m", "4m"),
    "VlguardAlignmentFallback": (
        _series("vlguard_alignment_steps_total", "0+1x40", "0x40", outcome="unaligned")
        + _series("vlguard_alignment_steps_total", "0+10x40", "0+10x40", outcome="filled"),
        "10m",
        "35m",
    ),
}


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: run scripts/system-tools.sh (make test does)")
    return path


def test_prometheus_config_and_rules_check() -> None:
    promtool = _tool("promtool")
    for args in (["check", "config", str(PROMETHEUS / "prometheus.yml")], ["check", "rules", str(RULES)]):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_severity_a_runbook_and_a_scenario() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} == set(SCENARIOS)
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["runbook"]) > 80, rule["alert"]


def test_every_alert_fires_when_it_should_and_only_then(tmp_path: Path) -> None:
    tests = []
    for rule in _rules():
        series, before, firing = SCENARIOS[rule["alert"]]
        labels = {"job": "vlguard", "instance": BAD, **rule["labels"]}
        if "by (instance)" in rule["expr"]:  # aggregated away: only instance survives
            labels = {"instance": BAD, **rule["labels"]}
        annotations = {
            "summary": rule["annotations"]["summary"].replace("{{ $labels.instance }}", BAD),
            "runbook": rule["annotations"]["runbook"],
        }
        tests.append(
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": before, "alertname": rule["alert"], "exp_alerts": []},
                    {
                        "eval_time": firing,
                        "alertname": rule["alert"],
                        "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
                    },
                ],
            }
        )
    spec = tmp_path / "vlguard.rules.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([_tool("promtool"), "test", "rules", str(spec)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
