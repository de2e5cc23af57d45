"""Several engines (daemons) with policy sandboxes on one host, and the nftables table
a killed daemon leaves behind (runtime/net/netns.py).

Each engine has a table of its own; a table's anti-spoofing rule drops packets that
claim a link's address but did not come in on a link. It must not count only its own
engine's links as links: another daemon's sandboxes (or, after a daemon was killed,
every sandbox on the host) would lose their network, their DNS and their connections
dropped in the host's input chain.
"""

from __future__ import annotations

import json
import tempfile

import pytest

from tests.conftest import ROOT_REASON, have_root_runtime
from tests.security.net_helpers import no_host_proxy, server_ns  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)

FETCH = r"""
import json, socket
try:
    s = socket.create_connection(("good.test", 80), timeout=10)
    s.sendall(b"GET / HTTP/1.0\r\nHost: good.test\r\n\r\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    out = data.split(b"\r\n\r\n", 1)[-1].decode()
except Exception as e:
    out = type(e).__name__
print(json.dumps(out))
"""


async def fetch(engine, sid: str) -> str:
    r = await engine.exec(sid, ["python3", "-c", FETCH], timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


async def test_two_engines_policy_sandboxes_both_reach_allowed_names():
    from corral.runtime.engine import Engine

    with server_ns(2, "GOOD") as good:
        one = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"),
                                network_hosts={"good.test": good})
        two = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"),
                                network_hosts={"good.test": good})
        try:
            a = await one.create(network={"allow": ["good.test"]})
            b = await two.create(network={"allow": ["good.test"]})
            assert await fetch(one, a.id) == "GOOD GET / HTTP/1.0"
            assert await fetch(two, b.id) == "GOOD GET / HTTP/1.0"
        finally:
            await one.close()
            await two.close()


async def test_a_killed_daemons_table_blocks_nothing():
    """What a daemon killed with SIGKILL leaves: its table, its links gone."""
    import secrets

    from corral.runtime.engine import Engine
    from corral.runtime.net import netns

    stale = f"corral_stale{secrets.token_hex(4)}"
    netns.create_table(stale, proxy_port=9, dns_port=9, udp_port=9)
    try:
        with server_ns(2, "GOOD") as good:
            eng = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"),
                                    network_hosts={"good.test": good})
            try:
                a = await eng.create(network={"allow": ["good.test"]})
                assert await fetch(eng, a.id) == "GOOD GET / HTTP/1.0"
            finally:
                await eng.close()
    finally:
        netns.delete_table(stale)
