"""Private networks (``corral.Network.create(NAME, private=True)``): the sandboxes of one
reach each other by name and address, and nothing else reaches them: not a sandbox of
another network, not another tenant's, not the host; and a member that forged its
address or MAC (a sandbox cannot: no CAP_NET_ADMIN, no raw socket; here root does it
inside a member's namespace) gets no frame across the bridge."""

from __future__ import annotations

import ipaddress
import json
import subprocess

import pytest

import corral
from corral.cli.main import main
from corral.errors import InvalidArgument, InvalidState, NetworkNotFound
from corral.runtime.net.netns import subnet
from tests.security.tenants_helpers import no_traceback, team_daemon

SERVE = ("nohup python3 -c \"import socket\ns=socket.socket();s.setsockopt(1,2,1)\n"
         "s.bind(('0.0.0.0',5432));s.listen()\nwhile True:\n c,a=s.accept();"
         "c.sendall(('db saw '+a[0]).encode());c.close()\" >/dev/null 2>&1 &")
DIAL = r"""
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], 5432), timeout=float(sys.argv[2]))
    print(s.recv(100).decode())
except Exception as e:
    print(type(e).__name__)
"""
# what a sandbox may try on its own: a raw socket (ARP/IP forgery), a new address
FORGE = r"""
import fcntl, socket, struct
for what, make in (("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)),
                   ("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, 255))):
    try:
        make(); print(what, "opened")
    except OSError:  # EPERM (no CAP_NET_RAW) or EAFNOSUPPORT (seccomp)
        print(what, "refused")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
req = struct.pack("16sH2s4s8s", b"eth1", socket.AF_INET, b"\0\0",
                  socket.inet_aton("10.220.0.200"), b"\0" * 8)
try:
    fcntl.ioctl(s, 0x8916, req); print("address changed")  # SIOCSIFADDR
except OSError:
    print("address refused")
"""
CUT = ("ConnectionRefusedError", "ConnectionResetError")


def dial(sb, target: str, timeout: float = 5) -> str:
    return sb.exec(["python3", "-c", DIAL, target, str(timeout)], timeout=60).stdout.strip()


def member_ns(sb) -> str:
    """The sandbox's network namespace (``corral-N``: its link's index, from the link's
    host end, its nameserver; links are numbered machine-wide)."""
    gateway = sb.exec("cat /etc/resolv.conf").stdout.split()[1]
    return f"corral-{(int(ipaddress.ip_address(gateway)) - int(subnet().network_address)) // 4}"


def root_dial(ns: str, src: str, dst: str) -> str:
    code = ("import socket,sys\ns=socket.socket();s.settimeout(2)\n"
            "try:\n s.bind((sys.argv[1],0));s.connect((sys.argv[2],5432));print(s.recv(99).decode())\n"
            "except Exception as e:\n print(type(e).__name__)")
    return subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", code, src, dst],
                          capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


@pytest.fixture(scope="module")
def episode(team):
    """Alice's private network "ep": db (serving 5432) and app; made once."""
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        net = corral.Network.create("ep", private=True, client=alice)
        db = corral.Sandbox.create(network=net.member("db"), memory_mb=64, client=alice)
        app = corral.Sandbox.create(network="ep", memory_mb=64, client=alice)
        db.exec(["sh", "-c", SERVE])
        yield alice, net, db, app
    team.cleanup()
    no_traceback(team)


def ip_of(sb) -> str:
    return sb.exec(["python3", "-c", "import socket;print(socket.gethostbyname('"
                    + sb.id + "'))"]).stdout.strip()


