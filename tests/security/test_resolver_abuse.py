"""A hostile policy sandbox against corral's resolver (runtime/net/dns.py, manager.py).

- DNS over TCP: every connection to port 53 is a descriptor of the daemon's for up to
  10 s. They count against the sandbox's cap of open connections, as the proxy's do, so
  one sandbox cannot pile up the daemon's descriptors through its resolver.
- Slow names: each allowed name is looked up on the host (getaddrinfo, a blocking call
  in a thread). A sandbox allowed ``*`` that asks for names whose servers never answer
  (an attacker's domain) took every thread of the daemon's shared executor (6 on 2
  cores): other sandboxes' lookups timed out (empty answers) and every
  ``asyncio.to_thread`` of the daemon queued behind them. The host's lookups now run
  in threads of their own, at most a few per sandbox at once.

Servers live in network namespaces the tests make; the slow name server is one of them,
given to the engine (a child process) by a private mount of /etc/resolv.conf.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import ROOT_REASON, have_root_runtime
from tests.security.net_helpers import no_host_proxy, server_ns  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
async def engine_good():
    from corral.runtime.engine import Engine

    with server_ns(2, "GOOD") as good:
        eng = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"),
                                network_hosts={"good.test": good})
        try:
            yield eng
        finally:
            await eng.close()


async def test_tcp_dns_connections_count_against_the_cap(engine_good):
    """Idle TCP connections to port 53 are capped per sandbox like the proxy's: those
    over the cap are reset at once (before: each held a descriptor for 10 s, unbounded)."""
    from corral.runtime.net.manager import MAX_CONNECTIONS

    engine = engine_good
    sb = await engine.create(network={"allow": ["good.test"]})
    extra = 100
    code = f"""
import json, socket, time
held, reset, early = [], set(), 0
for _ in range({MAX_CONNECTIONS} + {extra}):
    try:
        s = socket.create_connection(("192.0.2.53", 53), timeout=10)
    except ConnectionResetError:
        early += 1
        continue
    except TimeoutError:
        print(json.dumps({{"timeout_at": len(held) + early}}))
        raise
    s.setblocking(False)
    held.append(s)
for _ in range(50):  # a reset is at once; a held one ends in a FIN after 10 s
    for i, s in enumerate(held):
        try:
            s.recv(1)
        except BlockingIOError:
            pass
        except ConnectionResetError:
            reset.add(i)
    if len(reset) + early >= {extra}:
        break
    time.sleep(0.1)
print(json.dumps({{"reset": len(reset) + early}}))
"""
    r = await engine.exec(sb.id, ["python3", "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["reset"] >= extra
    assert any("connections at once" in e["reason"] for e in engine.network_events(sb.id))
    # the sandbox's DNS still works once they are closed
    r = await engine.exec(sb.id, ["python3", "-c",
                                  "import socket; print(socket.gethostbyname('good.test'))"],
                          timeout=60)
    assert r.returncode == 0, r.stderr.decode()


# A name server that reads every query and never answers (an attacker's domain).
BLACKHOLE = r"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 53))
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("0.0.0.0", 53)); t.listen(64)
print("ready", flush=True)
while True:
    s.recv(4096)
"""

# The engine, in a child whose /etc/resolv.conf names the black hole and whose
# /etc/hosts names fast.test: sandbox A (allow "*") floods queries for names under the
# black hole for FLOOD_S seconds; meanwhile sandbox C looks fast.test up five times.
CHILD = r"""
import asyncio, json, sys, tempfile, time
from corral.runtime.engine import Engine

FLOOD_S = 60
FLOOD = '''
import os, socket, struct, sys, time
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.setblocking(False)
end, n = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    name = b"x%d" % n + b".slow.test"
    n += 1
    q = struct.pack("!6H", n & 0xFFFF, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p for p in name.split(b".")) + b"\\0" + struct.pack("!2H", 1, 1)
    try:
        u.sendto(q, ("192.0.2.53", 53))
    except BlockingIOError:
        pass
    time.sleep(0.01)
print(n)
'''
LOOKUPS = '''
import json, socket
out = []
for _ in range(5):
    try:
        out.append(socket.gethostbyname("fast.test"))
    except OSError as e:
        out.append(type(e).__name__)
print(json.dumps(out))
'''

async def main():
    eng = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"))
    try:
        a = await eng.create(network={"allow": ["*"]})
        c = await eng.create(network={"allow": ["fast.test"]})
        flood = asyncio.ensure_future(eng.exec(a.id, ["python3", "-c", FLOOD, str(FLOOD_S)],
                                               timeout=FLOOD_S + 60))
        for _ in range(600):  # the flood is on
            if sum(e["kind"] == "dns" for e in eng.network_events(a.id)) >= 20 or flood.done():
                break
            await asyncio.sleep(0.2)
        r = await eng.exec(c.id, ["python3", "-c", LOOKUPS], timeout=120)
        print(json.dumps({"during_flood": not flood.done(),
                          "lookups": json.loads(r.stdout or b"null")}), flush=True)
        await flood
    finally:
        await eng.close()

asyncio.run(main())
"""


async def test_a_flood_of_slow_names_leaves_other_sandboxes_answered(tmp_path):
    with server_ns(10, "NS") as ns_ip:
        # the namespace's server answers HTTP; the black hole takes port 53 beside it
        sink = subprocess.Popen(["ip", "netns", "exec", _netns_of(ns_ip), sys.executable, "-c",
                                 BLACKHOLE], stdout=subprocess.PIPE)
        try:
            assert sink.stdout is not None and sink.stdout.readline() == b"ready\n"
            conf = tmp_path / "resolv.conf"
            conf.write_text(f"nameserver {ns_ip}\noptions timeout:8 attempts:1\n")
            hosts = tmp_path / "hosts"
            hosts.write_text("127.0.0.1 localhost\n198.51.100.2 fast.test\n")
            script = tmp_path / "child.py"
            script.write_text(CHILD)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [os.path.join(ROOT, "src"), ROOT, os.environ.get("PYTHONPATH", "")])}
            proc = await asyncio.create_subprocess_exec(
                "unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount --bind "$1" /etc/resolv.conf && mount --bind "$2" /etc/hosts'
                ' && exec "$3" "$4"', "sh", str(conf), str(hosts), sys.executable, str(script),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
            try:
                async with asyncio.timeout(150):
                    line = await proc.stdout.readline()
            except TimeoutError:
                line = b""
            if not line:
                proc.kill()
            out, err = await proc.communicate()
        finally:
            sink.kill()
            sink.wait()
    assert line, f"the child printed nothing: {err.decode()[-3000:]}"
    got = json.loads(line)
    assert got == {"during_flood": True, "lookups": ["198.51.100.2"] * 5}, (
        got, err.decode()[-2000:])


def _netns_of(ip: str) -> str:
    """The test namespace that holds ``ip`` (server_ns names it at random)."""
    for name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=True).stdout.split():
        if not name.startswith("ctest-"):
            continue
        r = subprocess.run(["ip", "-n", name, "-4", "addr"], capture_output=True, text=True)
        if f"inet {ip}/" in r.stdout:
            return name
    raise AssertionError(f"no namespace holds {ip}")
