"""Attacks on the egress filter by UDP and IPv6 (runtime/net: the UDP relay, IPv6 links).

UDP exfiltration: a datagram to an address no rule names is refused by the kernel at
once (ICMP unreachable), never reaches the server, and shows in ``network_events()``.
IPv6 bypass: a policy sandbox has IPv6, filtered exactly as IPv4 is: an allowed IPv6
address or a name with an AAAA record is reached through the proxy; any other one, the
host's end of the link, another sandbox and private (ULA) addresses a name resolves to
are refused and recorded. Servers run in namespaces the test made (net_helpers).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT_REASON, have_root_runtime
from tests.security.net_helpers import ipv6_on, no_host_proxy, run_probes, server_ns, v6  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)

# Runs in the sandbox: each probe prints its outcome (what came back, or the error's name)
PROBE = r"""
import json, socket, sys
def tcp(host, port, family=0):
    try:
        s = socket.create_connection((host, port), timeout=10) if not family else None
        if s is None:
            info = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0]
            s = socket.socket(info[0], socket.SOCK_STREAM); s.settimeout(10); s.connect(info[4])
        s.sendall(b"GET / HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n" if port == 80 else b"ping")
        out = b""
        while chunk := s.recv(4096):
            out += chunk
            if port != 80:
                break
        return out.split(b"\r\n\r\n", 1)[-1].decode()
    except Exception as e:
        return type(e).__name__
def udp(host, port, data="hi"):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    u = socket.socket(fam, socket.SOCK_DGRAM); u.settimeout(5)
    try:
        u.connect((host, port)); u.send(data.encode())
        return u.recv(100).decode()
    except Exception as e:
        return type(e).__name__
print(json.dumps({k: eval(v) for k, v in json.loads(sys.argv[1]).items()}))
"""


async def probe(engine, sid: str, **probes: str) -> dict:
    return await run_probes(engine, sid, PROBE, probes)


@pytest.fixture
async def net():
    """``good`` and ``bad`` servers (UDP logged), names for corral's resolver, an engine."""
    from corral.runtime.engine import Engine

    logs = Path(tempfile.mkdtemp(prefix="corral-udp-"))
    with server_ns(10, "GOOD", udp_log=str(logs / "good")) as good, \
            server_ns(14, "BAD", udp_log=str(logs / "bad")) as bad:
        eng = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"), network_hosts={
            "six.test": v6(good), "bad6.test": v6(bad), "ula.test": "fd00::1"})
        try:
            yield eng, good, bad, logs
        finally:
            await eng.close()


def refused(engine, sid: str, kind: str) -> list[dict]:
    return [e for e in engine.network_events(sid) if e["kind"] == kind
            and e["verdict"] == "refused"]


async def test_udp_allowed_by_address_refused_otherwise(net):
    """UDP exfiltration: only an address a rule names is reached; a datagram anywhere
    else is refused at once (ECONNREFUSED, not a 5 s timeout), never arrives, and is in
    the sandbox's events; the policy's TCP names open no UDP."""
    engine, good, bad, logs = net
    sb = await engine.create(network={"allow": [f"{good}:7002", f"{good}:7004", "six.test", "*"]})
    got = await probe(engine, sb.id, good=f'udp("{good}", 7002)',
                      bad=f'udp("{bad}", 7002, "secret")',
                      other_port=f'udp("{good}", 7003, "secret")',
                      far_closed=f'udp("{good}", 7004)')  # allowed; the far end's ICMP back
    assert got == {"good": "GOOD hi", "bad": "ConnectionRefusedError",
                   "other_port": "ConnectionRefusedError", "far_closed": "ConnectionRefusedError"}
    assert (logs / "good").read_bytes() == b"hi\n"
    assert not (logs / "bad").exists()  # nothing of it left the host
    ev = refused(engine, sb.id, "udp")
    assert {(e["ip"], e["port"]) for e in ev} >= {(bad, 7002), (good, 7003)}
    assert all(abs(e["time"] - time.time()) < 600 for e in ev)  # when it was tried
    assert any(e["kind"] == "udp" and e["verdict"] == "allowed" and e["ip"] == good
               for e in engine.network_events(sb.id))
    # a live change closes the allowed flow's way too
    await engine.update_network(sb.id, {"allow": ["six.test"]})
    got = await probe(engine, sb.id, good=f'udp("{good}", 7002, "again")')
    assert got["good"] == "ConnectionRefusedError"
    assert b"again" not in (logs / "good").read_bytes()


@pytest.mark.skipif(not ipv6_on(), reason="the host has no IPv6 (links get IPv4 only)")
async def test_ipv6_filtered_as_strictly_as_ipv4(net):
    engine, good, bad, logs = net
    wide = {"allow": [v6(good), "six.test", "ula.test", f"[{v6(good)}]:7002",
                      f"[{v6(good)}]:7004"]}
    other = await engine.create(network=wide)
    sb = await engine.create(network=wide)
    link = engine.net._by_id[sb.id].link
    other_ip = engine.net._by_id[other.id].link.sandbox_ip6
    got = await probe(
        engine, sb.id,
        literal=f'tcp("{v6(good)}", 7000)',  # an allowed address
        by_name='tcp("six.test", 80, socket.AF_INET6)',  # a name with an AAAA record
        denied=f'tcp("{v6(bad)}", 7000)',  # an address no rule names
        denied_name='tcp("bad6.test", 80, socket.AF_INET6)',  # NXDOMAIN
        ula='tcp("ula.test", 80)',  # allowed name, private address: never
        host_end=f'tcp("{link.host_ip6}", 22)',
        other=f'tcp("{other_ip}", 8000)',
        udp_ok=f'udp("{v6(good)}", 7002)',
        udp_bad=f'udp("{v6(bad)}", 7002, "secret")',
        udp_far_closed=f'udp("{v6(good)}", 7004)',  # the far end's ICMPv6 passed back
    )
    assert got["literal"] == "ping"
    assert got["by_name"].startswith("GOOD GET /")
    assert got["udp_ok"] == "GOOD hi"
    assert got["denied_name"] == "gaierror"
    for key in ("denied", "ula", "host_end", "other"):
        assert got[key] == "ConnectionResetError", (key, got[key])  # a reset, not a hang
    assert got["udp_bad"] == got["udp_far_closed"] == "ConnectionRefusedError"
    assert not (logs / "bad").exists()
    tcp = refused(engine, sb.id, "tcp")
    assert any(e["ip"] == v6(bad) for e in tcp)
    assert any(e["ip"] == "fd00::1" and "private" in e["reason"] for e in tcp)
    assert any(e["ip"] == v6(bad) and e["port"] == 7002 for e in refused(engine, sb.id, "udp"))


def test_a_tenant_cannot_name_private_ipv6():
    """ULA, link-local, loopback and the links' own prefix: the admin's to name only."""
    from corral.errors import Forbidden
    from corral.schema import SandboxSpec
    from corral.server.service import check_network

    for rule in ("fd00::/8", "fe80::/10", "::1", "[fd63:6f72:7261:1::1]:53", "::ffff:0:0/96"):
        spec = SandboxSpec.parse(network={"allow": [rule]})
        with pytest.raises(Forbidden):
            check_network(spec, host_network=False, admin=False)
        check_network(spec, host_network=False, admin=True)
