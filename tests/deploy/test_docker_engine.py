"""vlguard's image built and run by a real Docker engine (#19): ``Dockerfile`` on a stand-in for the stock
base image (scripts/standin-base.sh: the lane's CPU environment with the stock image's contract; the real
base cannot be pulled here), then the container serves the tiny model on loopback (``--network host``):
an image request, the image's HEALTHCHECK reaching ``healthy``, an engine-core SIGKILL inside the
container recovered, no zombie under dumb-init, and ``docker stop`` draining and ending with 143.

Nothing is pulled from an image registry. The stand-in is built once per lane environment and kept."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from server.workload.images import photo_uri
from server.workload.twopass import primary_messages
from tests.conftest import early_image_build
from tests.docker_image import ImageBuild, docker_answers
from tests.helpers import metric, poll
from tests.servers import NO_COMPILE_WHEN_EAGER, ServerProcess, free_port

#: The image's own HEALTHCHECK command, checked every 2 s here instead of 30 s (docker run's override of
#: the interval only), so that ``healthy`` comes within seconds of the engine being up.
HEALTH_INTERVAL = "2s"


#: The hardening flags of deploy/systemd/vlguard-docker.service's ``docker run``: the container serves under
#: them (#47).
UNIT_RUN_FLAGS = ("--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp:rw,exec",
                  "--tmpfs", "/home/vlguard:rw,exec,uid=10001,gid=0,mode=0770",
                  "--tmpfs", "/home/vlguard/.cache:rw,exec,uid=10001,gid=0,mode=0770")  # fmt: skip


def docker(*args: str, timeout_s: float = 600) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    assert out.returncode == 0, f"docker {' '.join(args)}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out.stdout.strip()


@pytest.fixture(scope="module")
def vlguard_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """vlguard's image built on the stand-in base of this lane (the base is cached between runs); the build
    started at the end of collection (tests/conftest.py, :mod:`tests.docker_image`)."""
    import vllm

    if not docker_answers():
        pytest.fail("no Docker engine answers: run scripts/system-tools.sh as root (make test does)")
    build = early_image_build() or ImageBuild.start(vllm.__version__, tmp_path_factory.mktemp("image") / "build.log")
    return build.wait()


@dataclass
class ContainerServer(ServerProcess):
    """A server in container ``name``; ``proc`` is ``docker logs --follow`` (for the log)."""

    name: str = ""


@pytest.fixture(scope="module")
def container(
    vlguard_image: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ContainerServer]:
    """Own launch (in a container): the image's entrypoint with the tiny model mounted read-only, on a
    loopback port."""
    port = free_port()
    name = f"vlguard-test-{port}"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLGUARD_PORT": str(port), **NO_COMPILE_WHEN_EAGER}
    docker(
        "run", "-d", "--name", name, "--network", "host", "--health-interval", HEALTH_INTERVAL, *UNIT_RUN_FLAGS,
        "-v", f"{tiny_model}:/models/tiny:ro", *[f"-e{k}={v}" for k, v in env.items()],
        vlguard_image, "--model", "/models/tiny", "--config", "/opt/vlguard/config/tiny-cpu.yaml", "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "container.log"
    srv = ContainerServer([], log, port=port, name=name)
    with log.open("wb") as out:
        srv.proc = subprocess.Popen(["docker", "logs", "--follow", name], stdout=out, stderr=subprocess.STDOUT)
    try:
        srv.wait_ready(600)  # fails at once if the container exits (its log stream ends)
        yield srv
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
        srv.proc.wait(30)


def _state(name: str) -> dict[str, object]:
    result: dict[str, object] = json.loads(docker("inspect", "-f", "{{json .State}}", name))
    return result


def _health(name: str) -> object:
    """The container's HEALTHCHECK status ("starting", "healthy", "unhealthy"), None without one."""
    health = _state(name).get("Health")
    return health.get("Status") if isinstance(health, dict) else None


def _container_tree(name: str) -> list[psutil.Process]:
    """The container's processes as seen from the host: its PID 1 (dumb-init) and everything below it."""
    init = psutil.Process(int(docker("inspect", "-f", "{{.State.Pid}}", name)))
    return [init, *init.children(recursive=True)]


def _chat(srv: ContainerServer, model: str) -> httpx.Response:
    body = {"model": model, "messages": primary_messages(photo_uri("coffee.png")), "max_tokens": 8, "temperature": 0}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)


def test_the_container_serves_an_image_request_and_turns_healthy(container: ContainerServer) -> None:
    tree = _container_tree(container.name)
    assert tree[0].name() == "dumb-init", [p.name() for p in tree]
    resp = _chat(container, "/models/tiny")
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] > 50  # the image's tokens reached the engine
    version = httpx.get(container.url + "/version").json()
    assert version["patches"]["enabled"] is True
    poll(lambda: _health(container.name) == "healthy", 60, "HEALTHCHECK healthy")


def test_the_container_runs_as_the_non_root_user_under_the_units_flags(container: ContainerServer) -> None:
    """#47: every process of the container (dumb-init, vlguard, the engine's) runs as uid 10001, with the
    systemd unit's hardening flags (no capability, no privilege escalation, read-only root)."""
    unit = (Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "vlguard-docker.service").read_text()
    for flag in ("--cap-drop ALL", "--security-opt no-new-privileges", "--read-only", "--tmpfs /tmp:rw,exec",
                 "--tmpfs /home/vlguard:", "--tmpfs /home/vlguard/.cache:"):  # fmt: skip
        assert flag in unit, flag  # the unit runs the container as this test does
    tree = _container_tree(container.name)
    assert len(tree) >= 3 and {p.uids().real for p in tree} == {10001}, [(p.pid, p.uids()) for p in tree]
    assert docker("exec", container.name, "sh", "-c", "touch /opt/x 2>&1 || echo refused").endswith("refused")


def test_an_engine_core_killed_inside_the_container_is_recovered_without_zombies(container: ContainerServer) -> None:
    name = container.name
    deaths = metric(container, "vlguard_engine_deaths_total")
    cores = [p for p in _container_tree(name) if "EngineCore" in " ".join(p.cmdline())]
    assert len(cores) == 1, [p.cmdline() for p in _container_tree(name)]
    cores[0].send_signal(signal.SIGKILL)
    resp = _chat(container, "/models/tiny")  # held, then served by the rebuilt engine
    assert resp.status_code == 200, resp.text
    assert metric(container, "vlguard_engine_deaths_total") == deaths + 1
    poll(lambda: httpx.get(container.url + "/ready", timeout=2).status_code == 200, 120, "ready again")
    zombies = [p.name() for p in _container_tree(name) if p.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


def test_docker_stop_drains_and_exits_143(container: ContainerServer) -> None:
    """Last test of the module: ``docker stop`` (SIGTERM to dumb-init, forwarded) while a request runs: the
    request completes, the container exits 143 (a clean stop for the Docker unit) and its processes end."""
    name = container.name
    tree = _container_tree(name)
    body = {"model": "/models/tiny", "messages": [{"role": "user", "content": "Describe a safe ladder."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True}  # fmt: skip
    url = container.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # the request is running
        stopper = subprocess.Popen(["docker", "stop", "--time", "95", name], stdout=subprocess.DEVNULL)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"  # drained to the end, not cut
    assert stopper.wait(120) == 0
    assert _state(name)["ExitCode"] == 143
    alive = psutil.wait_procs(tree, timeout=10)[1]
    assert alive == [], [p.pid for p in alive]
