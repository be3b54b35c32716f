"""The shipped HAProxy configuration (deploy/haproxy/haproxy.cfg) in front of two real vlguard replicas on
loopback (#19): a replica's engine death and its SIGTERM cost the fleet no request, and the balancer
takes the replica out of rotation and back (read from its stats). Only the addresses are rewritten;
health checks, retries and timeouts are the shipped ones."""

from __future__ import annotations

import csv
import http.server
import io
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from server.workload.images import photo_uri
from server.workload.twopass import primary_messages, rescue_messages
from tests.helpers import engine_core, http_host, poll
from tests.servers import REPO, ServerProcess, engine_env, free_port, retire, vlguard_argv

CONFIG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
IMAGES = ("coffee.png", "astronaut.png", "chelsea.png")


def render(lb_port: int, stats_port: int, replicas: list[int], internal_port: int | None = None) -> str:
    """The shipped configuration with its listen addresses and ``server`` lines pointed at loopback ports
    (the internal listener on ``internal_port``, else on a free one)."""
    text = CONFIG.read_text()
    servers = "".join(f"    server gpu{i} 127.0.0.1:{port}\n" for i, port in enumerate(replicas))
    out = re.sub(r"(    server gpu\d+ \S+\n)+", servers, text)
    out = out.replace("bind 0.0.0.0:8080", f"bind 127.0.0.1:{lb_port}")
    out = out.replace("bind 127.0.0.1:8404", f"bind 127.0.0.1:{stats_port}")
    out = out.replace("bind 127.0.0.1:8405", f"bind 127.0.0.1:{internal_port or free_port()}")
    assert out.count("server gpu") == len(replicas) and f":{lb_port}" in out and f":{stats_port}" in out
    return out