def test_members_reach_each_other_and_nothing_else(team, episode):
    alice, net, db, app = episode
    db_ip, app_ip = ip_of(db), ip_of(app)
    assert db_ip.startswith("10.220.") and app_ip != db_ip
    for target in ("db", db.id, db_ip):  # by alias, by id, by address
        assert dial(app, target) == f"db saw {app_ip}"
    assert dial(app, "example.com") == "gaierror"  # "ep" allows nothing outside
    assert ip_of(db) == db_ip and dial(db, app.id, 2) == "ConnectionRefusedError"
    # another private network of the same tenant: its own bridge and subnet
    corral.Network.create("ep2", private=True, client=alice)
    other = corral.Sandbox.create(network="ep2", memory_mb=64, client=alice)
    # a tenant's plain policy sandbox, and another tenant's private network
    plain = corral.Sandbox.create(network={"allow": ["*"]}, memory_mb=64, client=alice)
    with corral.Client(team.url, token=team.tokens["bob"]) as bob:
        with pytest.raises(NetworkNotFound):  # alice's network is not bob's to join
            corral.Sandbox.create(network={"join": "ep"}, memory_mb=64, client=bob)
        corral.Network.create("ep", private=True, client=bob)
        bobs = corral.Sandbox.create(network="ep", memory_mb=64, client=bob)
        for outsider in (other, plain, bobs):
            assert dial(outsider, "db") == "gaierror"
            assert dial(outsider, db.id) == "gaierror"
            assert dial(outsider, db_ip) in CUT  # the proxy's reset
    with team.admin() as admin:  # even the admin's "every address" policy
        r = admin.post("/v1/sandboxes", json={"memory_mb": 64, "network": {
            "allow": ["0.0.0.0/0", "10.0.0.0/8"]}})
        assert r.status_code == 201, r.text
        code = ["python3", "-c", DIAL, db_ip, "5"]
        out = admin.post(f"/v1/sandboxes/{r.json()['id']}/exec", json={"cmd": code})
        assert out.json()["stdout"].strip() in CUT
    # the bridges' namespaces have no address (nothing there answers or routes), and the
    # host has no interface on the range
    bridges = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                           text=True, check=True).stdout.split() if "-pn-" in ns]
    assert len(bridges) >= 3
    for ns in bridges:  # another test's may go meanwhile
        out = subprocess.run(["ip", "-n", ns, "-j", "addr"], capture_output=True, text=True)
        assert [a for i in json.loads(out.stdout or "[]") for a in i["addr_info"]] == []
    host = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True)
    assert "10.220." not in host.stdout


def test_a_member_cannot_forge_its_way(episode):
    _, _, db, app = episode
    r = app.exec(["python3", "-c", FORGE])
    out = r.stdout.split("\n")
    assert out == ["packet refused", "raw refused", "address refused", ""], r.stderr
    # defence in depth: root forges inside app's namespace; the bridge drops it all
    db_ip, app_ip = ip_of(db), ip_of(app)
    ns = member_ns(app)
    assert root_dial(ns, app_ip, db_ip) == f"db saw {app_ip}"  # the control
    forged = db_ip.rsplit(".", 1)[0] + ".250"
    subprocess.run(["ip", "-n", ns, "addr", "add", f"{forged}/24", "dev", "eth1"], check=True)
    try:
        assert root_dial(ns, forged, db_ip) == "TimeoutError"  # another address
    finally:
        subprocess.run(["ip", "-n", ns, "addr", "del", f"{forged}/24", "dev", "eth1"])
    mac = subprocess.run(["ip", "-n", ns, "-j", "link", "show", "eth1"], capture_output=True,
                         text=True, check=True)
    own = json.loads(mac.stdout)[0]["address"]
    subprocess.run(["ip", "-n", ns, "neigh", "flush", "dev", "eth1"], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "eth1", "address", "02:63:0a:dc:ff:fe"],
                   check=True)
    try:
        assert root_dial(ns, app_ip, db_ip) == "TimeoutError"  # another MAC
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth1", "address", own], check=True)


