"""Attack on the egress filter (runtime/net): a policy sandbox sending as another one.

Sandboxes are told apart by their link address: the resolver, the TCP proxy and the UDP
relay judge, count and answer a packet as the sandbox its source address names. A
sandbox's code has no capability in its network namespace, but ``IPV6_FREEBIND`` needs
none: it binds another sandbox's IPv6 address and its datagrams leave with that source.
The host drops every packet whose source it would not route back through the link it
came in on, so nothing is relayed, counted or answered as the victim. Servers run in
namespaces the test made (net_helpers).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT_REASON, have_root_runtime
from tests.security.net_helpers import ipv6_on, no_host_proxy, run_probes, server_ns, v6  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)

# Runs in the sandbox: send one datagram from ``src`` (bound with FREEBIND, or the
# sandbox's own address when ``src`` is empty); "sent" or the error's name.
SEND = r"""
import json, socket, sys
def send(src, dst, port, data):
    fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        if src:
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
            s.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND
            s.bind((src, 40000))
        s.sendto(data.encode(), (dst, port))
        return "sent"
    except OSError as e:
        return type(e).__name__
print(json.dumps({k: eval(v) for k, v in json.loads(sys.argv[1]).items()}))
"""


@pytest.fixture
async def net():
    from corral.runtime.engine import Engine

    logs = Path(tempfile.mkdtemp(prefix="corral-spoof-"))
    with server_ns(250, "GOOD", udp_log=str(logs / "good")) as good:  # an octet no other module uses (xdist)
        eng = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"))
        try:
            yield eng, good, logs / "good"
        finally:
            await eng.close()


async def test_a_sandbox_cannot_send_as_another(net):
    engine, good, log = net
    rules = {"allow": [f"{good}:7002", f"[{v6(good)}]:7002"]}
    victim = await engine.create(network=rules)
    attacker = await engine.create(network=rules)
    vlink = engine.net._by_id[victim.id].link
    spoofs = {"v4": f'send("{vlink.sandbox_ip}", "{good}", 7002, "spoofed4")'}
    honest = {"v4": f'send("", "{good}", 7002, "honest4")'}
    if ipv6_on():
        spoofs["v6"] = f'send("{vlink.sandbox_ip6}", "{v6(good)}", 7002, "spoofed6")'
        honest["v6"] = f'send("", "{v6(good)}", 7002, "honest6")'
    await run_probes(engine, attacker.id, SEND, spoofs)
    got = await run_probes(engine, attacker.id, SEND, honest)
    assert set(got.values()) == {"sent"}
    want = {f"honest{k[1]}".encode() for k in honest}
    for _ in range(1200):  # the honest datagrams, sent after the spoofed ones, arrive
        lines = set(log.read_bytes().split()) if log.exists() else set()
        if want <= lines:
            break
        await asyncio.sleep(0.05)
    assert lines == want, lines  # the spoofed ones never left the host
    assert not [e for e in engine.network_events(victim.id) if e["kind"] == "udp"]
