"""Live restore of a sandbox under a network policy (runtime/engine_restore.py, net/).

An engine makes a policy sandbox that reaches an allowed name, then closes with
``handover`` (what SIGTERM does to a daemon): the sandbox's link (its namespace and
veth, whose lock goes to the warden with its reattach socket) and the engine's
nftables table stay. The next engine on the state directory adopts it: the same
namespace, its policy enforced again by the new engine's table, resolver and proxy
(the allowed name is reached, a name the policy does not allow is refused, its events
are recorded), and when it ends its link goes. Waits are bounded; no clock is asserted.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from corral.network_schema import NetworkPolicy
from corral.runtime.net.netns import NETNS_DIR
from tests.conftest import requires_root
from tests.security.net_helpers import no_host_proxy, server_ns  # noqa: F401  (a fixture)
from tests.security.test_network_policy import probe

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

async def _fetch(engine, sid: str, name: str) -> str:
    return (await probe(engine, sid, got=f"http({name!r})"))["got"][0]


UDP = """import socket, sys
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)
u.connect((sys.argv[1], 7002)); u.send(b"hi")
try:
    print(u.recv(99).decode())
except Exception as e:
    print(type(e).__name__)
"""


async def _udp(engine, sid: str, ip: str) -> str:
    return (await engine.exec(sid, ["python3", "-c", UDP, ip], timeout=60)).stdout.decode().strip()


async def test_a_policy_sandbox_is_handed_over_with_its_network():
    from corral.runtime.engine import Engine

    state = tempfile.mkdtemp(prefix="corral-test-state-")
    with server_ns(2, "GOOD") as good, server_ns(6, "BAD") as bad:
        hosts = {"good.test": good, "bad.test": bad}
        first = await Engine.open(state, network_hosts=hosts, restore_grace=60, warm_slots=0)
        try:  # on a private network too (net/private.py): its bridge is handed over
            first.networks.create(None, "ep", NetworkPolicy(), private=True)
            made = await first.create(network={"allow": ["good.test", f"{good}:7002"],
                                               "join": "ep", "alias": "m"}, memory_mb=128)
            member = first.net.private.lookup(made.id, "m")
            bridge = first.net.private.member(made.id)[0].netns
            assert await _fetch(first, made.id, "good.test") == "GOOD GET / HTTP/1.0"
            netns = first._live[made.id].netns
            assert netns is not None and Path(netns).exists()
        finally:
            await first.close(handover=True)
        assert Path(netns).exists() and (NETNS_DIR / bridge).exists()  # kept for the next

        second = await Engine.open(state, network_hosts=hosts, restore_grace=60, warm_slots=0)
        try:
            assert second.get(made.id).state.value == "running"
            assert second._live[made.id].netns == netns
            assert second.net.private.lookup(made.id, made.id) == member  # its place, read back
            r = await second.exec(made.id, ["python3", "-c",
                                            "import socket; print(socket.gethostbyname('m'))"])
            assert r.stdout.decode().strip() == member
            assert await _fetch(second, made.id, "good.test") == "GOOD GET / HTTP/1.0"
            assert await _fetch(second, made.id, "bad.test") != "BAD GET / HTTP/1.0"
            # UDP by address: its entries are in the new table's sets again
            assert await _udp(second, made.id, good) == "GOOD hi"
            assert await _udp(second, made.id, bad) == "ConnectionRefusedError"
            verdicts = {(e["name"], e["verdict"]) for e in second.network_events(made.id)}
            assert ("good.test", "allowed") in verdicts and ("bad.test", "refused") in verdicts
            await second.stop(made.id, grace=0)
            assert not Path(netns).exists()  # its link went with it
            assert not (NETNS_DIR / bridge).exists()  # and the bridge, with its last member
        finally:
            await second.close()


async def test_an_image_builds_sandbox_fails_typed_at_a_handover_and_leaves_nothing():
    from corral.runtime.engine import Engine
    from corral.runtime.engine_restore import BUILD_CUT_REASON

    state = tempfile.mkdtemp(prefix="corral-test-state-")
    first = await Engine.open(state, restore_grace=60, warm_slots=0)
    try:
        build = await first.create(build_root=True, memory_mb=128)  # a `user: root` step
        kept = await first.create(memory_mb=128)
        groups = first._live[build.id].cgroup._hierarchies()
        assert groups and all(g.is_dir() for g in groups)
    finally:
        await first.close(handover=True)
    assert not any(g.exists() for g in groups)  # its processes and cgroup are gone
    second = await Engine.open(state, restore_grace=60, warm_slots=0)
    try:
        ended = second.get(build.id)
        assert ended.state.value == "failed" and ended.reason == BUILD_CUT_REASON
        assert second.get(kept.id).state.value == "running"  # the others are adopted
    finally:
        await second.close()