# Run as root in a member's namespace: hears frames carrying MARK on eth1 until the
# honest ARP request (the sender's last frame: all before it came first) or 60 s
HEAR = r"""
import json, socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)); s.bind(("eth1", 0))
s.settimeout(0.1); print("ready", flush=True); heard = []; end = time.monotonic() + 60
while time.monotonic() < end and not (heard and heard[-1] == "0806/1"):
    try:
        f = s.recv(2048)
    except TimeoutError:
        continue
    if sys.argv[1].encode() in f:
        heard.append(f[12:14].hex() + ("/%d" % f[21] if f[12:14] == b"\x08\x06" else ""))
print(json.dumps(heard))
"""
# ... and sends what a hostile root there would: an IPv6 router advertisement, a
# gratuitous ARP taking another member's address, a DHCP offer from a forged router, a
# VLAN-tagged frame; and, the control, an honest ARP request
ROGUE = r"""
import socket, struct, sys
me, mine, theirs, mark = bytes.fromhex(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].encode()
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); s.bind(("eth1", 0))
bcast, a = b"\xff" * 6, socket.inet_aton
def arp(op, sender_ip, target_ip):
    return bcast + me + b"\x08\x06" + struct.pack("!HHBBH", 1, 0x0800, 6, 4, op) + me + a(sender_ip) + bytes(6) + a(target_ip)
ra = (b"\x33\x33\x00\x00\x00\x01" + me + b"\x86\xdd" + struct.pack("!IHBB", 6 << 28, 16, 58, 255)
      + socket.inet_pton(socket.AF_INET6, "fe80::1") + socket.inet_pton(socket.AF_INET6, "ff02::1")
      + struct.pack("!BBHBBHII", 134, 0, 0, 64, 0, 1800, 0, 0))
router = theirs.rsplit(".", 1)[0] + ".1"
udp = struct.pack("!HHHH", 67, 68, 8 + 240, 0) + bytes(240)
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, a(router), a("255.255.255.255"))
dhcp = bcast + me + b"\x08\x00" + ip + udp
vlan = bcast + me + b"\x81\x00\x00\x05\x08\x00" + ip + udp
for frame in (ra, arp(2, theirs, theirs), dhcp, vlan, arp(1, mine, theirs)):
    s.send(frame + mark)
"""


