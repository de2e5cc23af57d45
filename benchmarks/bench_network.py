"""Egress policies: what a policy sandbox costs, against ``network="none"`` and the
host's network in the same run.

    python3 benchmarks/bench_network.py [--quick | --smoke] [--json OUT]

- ``create_policy_ms``: create→ready of a sandbox with a policy (median); baseline:
  ``network="none"``, interleaved with it. The difference is the link (a namespace,
  a veth pair, addresses, an nftables set element; runtime/net/netns.py), made ahead
  of time by a pool of warm links; each create is followed by 0.1 s idle for both.
- ``connect_policy_ms``: 50 TCP connections (connect, one echo, close) from inside a
  sandbox through the filter (nftables redirect + the proxy) to a server in a
  namespace this benchmark made; baseline: the same from a ``network="host"`` sandbox.
- ``download_100mb_policy_s``: 100 MB from that server through the proxy; baseline:
  the host's network. Needs root. No packet leaves the host (TEST-NET-2 addresses).
- ``udp_rtt_policy_us``: 500 UDP round trips (one datagram echoed) on one flow through
  the UDP relay (TPROXY; runtime/net/udp.py); baseline: the host's network.
- ``create_cow_volume_ms``: create→ready of a sandbox mounting a 1000-file ``cow``
  volume (median); baseline: ``network="none"`` without it, interleaved.
- ``create_member_ms``: create→ready of a sandbox joining a private network (its link,
  plus a veth pair on the network's bridge; runtime/net/private.py) that another member
  keeps up (median); baseline: ``network="none"``, interleaved.
- ``connect_private_ms``: the 50 connections of ``connect_policy_ms`` from one member to
  an echo server in another, by address (veth + bridge, no proxy); baseline: the host's.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_args  # noqa: E402  (a sibling script, not a package)
from tests.security.net_helpers import server_ns  # noqa: E402

from corral.network_schema import NetworkPolicy  # noqa: E402
from corral.runtime.engine import Engine  # noqa: E402

CONNECT = r"""
import socket, sys, time
t = time.perf_counter()
for _ in range(50):
    s = socket.create_connection((sys.argv[1], 7000), timeout=10)
    s.sendall(b"x"); assert s.recv(1) == b"x"; s.close()
print((time.perf_counter() - t) / 50 * 1000)
"""
DOWNLOAD = r"""
import socket, sys, time
t = time.perf_counter(); n = 0
s = socket.create_connection((sys.argv[1], 7001), timeout=30)
while chunk := s.recv(1 << 20):
    n += len(chunk)
assert n == 100 << 20, n
print(time.perf_counter() - t)
"""

UDP_RTT = r"""
import socket, sys, time
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)
u.connect((sys.argv[1], 7002)); u.send(b"x"); u.recv(100)  # the flow is open
t = time.perf_counter()
for _ in range(500):
    u.send(b"x"); u.recv(100)
print((time.perf_counter() - t) / 500 * 1e6)
"""

ECHO = ("nohup python3 -c \"import socket,threading\ns=socket.socket();s.setsockopt(1,2,1)\n"
        "s.bind(('0.0.0.0',7000));s.listen(64)\ndef e(c):\n while d:=c.recv(4096): c.sendall(d)\n"
        " c.close()\nwhile True: threading.Thread(target=e,args=(s.accept()[0],)).start()\" "
        ">/dev/null 2>&1 &")


def _make_volume(engine: Engine) -> None:
    src = Path(tempfile.mkdtemp(prefix="corral-bench-vol-"))
    for i in range(1000):
        (src / f"f{i}.txt").write_text(f"row {i}\n")
    tar = src.with_suffix(".tar")
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname=".")
    engine.volumes.create(None, "bench", tar)
    shutil.rmtree(src)
    tar.unlink()


async def _figure(engine: Engine, sid: str, code: str, ip: str) -> float:
    r = await engine.exec(sid, ["python3", "-c", code, ip], timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    return float(r.stdout)


async def run(rounds: int) -> dict[str, float]:
    with server_ns(2, "BENCH") as ip:
        engine = await Engine.open(tempfile.mkdtemp(prefix="corral-bench-net-"))
        try:
            policy = {"allow": [f"{ip}"]}
            await asyncio.to_thread(_make_volume, engine)
            engine.networks.create(None, "ep", NetworkPolicy(), private=True)
            anchor = await engine.create(network="ep", memory_mb=128)  # keeps the bridge up
            await engine.exec(anchor.id, ["sh", "-c", ECHO])
            times: dict[str, list[float]] = {"none": [], "policy": [], "cow": [], "member": []}
            kinds: tuple[tuple[str, dict[str, Any]], ...] = (
                ("none", {}), ("policy", {"network": policy}),
                ("cow", {"volumes": {"/data": "bench"}}), ("member", {"network": "ep"}))
            for _ in range(rounds):
                for kind, extra in kinds:
                    t = time.perf_counter()
                    sb = await engine.create(memory_mb=128, **extra)
                    times[kind].append((time.perf_counter() - t) * 1000)
                    await engine.delete(sb.id)
                    await asyncio.sleep(0.1)  # both kinds: warm slots (and links) refill
            filtered = await engine.create(network=policy, memory_mb=256)
            host = await engine.create(network="host", memory_mb=256)
            member = await engine.create(network="ep", memory_mb=256)
            peer = engine.net.private.lookup(member.id, anchor.id)
            assert peer is not None
            res: dict[str, float] = {
                "create_policy_ms": statistics.median(times["policy"]),
                "create_none_ms": statistics.median(times["none"]),
                "create_cow_volume_ms": statistics.median(times["cow"]),
                "create_member_ms": statistics.median(times["member"]),
                "connect_private_ms": await _figure(engine, member.id, CONNECT, peer),
                "connect_policy_ms": await _figure(engine, filtered.id, CONNECT, ip),
                "connect_host_ms": await _figure(engine, host.id, CONNECT, ip),
                "download_100mb_policy_s": await _figure(engine, filtered.id, DOWNLOAD, ip),
                "download_100mb_host_s": await _figure(engine, host.id, DOWNLOAD, ip),
                "udp_rtt_policy_us": await _figure(engine, filtered.id, UDP_RTT, ip),
                "udp_rtt_host_us": await _figure(engine, host.id, UDP_RTT, ip),
                "rounds": rounds,
            }
        finally:
            await engine.close()
    return res


def main() -> int:
    args = bench_args.parser(__doc__).parse_args()
    if os.geteuid() != 0:
        print("needs root (real sandboxes, namespaces, nftables)")
        return 1
    res = asyncio.run(run(bench_args.pick(args, 30, 8, 1)))
    rows = [
        ("create_policy_ms", "create_none_ms", 'network="none"'),
        ("create_cow_volume_ms", "create_none_ms", "no volume"),
        ("create_member_ms", "create_none_ms", 'network="none"'),
        ("connect_private_ms", "connect_host_ms", 'network="host"'),
        ("connect_policy_ms", "connect_host_ms", 'network="host"'),
        ("download_100mb_policy_s", "download_100mb_host_s", 'network="host"'),
        ("udp_rtt_policy_us", "udp_rtt_host_us", 'network="host"'),
    ]
    print(f"{'figure':26} {'value':>9}  baseline (same run)")
    for key, base, what in rows:
        print(f"{key:26} {res[key]:9.3f}  {what}: {res[base]:.3f} ({res[key] / res[base]:.2f}x, "
              f"{res[key] - res[base]:+.3f})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