@dataclass
class Balancer:
    """A running ``haproxy -db`` (foreground) with the rendered configuration."""

    proc: subprocess.Popen[bytes]
    port: int
    stats_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def servers(self) -> dict[str, dict[str, str]]:
        """The stats CSV rows of the backend's servers, by server name (``status``, ``reuse``, ...)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text.lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {r["svname"]: r for r in rows if r["pxname"] == "vlguard" and r["svname"].startswith("gpu")}

    def status(self, server: str) -> str:
        return self.servers()[server]["status"].split()[0]  # "UP", "DOWN", "UP 1/2", "DOWN 1/2", "MAINT"


def start_balancer(haproxy_bin: str, tmp_path: Path, replicas: list[ServerProcess]) -> Balancer:
    """HAProxy in the foreground with :func:`render`'s configuration, once every replica is UP."""
    cfg, log_path, port, stats_port = tmp_path / "haproxy.cfg", tmp_path / "haproxy.log", free_port(), free_port()
    cfg.write_text(render(port, stats_port, [r.port for r in replicas]))
    check = subprocess.run([haproxy_bin, "-c", "-f", str(cfg)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    with log_path.open("wb") as log:
        proc = subprocess.Popen([haproxy_bin, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    lb = Balancer(proc, port, stats_port, log_path)

    def all_up() -> bool:
        try:
            return {lb.status(f"gpu{i}") for i in range(len(replicas))} == {"UP"}
        except httpx.ConnectError:  # not listening yet
            assert proc.poll() is None, log_path.read_text()
            return False

    try:
        poll(all_up, 30, "every replica UP")
    except BaseException:
        stop_balancer(lb)
        raise
    return lb


def stop_balancer(lb: Balancer) -> None:
    lb.proc.terminate()
    try:
        lb.proc.wait(10)
    except subprocess.TimeoutExpired:
        lb.proc.kill()
        lb.proc.wait(10)


def test_shipped_configuration_is_valid_and_retries_only_before_a_response(haproxy_bin: str) -> None:
    check = subprocess.run([haproxy_bin, "-c", "-f", str(CONFIG)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    lines = [line.strip() for line in CONFIG.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert "option httpchk GET /ready" in lines and "http-check expect status 200" in lines
    retry_on = next(line for line in lines if line.startswith("retry-on")).split()[1:]
    # #34: a retry only when the request provably never reached a replica. Not on an empty response (the
    # replica may have died of this request) nor on a 503 (vlguard's answer after engine deaths too).
    assert retry_on == ["conn-failure"]
    assert "option forwardfor" in lines and "http-request del-header X-Forwarded-For" in lines


class _Backend(http.server.BaseHTTPRequestHandler):
    """A replica stand-in: healthy for the balancer's checks; every POST is counted and its connection
    closed without an answer (a replica whose process died of the request)."""

    posts: ClassVar[list[int]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.posts.append(self.server.server_address[1])
        self.close_connection = True  # no status line, nothing: an empty response


@dataclass
class _Port:
    port: int


def test_a_request_that_killed_a_replica_is_not_sent_to_the_next(haproxy_bin: str, tmp_path: Path) -> None:
    """#34: the shipped retry policy, for real: a replica closes the connection without answering (as when
    the request killed it); HAProxy answers the client 502 and sends the request to no other replica."""
    _Backend.posts.clear()
    with http_host(_Backend) as first, http_host(_Backend) as second:
        ports = [_Port(int(url.rsplit(":", 1)[1])) for url in (first, second)]
        lb = start_balancer(haproxy_bin, tmp_path, ports)  # type: ignore[arg-type]
        try:
            resp = httpx.post(lb.url + "/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30)
            assert resp.status_code == 502 and len(_Backend.posts) == 1, (resp.status_code, _Backend.posts)
        finally:
            stop_balancer(lb)


#: The replica's ``--guard-shutdown-delay``: above the shipped check's detection time (inter 2 s x fall 2).
#: Without it, a request HAProxy sent on an idle pooled connection just as the replica's SIGTERM closed it
#: was lost (CI, termination state SD, not retried: its base64 image is larger than tune.bufsize).
SHUTDOWN_DELAY_S = 5


@pytest.fixture(scope="module")
def replica(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Own launch: its engine core is killed and it gets SIGTERM (the session's eager server is the other,
    untouched replica). Its worker computes on core 1 (the other replica's on core 0, vLLM's automatic
    binding), as each replica has a GPU of its own in production: two CPU engines bound to one core
    starved this one's rebuild for minutes while the other served the workload."""
    srv = ServerProcess(vlguard_argv(tiny_model, "--enforce-eager", "--guard-watchdog-interval", "0.5",
                                     "--guard-shutdown-delay", str(SHUTDOWN_DELAY_S)),
                        tmp_path_factory.mktemp("logs") / "replica.log",
                        env=engine_env(VLLM_CPU_OMP_THREADS_BIND="1")).start()  # fmt: skip
    srv.wait_ready()
    yield srv
    retire(srv)


@dataclass
class Workload:
    """Two-pass traffic (primary, then rescue on the same image; non-streaming) through the balancer from
    ``threads`` clients, each pausing ``pause_s`` after a pair, until stopped; every outcome recorded.

    Light on purpose: both replicas are CPU engines on one 2-core machine (a GPU each in production), so
    a saturating load on one starves the other's rebuild (measured: 3 clients without pauses delayed the
    new engine core's start by 111 s)."""

    url: str
    model: str
    threads: int = 2
    pause_s: float = 0.5
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as client:
            n = index
            while not self.stop.is_set():
                uri = photo_uri(IMAGES[n % len(IMAGES)])
                for messages in (primary_messages(uri), rescue_messages(uri)):
                    body = {"model": self.model, "messages": messages, "max_tokens": 8, "temperature": 0}
                    try:
                        resp = client.post("/v1/chat/completions", json=body)
                        outcome = None if resp.status_code == 200 else f"{resp.status_code}: {resp.text[:200]}"
                    except httpx.HTTPError as exc:
                        outcome = f"{type(exc).__name__}: {exc}"
                    with self.lock:
                        if outcome is None:
                            self.ok += 1
                        else:
                            self.failures.append(outcome)
                n += 1
                self.stop.wait(self.pause_s)

    def __enter__(self) -> Workload:
        self._workers = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.threads)]
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for w in self._workers:
            w.join(300)

    def served(self) -> int:
        with self.lock:
            return self.ok


class StateLog:
    """Every status change of one server in the balancer's stats, polled off the test thread."""

    def __init__(self, lb: Balancer, server: str) -> None:
        self.lb, self.server, self.changes = lb, server, [lb.status(server)]
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                state = self.lb.status(self.server)
            except httpx.HTTPError:  # a stats read lost under load: the next one counts
                continue
            if state != self.changes[-1]:
                self.changes.append(state)

    def seen(self, *states: str) -> bool:
        """``states`` occurred in this order (other states in between allowed)."""
        it = iter(self.changes)
        return all(any(s == c for c in it) for s in states)

    def wait_for(self, *states: str, timeout_s: float, what: str) -> None:
        """Wait until :meth:`seen` ``states``; the failure names every change seen."""
        try:
            poll(lambda: self.seen(*states), timeout_s, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {self.server} went {' -> '.join(self.changes)}") from None

    def close(self) -> None:
        self.stop.set()
        self._thread.join(5)


def test_a_replica_engine_death_and_sigterm_cost_the_fleet_nothing(
    haproxy_bin: str, replica: ServerProcess, eager_server: ServerProcess, model_name: str, tmp_path: Path
) -> None:
    """#19: the two-pass workload through HAProxy while replica gpu1's engine core is SIGKILLed (its /ready
    turns 503 during the rebuild: DOWN, then UP), then while gpu1 gets SIGTERM (DOWN; its in-flight
    requests drain, new ones go to gpu0): 0 failed requests."""
    lb = start_balancer(haproxy_bin, tmp_path, [eager_server, replica])
    states = StateLog(lb, "gpu1")
    try:
        with Workload(lb.url, model_name) as work:
            poll(lambda: work.served() >= 6, 120, "traffic through the balancer")
            core = engine_core(replica)
            core.send_signal(signal.SIGKILL)
            states.wait_for("UP", "DOWN", "UP", timeout_s=240, what="gpu1 DOWN during its rebuild, then UP")
            served = work.served()
            poll(lambda: work.served() >= served + 6, 120, "traffic after gpu1 came back")
            assert replica.proc is not None
            replica.proc.send_signal(signal.SIGTERM)
            states.wait_for("UP", "DOWN", "UP", "DOWN", timeout_s=60, what="gpu1 DOWN after its SIGTERM")
            assert replica.proc.wait(120) == -signal.SIGTERM
            served = work.served()
            poll(lambda: work.served() >= served + 6, 120, "traffic on gpu0 alone")
        assert work.failures == [], work.failures[:5]
        per_server = lb.servers()
        assert int(per_server["gpu0"]["stot"]) > 0 and int(per_server["gpu1"]["stot"]) > 0  # both served
    finally:
        states.close()
        stop_balancer(lb)


def test_an_idle_pooled_connection_is_reused_through_the_balancer(
    haproxy_bin: str, eager_server: ServerProcess, model_name: str, tmp_path: Path
) -> None:
    """A keep-alive client's requests through HAProxy, 6 s apart (idle longer than uvicorn's old 5 s
    default): the second goes over the same connection to the replica (the replica's access log shows
    one peer port for both) and succeeds, since vlguard keeps idle connections 75 s. The idle time is what
    is tested, so the test waits it out."""
    lb = start_balancer(haproxy_bin, tmp_path, [eager_server])
    try:
        offset = len(eager_server.log_path.read_bytes())
        body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        with httpx.Client(base_url=lb.url, timeout=60) as client:
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            time.sleep(6.0)  # idle past uvicorn's old 5 s keep-alive
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        log = eager_server.log_path.read_bytes()[offset:].decode(errors="replace")
        peers = re.findall(r"127\.0\.0\.1:(\d+) - \"POST /v1/chat/completions HTTP/1\.1\" 200", log)
        assert len(peers) == 2 and peers[0] == peers[1], peers
        assert " 502 " not in lb.log_path.read_text()
        # #34: the operator routes are not reachable through the balancer, whatever a client sends.
        with httpx.Client(base_url=lb.url, timeout=60) as client:
            assert client.get("/admin/quarantine").status_code == 403
            assert client.delete("/admin/quarantine", headers={"X-Forwarded-For": "127.0.0.1"}).status_code == 403
            assert client.get("/%61dmin/quarantine").status_code == 403  # percent-encoded (found in review)
    finally:
        stop_balancer(lb)
