"""The shipped HAProxy against clients on another host (#34, #47). The test makes that host: a network
namespace joined to this one by a veth pair, with two addresses of its own (two sources, not loopback).
HAProxy listens on the veth address in front of the session's eager vlguard on loopback, so to vlguard
every request arrives from 127.0.0.1, as behind any proxy or sidecar.

- #34: before, such a client listed and cleared the quarantine through the balancer (no API key: vlguard
  trusted loopback). Now the balancer refuses ``/admin`` at the edge, under any prefix (a ``--root-path``)
  or encoding, and a balancer configured without that rule still gets a 403 from vlguard, which trusts a
  key, never an address.
- #47: 2100 half-sent requests from one source (once enough to fill the global maxconn and lock everyone
  out) leave another source served within 5 s; an 80 MiB chunked body is refused at the edge; the
  internal routes are not served on the public listener and are on the internal one."""

from __future__ import annotations

import csv
import io
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.test_haproxy import render
from tests.helpers import poll
from tests.servers import ServerProcess, free_port

HOST_ADDR, CLIENT_ADDR, OTHER_ADDR = "10.231.57.1", "10.231.57.2", "10.231.57.3"

#: Holds ``argv[3]`` connections to ``argv[1]:argv[2]``, each with a request's first header lines and no
#: end of headers (a half-sent request), until its standard input closes; prints how many it opened.
HALF_SENT = """
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
held = []
for _ in range(int(sys.argv[3])):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((sys.argv[1], int(sys.argv[2])))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n")
        held.append(s)
    except OSError:
        s.close()
print(len(held), flush=True)
sys.stdin.read()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def client_netns() -> Iterator[str]:
    """A network namespace with two addresses, ``CLIENT_ADDR`` and ``OTHER_ADDR``, reaching this host's
    ``HOST_ADDR`` only."""
    if shutil.which("ip") is None:
        pytest.fail("iproute2's ip not found: run scripts/system-tools.sh (make test does)")
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"vlg-client-{tag}", f"vlgh{tag}", f"vlgc{tag}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{HOST_ADDR}/29", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{CLIENT_ADDR}/29", "dev", ns_if)
        _ip("-n", ns, "addr", "add", f"{OTHER_ADDR}/29", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def from_client(ns: str, method: str, url: str, *headers: str, source: str = CLIENT_ADDR, stdin: bytes = b"",
                curl: tuple[str, ...] = ()) -> int:  # fmt: skip
    """The HTTP status ``ns`` gets for ``method url`` from address ``source`` (curl inside the namespace, at
    most 10 s; 0: no connection or no answer)."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "curl", "-s", "-o", "/dev/null", "-m", "10", "-w", "%{http_code}",
         "--interface", source, "-X", method, "--path-as-is", *(f"-H{h}" for h in headers), *curl, url],
        capture_output=True, check=False, timeout=30, input=stdin,
    )  # fmt: skip
    return int(out.stdout or 0)


