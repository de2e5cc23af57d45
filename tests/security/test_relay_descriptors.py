"""Red-team: the daemon's descriptors through the egress relays (runtime/net).

Every connection the proxy relays and every UDP flow holds two of the daemon's
descriptors for as long as it lasts (a flow: a minute after its last datagram). A
sandbox may hold 256 at once; 256 datagrams from as many source ports cost it nothing and
the daemon 512 descriptors, so some tens of a tenant's policy sandboxes took every
descriptor of the daemon (20000 on a common host): its API, its other tenants'
sandboxes and their relays stopped. All relays together now hold at most a quarter
of the daemon's open-file limit, one tenant's at most half of that, and what is
refused past that is recorded as the sandbox's event. (A test server in a namespace
of the test's own: net_helpers.)"""

from __future__ import annotations

import os
import resource
import tempfile

import pytest

from corral.runtime.net import manager
from tests.conftest import ROOT_REASON, have_root_runtime
from tests.security.net_helpers import no_host_proxy, server_ns  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)

FLOOD = r"""
import select, socket, sys, time
target, n, expect = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
waiting, answered = set(socks), 0
end = time.monotonic() + (60 if expect else 1.5)  # a loaded host relays slowly
while waiting and time.monotonic() < end:  # a flow per source port, sent again if lost
    for u in waiting:
        u.sendto(b"x", (target, 7002))
    stop = time.monotonic() + 0.3
    while waiting and (left := stop - time.monotonic()) > 0:
        ready, _, _ = select.select(list(waiting), [], [], left)
        for u in ready:  # a relayed flow's datagram came back from the echo server
            u.recv(100)
            waiting.discard(u)
            answered += 1
    if expect and answered >= expect:  # then a little longer: no more may come
        end = min(end, time.monotonic() + 0.6)
print(answered)
"""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_one_tenants_flows_take_a_bounded_share_of_the_daemons_descriptors():
    from corral.runtime.engine import Engine

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert manager.max_relays() <= max(2 * manager.MAX_CONNECTIONS, soft // 8)
    with server_ns(254, "ECHO") as srv:
        engine = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"))
        try:
            policy = {"allow": [srv]}
            a1 = await engine.create(network=policy, tenant="alice")
            a2 = await engine.create(network=policy, tenant="alice")
            b = await engine.create(network=policy, tenant="bob")
            engine.net.max_relays = 400  # as on a daemon whose limit is 3200 descriptors

            async def flood(sb, expect: int, n: int = 220) -> int:
                r = await engine.exec(sb.id, ["python3", "-c", FLOOD, srv, str(n), str(expect)],
                                      timeout=120)
                assert r.returncode == 0, r.stderr
                return int(r.stdout)

            before = _fds()
            assert await flood(a1, 200) == 200  # alice's half of the relays
            assert await flood(a2, 0) == 0  # her other sandbox: none left to her
            assert await flood(b, 200) == 200  # bob's are his
            assert _fds() - before <= 2 * 400 + 20  # the descriptors they hold: bounded
            reasons = [e["reason"] for e in engine.network_events(a2.id)
                       if e["verdict"] == "refused"]
            assert any("as many connections as it may" in r for r in reasons), reasons
        finally:
            await engine.close()
