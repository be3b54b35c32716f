"""#34: the operator routes behind the shipped HAProxy, from a client on another host. The test makes that
host: a network namespace joined to this one by a veth pair (its own addresses, not loopback). HAProxy
listens on the veth address in front of the session's eager vlguard on loopback, so to vlguard every
request arrives from 127.0.0.1, as behind any proxy or sidecar.

Before #34 such a client listed and cleared the quarantine through the balancer (no API key: vlguard
trusted loopback). Now the balancer refuses ``/admin`` at the edge, and a balancer configured without that
rule still gets a 403 from vlguard, which trusts a key, never an address."""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.test_haproxy import render
from tests.helpers import poll
from tests.servers import ServerProcess, free_port

HOST_ADDR, CLIENT_ADDR = "10.231.57.1", "10.231.57.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def client_netns() -> Iterator[str]:
    """A network namespace with one address, ``CLIENT_ADDR``, reaching this host's ``HOST_ADDR`` only."""
    if shutil.which("ip") is None:
        pytest.fail("iproute2's ip not found: run scripts/system-tools.sh (make test does)")
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"vlg-client-{tag}", f"vlgh{tag}", f"vlgc{tag}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{HOST_ADDR}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{CLIENT_ADDR}/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def from_client(ns: str, method: str, url: str, *headers: str) -> int:
    """The HTTP status ``ns`` gets for ``method url`` (curl inside the namespace; 0: no connection)."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "curl", "-s", "-o", "/dev/null", "-m", "10", "-w", "%{http_code}",
         "-X", method, "--path-as-is", *(f"-H{h}" for h in headers), url],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    return int(out.stdout or 0)


def balancer(haproxy_bin: str, tmp_path: Path, backend: ServerProcess, admin_rule: bool) -> subprocess.Popen[bytes]:
    """The shipped configuration listening on ``HOST_ADDR`` (with or without its ``/admin`` rule), once
    its replica is UP; stopped by the caller."""
    port, stats = free_port(), free_port()
    text = render(port, stats, [backend.port]).replace(f"bind 127.0.0.1:{port}", f"bind {HOST_ADDR}:{port}")
    if not admin_rule:
        text, n = re.subn(r"\n *http-request deny deny_status 403 if \{ path[^\n]*/admin \}", "", text)
        assert n == 1
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    proc = subprocess.Popen([haproxy_bin, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proc.url = f"http://{HOST_ADDR}:{port}"  # type: ignore[attr-defined]

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
        assert from_client(client_netns, "GET", url + "/ready", "X-Forwarded-For: 6.6.6.6") == 200  # reaches vlguard
        # The balancer drops the client's own X-Forwarded-For and sets the real address, which vlguard
        # trusts from loopback: its log (and its per-client fault budget) see the client, not 127.0.0.1.
        seen = eager_server.log_path.read_bytes()[offset:].decode(errors="replace")
        assert f"{CLIENT_ADDR}:" in seen and "6.6.6.6" not in seen, seen[-2000:]
        assert from_client(client_netns, "GET", f"http://127.0.0.1:{eager_server.port}/ready") == 0  # not directly
        for method, path in (("GET", "/admin/quarantine"), ("DELETE", "/admin/quarantine"),
                             ("GET", "/%61dmin/quarantine"), ("GET", "/ADMIN/quarantine")):  # fmt: skip
            status = from_client(client_netns, method, url + path)
            # Shipped: the edge refuses it. Without the rule: vlguard itself does (403 without a key,
            # 404 for a path it does not serve), never 200.
            assert status == 403 or (not admin_rule and status in (401, 403, 404)), (method, path, status)
    finally:
        lb.terminate()
        lb.wait(10)