def test_rogue_frames_from_a_members_namespace_are_dropped(episode):
    """Root in a member's namespace (a sandbox has no raw socket: see above) sends RA,
    a gratuitous ARP for another member's address, a DHCP offer and a VLAN frame: the
    bridge's guard lets none through; its honest ARP request arrives (the control)."""
    _, _, db, app = episode
    db_ip, app_ip, mark = ip_of(db), ip_of(app), "corral-rogue-" + db.id
    app_ns = member_ns(app)
    link = json.loads(subprocess.run(["ip", "-n", app_ns, "-j", "link", "show", "eth1"],
                                     capture_output=True, text=True, check=True).stdout)
    hear = subprocess.Popen(["ip", "netns", "exec", member_ns(db), "python3", "-c", HEAR, mark],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert hear.stdout.readline() == "ready\n"
        subprocess.run(["ip", "netns", "exec", app_ns, "python3", "-c", ROGUE,
                        link[0]["address"].replace(":", ""), app_ip, db_ip, mark],
                       check=True, timeout=30)
        heard = json.loads(hear.communicate(timeout=90)[0])
    finally:
        hear.kill()
    assert heard == ["0806/1"]  # the honest ARP request alone
    neigh = subprocess.run(["ip", "-n", member_ns(db), "neigh", "show", db_ip],
                           capture_output=True, text=True).stdout
    assert link[0]["address"] not in neigh  # nobody learnt app's MAC for db's address


def test_joining_is_checked(team, episode, capsys):
    alice, net, db, app = episode
    # the CLI: a private network, and a member joining it by alias with its own rules
    cli = ["--url", team.url, "--token", team.tokens["alice"]]
    assert main([*cli, "network", "create", "cli-ep", "--private"]) == 0
    assert main([*cli, "create", "--memory-mb", "64", "--join", "cli-ep", "--alias", "w",
                 "--allow", "pypi"]) == 0
    sid = capsys.readouterr().out.split()[-1]
    member = corral.Sandbox.connect(sid, client=alice)
    assert (member.info.spec.network.join, member.info.spec.network.alias) == ("cli-ep", "w")
    assert main([*cli, "network", "ls"]) == 0
    assert "cli-ep\tallow=\tdeny=\tprivate" in capsys.readouterr().out.splitlines()
    assert main([*cli, "create", "--alias", "w"]) == 2  # an alias needs --join
    member.delete()
    corral.Network.create("open", allow=["pypi"], client=alice)
    bad = [({"join": "nope"}, NetworkNotFound), ({"join": "open"}, InvalidArgument),
           ({"alias": "x"}, InvalidArgument), ({"join": "ep", "alias": "db"}, InvalidState),
           ({"join": "ep", "alias": "sb-1"}, InvalidArgument),
           ({"join": "ep", "alias": "Bad_Name"}, InvalidArgument)]
    for network, error in bad:
        with pytest.raises(error):
            corral.Sandbox.create(network=network, memory_mb=64, client=alice)
    with pytest.raises(InvalidState):  # sandboxes are on it
        net.delete()
    with team.tenant("alice") as c:  # membership is fixed at create
        r = c.put(f"/v1/sandboxes/{app.id}/network", json={"allow": [], "join": "ep2"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    app.update_network(allow=["pypi"])
    assert app.info.spec.network.join == "ep" and dial(app, "db") == f"db saw {ip_of(app)}"


def test_max_mbps_caps_a_members_traffic_with_the_others_too(episode):
    """A member's ``max_mbps`` shapes its link to the other members as its policy link:
    its eth1 (what it sends) and its bridge port (what it receives), neither in the
    sandbox's reach; ``update_network`` changes or lifts both."""
    alice, net, db, app = episode
    capped = corral.Sandbox.create(network=net.member("capped", max_mbps=8), memory_mb=64,
                                   client=alice)
    ns = member_ns(capped)
    bridge = next(n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True, check=True).stdout.split()
                  if "-pn-" in n and ip_of(capped) in _members(n))

    def rates() -> list[str]:
        out = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth1"],
                             capture_output=True, text=True).stdout
        port = subprocess.run(["ip", "-n", bridge, "-j", "link"], capture_output=True,
                              text=True).stdout
        for link in json.loads(port or "[]"):
            out += subprocess.run(["tc", "-n", bridge, "qdisc", "show", "dev", link["ifname"]],
                                  capture_output=True, text=True).stdout
        return [w for line in out.splitlines() if "tbf" in line
                for w in line.split() if w.endswith("bit")]

    assert rates().count("8Mbit") == 2  # eth1, and its port (no other member's)
    capped.exec("tc qdisc del dev eth1 root 2>&1; ip link set eth1 down 2>&1", timeout=30)
    assert rates().count("8Mbit") == 2  # not the sandbox's to change
    assert dial(capped, "db") == f"db saw {ip_of(capped)}"
    capped.update_network(max_mbps=100)
    assert rates() == ["100Mbit", "100Mbit"]
    capped.update_network()
    assert rates() == []
    capped.delete()


def _members(bridge_ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", bridge_ns, "nft", "list", "set", "bridge",
                           "guard", "members"], capture_output=True, text=True).stdout


def test_a_network_goes_right_after_its_members_are_deleted(team):
    """A DELETE replies before its sandbox's teardown (which takes it off its private
    network) is done: removing the network just after must not see it as still on it,
    and a sandbox still on it still keeps the network."""
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        for round_ in range(3):
            net = corral.Network.create(f"brief{round_}", private=True, client=alice)
            members = [corral.Sandbox.create(network=net.member(f"m{i}"), memory_mb=64,
                                             client=alice) for i in range(2)]
            members[0].delete()
            with pytest.raises(InvalidState, match="delete them first"):
                net.delete()  # the other is still on it
            members[1].delete()
            net.delete()
            assert f"brief{round_}" not in [n.name for n in corral.Network.list(client=alice)]
