"""The UDP relay (runtime/net/udp.py) never carries a sandbox's datagram to the host.

An admin's policy may name every address, private ranges included; the relay's own
check (``NetworkManager._never``) still refuses the host's own addresses (loopback,
every interface's address, its subnets' broadcast addresses), the links' ends and other
sandboxes, on IPv4 and IPv6, IPv4-mapped IPv6 included. A UDP service of the host bound
to every address (as a DNS cache, a metrics agent or a daemon's own UDP port is) gets
none of the datagrams, and the sandbox's sends are refused at once.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess

from corral.runtime.net import netns

PROBE = r"""
import concurrent.futures, json, socket, sys
def udp(host, port):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    u = socket.socket(fam, socket.SOCK_DGRAM); u.settimeout(2)
    u.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    try:
        u.connect((host, port)); u.send(b"leak " + host.encode())
        return u.recv(100).decode()
    except Exception as e:
        return type(e).__name__
targets, port = json.loads(sys.argv[1]), int(sys.argv[2])
with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:  # the timeouts at once
    done = {t: pool.submit(udp, t, port) for t in targets}
    print(json.dumps({t: f.result() for t, f in done.items()}))
"""
WIDE = {"allow": ["0.0.0.0/0", "10.0.0.0/8", "127.0.0.0/8", "172.16.0.0/12",
                  "192.168.0.0/16", "100.64.0.0/10", "::/0", "fc00::/7"]}


def host_addresses() -> list[str]:
    """The host's own addresses (not link-local, not the links' ends: other engines'
    too) and its IPv4 subnets' broadcasts."""
    links = (netns.subnet(), netns.subnet6())
    out = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True,
                                    check=True).stdout)
    found = []
    for iface in out:
        for a in iface.get("addr_info", []):
            if a.get("scope") == "link" or any(
                    ipaddress.ip_address(a["local"]) in n for n in links):
                continue
            found.append(a["local"])
            if a["family"] == "inet" and a["prefixlen"] < 31:
                net = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
                found.append(str(net.broadcast_address))
    return found


async def test_udp_relay_reaches_no_host_service(engine):
    servers = []
    for family, any_ in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((any_, servers[0].getsockname()[1] if servers else 0))
        s.setblocking(False)
        servers.append(s)
    port = servers[0].getsockname()[1]
    try:
        other = await engine.create(network=WIDE)
        sb = await engine.create(network=WIDE)
        link = engine.net._by_id[sb.id].link
        targets = {*host_addresses(), "127.0.0.1", "::1", link.host_ip,
                   engine.net._by_id[other.id].link.host_ip,
                   engine.net._by_id[other.id].link.sandbox_ip, "::ffff:127.0.0.1",
                   "255.255.255.255"}
        if ":" in str(link.host_ip6 or ""):
            targets.add(link.host_ip6)
        r = await engine.exec(sb.id, ["python3", "-c", PROBE, json.dumps(sorted(targets)),
                                      str(port)], timeout=60)
        got = json.loads(r.stdout)
        leaked = []
        for s in servers:
            while True:
                try:
                    leaked.append(s.recv(200))
                except BlockingIOError:
                    break
        assert leaked == []
        for target, outcome in got.items():  # refused (ICMP) or dropped: never an answer
            assert outcome in ("ConnectionRefusedError", "TimeoutError", "OSError",
                               "PermissionError"), (target, outcome)
        refused = [e for e in engine.network_events(sb.id) if e["kind"] == "udp"
                   and e["verdict"] == "refused"]
        assert refused
    finally:
        for s in servers:
            s.close()
