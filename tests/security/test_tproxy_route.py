"""The host's TPROXY policy route (``ip rule fwmark 0x636f lookup 25455`` and that
table's ``local`` route: runtime/net/netns.py) is removed by the last engine to stop.

Before, every engine added it and none removed it: a host that ever ran corral kept a
rule and a routing table nobody needed. Now an engine that stops removes them with its
nftables table when no other engine's table (``inet corral_*``) is left, under a host
lock that engines starting take too. Run in a network namespace of the test's own
(``unshare -n``: rules, routes and tables are per namespace), with two engines'
network managers: the first to stop leaves the route to the second, which removes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT_REASON, have_root_runtime

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)

SCRIPT = r"""
import asyncio, json, secrets, subprocess
from corral.runtime.net import netns
from corral.runtime.net.manager import NetworkManager
from corral.runtime.paths import uid_lock_dir

def route():
    rule = subprocess.run(["ip", "-4", "rule"], capture_output=True, text=True).stdout
    table = subprocess.run(["ip", "-4", "route", "show", "table", str(netns.TPROXY_TABLE)],
                           capture_output=True, text=True).stdout
    return [f"lookup {netns.TPROXY_TABLE}" in rule, bool(table.strip()), netns.engine_tables()]

async def main():
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    lock_dir = uid_lock_dir().parent / "net"  # the host's: its links' locks are honoured
    tag = secrets.token_hex(3)
    one = NetworkManager(f"t1{tag}", lock_dir, warm=0)
    two = NetworkManager(f"t2{tag}", lock_dir, warm=0)
    seen = [route()]
    await one._start()
    await two._start()
    seen.append(route())
    await one.close()
    seen.append(route())
    await two.close()
    seen.append(route())
    print(json.dumps(seen))

asyncio.run(main())
"""


def test_the_last_engine_to_stop_removes_the_tproxy_route():
    r = subprocess.run(["unshare", "-n", sys.executable, "-c", SCRIPT], capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    before, both, one_left, none_left = json.loads(r.stdout)
    assert before == [False, False, []]  # a namespace of the test's own: nothing yet
    assert both[:2] == [True, True] and len(both[2]) == 2
    assert one_left[:2] == [True, True] and len(one_left[2]) == 1  # the other still needs it
    assert none_left == [False, False, []], none_left
