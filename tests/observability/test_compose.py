"""The compose stack's wiring, checked statically (no Docker engine here): names, mounts and paths that
must agree between compose.yaml, prometheus.yml and Grafana's provisioning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_both_vlguard_profiles_answer_to_the_scrape_target() -> None:
    services = _yaml(DOCKER / "compose.yaml")["services"]
    target = _yaml(DOCKER / "prometheus" / "prometheus.yml")["scrape_configs"][0]["static_configs"][0]["targets"][0]
    host, port = target.split(":")
    for name, profile in (("vlguard", "gpu"), ("vlguard-cpu", "cpu")):
        service = services[name]
        assert service["profiles"] == [profile]
        assert host in service["networks"]["default"]["aliases"]
        assert service["ports"] == [f"${{VLGUARD_BIND:-127.0.0.1}}:{port}:{port}"]
        assert service["build"]["context"] == "../.."
    gpu = services["vlguard"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]


def test_prometheus_and_grafana_mounts_match_their_configs() -> None:
    services = _yaml(DOCKER / "compose.yaml")["services"]
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    rule_files = _yaml(DOCKER / "prometheus" / "prometheus.yml")["rule_files"]
    assert all((DOCKER / "prometheus" / f).is_file() for f in rule_files)

    grafana = services["grafana"]
    provider = _yaml(DOCKER / "grafana" / "provisioning" / "dashboards" / "vlguard.yml")["providers"][0]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "GRAFANA_ADMIN_PASSWORD:?" in grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]  # no default secret

    datasource = _yaml(DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "vlguard-engine-health.json").read_text())
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == datasource["uid"]
    assert dashboard["title"] == "vlguard — engine health"


def test_every_published_port_is_on_loopback_unless_an_address_is_given() -> None:
    """#34: Prometheus (no authentication), Grafana and vlguard (/metrics, /docs, /tokenize open without a
    key) are published on 127.0.0.1 by default; VLGUARD_BIND names another address deliberately."""
    services = _yaml(DOCKER / "compose.yaml")["services"]
    published = {name: port for name, service in services.items() for port in service.get("ports", [])}
    assert published and all(p.startswith("${VLGUARD_BIND:-127.0.0.1}:") for p in published.values()), published


def test_the_build_context_holds_only_what_the_image_copies() -> None:
    """#34: the repository root's .dockerignore keeps everything out of the build context (.git, caches,
    tests, local state) but what the Dockerfile copies."""
    root = DOCKER.parents[1]
    ignore = [line.strip() for line in (root / ".dockerignore").read_text().splitlines()]
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules[0] == "*"
    copied = {"pyproject.toml", "README.md", "server/", "config/", "deploy/docker/entrypoint.sh"}
    assert {r[1:] for r in rules if r.startswith("!")} == copied
    dockerfile = (root / "Dockerfile").read_text()
    sources = {word for line in dockerfile.splitlines() if line.startswith("COPY ") for word in line.split()[1:-1]}
    assert {s.rstrip("/") + ("/" if (root / s).is_dir() else "") for s in sources} <= copied