def balancer(
    haproxy_bin: str, tmp_path: Path, backend: ServerProcess, admin_rule: bool = True
) -> subprocess.Popen[bytes]:
    """The shipped configuration listening on ``HOST_ADDR`` (with or without its ``/admin`` rule), once
    its replica is UP; stopped by the caller. ``.url``: the public listener; ``.internal``: the internal
    one (loopback); ``.stats``: the stats port."""
    port, stats, internal = free_port(), free_port(), free_port()
    text = render(port, stats, [backend.port], internal).replace(f"bind 127.0.0.1:{port}", f"bind {HOST_ADDR}:{port}")
    if not admin_rule:
        text, n = re.subn(r"\n *http-request return status 403 [^\n]*admin[^\n]*", "", text)
        assert n == 1
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    proc = subprocess.Popen([haproxy_bin, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proc.url = f"http://{HOST_ADDR}:{port}"  # type: ignore[attr-defined]
    proc.internal = f"http://127.0.0.1:{internal}"  # type: ignore[attr-defined]
    proc.stats = stats  # type: ignore[attr-defined]

    def up() -> bool:
        assert proc.poll() is None, "haproxy exited"
        try:
            return ",UP," in httpx.get(f"http://127.0.0.1:{stats}/stats;csv", timeout=5).text
        except httpx.ConnectError:
            return False

    poll(up, 30, "the replica UP")
    return proc


@pytest.mark.parametrize("admin_rule", [True, False], ids=["shipped", "without-the-admin-rule"])
def test_a_client_on_another_host_cannot_reach_the_operator_routes_through_the_balancer(
    haproxy_bin: str, client_netns: str, eager_server: ServerProcess, tmp_path: Path, admin_rule: bool
) -> None:
    lb = balancer(haproxy_bin, tmp_path, eager_server, admin_rule)
    try:
        url = lb.url  # type: ignore[attr-defined]
        offset = len(eager_server.log_path.read_bytes())
        assert from_client(client_netns, "GET", url + "/health", "X-Forwarded-For: 6.6.6.6") == 200  # reaches vlguard
        assert from_client(client_netns, "GET", url + "/ready") == 404  # the replica's state: internal listener only
        # The balancer drops the client's own X-Forwarded-For and sets the real address, which vlguard
        # trusts from loopback: its log (and its per-client fault budget) see the client, not 127.0.0.1.
        seen = eager_server.log_path.read_bytes()[offset:].decode(errors="replace")
        assert f"{CLIENT_ADDR}:" in seen and "6.6.6.6" not in seen, seen[-2000:]
        assert from_client(client_netns, "GET", f"http://127.0.0.1:{eager_server.port}/ready") == 0  # not directly
        for method, path in (("GET", "/admin/quarantine"), ("DELETE", "/admin/quarantine"),
                             ("GET", "/%61dmin/quarantine"), ("GET", "/ADMIN/quarantine"),
                             ("GET", "/P/admin/quarantine"), ("GET", "//admin/quarantine"),
                             ("GET", "/v1/../admin/quarantine"), ("GET", "/./admin")):  # fmt: skip
            status = from_client(client_netns, method, url + path)
            # Shipped: the edge refuses it. Without the rule: vlguard itself does (403 without a key,
            # 404 for a path it does not serve), never 200.
            assert status == 403 or (not admin_rule and status in (401, 403, 404)), (method, path, status)
    finally:
        lb.terminate()
        lb.wait(10)


def _frontend_sessions(lb: subprocess.Popen[bytes]) -> int:
    """The public frontend's current sessions, from HAProxy's stats."""
    text = httpx.get(f"http://127.0.0.1:{lb.stats}/stats;csv", timeout=5).text.lstrip("# ")  # type: ignore[attr-defined]
    row = next(r for r in csv.DictReader(io.StringIO(text)) if r["pxname"] == "openai" and r["svname"] == "FRONTEND")
    return int(row["scur"])


def test_one_source_with_2100_half_sent_requests_locks_no_one_else_out(
    haproxy_bin: str, client_netns: str, eager_server: ServerProcess, tmp_path: Path
) -> None:
    """#47: one address opens 2100 connections, each with a request's first header lines and no end (more
    than the global maxconn 2048); another address's request is answered within 5 s meanwhile, and the
    balancer holds at most the per-source limit of them."""
    lb = balancer(haproxy_bin, tmp_path, eager_server)
    url = lb.url  # type: ignore[attr-defined]
    port = url.rsplit(":", 1)[1]
    flood = subprocess.Popen(
        ["ip", "netns", "exec", client_netns, sys.executable, "-c", HALF_SENT, HOST_ADDR, port, "2100"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert flood.stdout is not None
        opened = flood.stdout.readline()  # every connection attempted; the accepted ones held
        assert opened.strip().isdigit(), opened
        started = time.monotonic()
        assert from_client(client_netns, "GET", url + "/health", source=OTHER_ADDR) == 200
        assert time.monotonic() - started < 5
        assert _frontend_sessions(lb) <= 66  # the per-source limit (64), not 2100
        assert from_client(client_netns, "GET", url + "/health", source=CLIENT_ADDR) == 0  # the flooder: refused
    finally:
        flood.stdin.close()  # type: ignore[union-attr]
        flood.wait(30)
        lb.terminate()
        lb.wait(10)


def test_edge_refuses_chunked_bodies_and_keeps_internal_routes_internal(
    haproxy_bin: str, client_netns: str, eager_server: ServerProcess, tmp_path: Path
) -> None:
    """#47: a chunked body (its length unknown until its end) is refused at the edge with 411, an 80 MiB one
    too (never vlguard's 413); the internal routes are not served on the public listener (404) and are on
    the internal one."""
    lb = balancer(haproxy_bin, tmp_path, eager_server)
    url, internal = lb.url, lb.internal  # type: ignore[attr-defined]
    try:
        small = from_client(client_netns, "POST", url + "/detokenize", "Content-Type: application/json",
                            "Transfer-Encoding: chunked", stdin=b'{"tokens": [1]}', curl=("-T", "-"))  # fmt: skip
        assert small == 411
        # 80 MiB: the edge answers 411 and closes while curl still uploads, so curl may lose the 411 to the
        # reset and report only HAProxy's "100 Continue" (or nothing); vlguard past the edge would read 64 MiB
        # and answer 413.
        big = from_client(client_netns, "POST", url + "/detokenize", "Content-Type: application/json",
                          "Transfer-Encoding: chunked", stdin=b"0" * (80 << 20), curl=("-T", "-"))  # fmt: skip
        assert big in (411, 100, 0)
        declared = from_client(client_netns, "POST", url + "/tokenize", f"Content-Length: {65 << 20}",
                               "Content-Type: application/json", curl=("--data-binary", "{}"))  # fmt: skip
        assert declared in (413, 0)  # refused on its declared length (curl may see the close first)
        for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/version", "/ready", "/P/metrics", "/%6detrics"):
            assert from_client(client_netns, "GET", url + path) == 404, path
            if not path.startswith(("/P", "/%")):
                assert httpx.get(internal + path, timeout=30).status_code == 200, path
        assert httpx.get(internal + "/v1/models", timeout=30).status_code == 404  # internal listener: no API
        assert from_client(client_netns, "GET", url + "/v1/models") == 200  # the API is public
    finally:
        lb.terminate()
        lb.wait(10)
