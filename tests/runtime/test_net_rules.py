"""Egress-policy parts that need no root: rules, verdicts, the Host/SNI sniffer, the
resolver's wire format and the pypi preset (runtime/net, network_schema)."""

from __future__ import annotations

import ipaddress
import ssl
import struct

import pytest

from corral.errors import InvalidArgument
from corral.network_schema import NetworkPolicy, RuleKind, parse_rule
from corral.runtime.net import dns, policy, sniff
from corral.schema import NetworkMode, SandboxSpec


@pytest.mark.parametrize("rule,kind,value,port", [
    ("Example.COM", RuleKind.DOMAIN, "example.com", None),
    ("*.example.com:443", RuleKind.WILDCARD, "example.com", 443),
    ("*", RuleKind.ANY_NAME, "*", None),
    ("1.2.3.4", RuleKind.CIDR, "1.2.3.4/32", None),
    ("10.0.0.0/8:5432", RuleKind.CIDR, "10.0.0.0/8", 5432),
    ("2001:db8::1", RuleKind.CIDR, "2001:db8::1/128", None),
    ("[2001:db8::/32]:443", RuleKind.CIDR, "2001:db8::/32", 443),
    ("pypi", RuleKind.PRESET, "pypi", None),
])
def test_rules_parse(rule, kind, value, port):
    r = parse_rule(rule)
    assert (r.kind, r.value, r.port) == (kind, value, port)


@pytest.mark.parametrize("rule", [
    "", " example.com", "example.com:0", "example.com:65536", "example.com:x", "10.0.0.1/8",
    "300.1.1.1", "10.0.0.0/33", "a..b", "exa mple.com", "-bad.com", "a/b", "../etc",
    "[2001:db8::1]", "x" * 300, "*.", "a.*.com",
])
def test_bad_rules_refused_typed(rule):
    with pytest.raises(ValueError):
        parse_rule(rule)
    with pytest.raises(InvalidArgument) as err:
        SandboxSpec.parse(network={"allow": [rule]})
    assert "network" in str(err.value)


def test_spec_network_kinds():
    assert SandboxSpec.parse(network="none").network == NetworkMode.NONE
    assert SandboxSpec.parse(network="host").network == NetworkMode.HOST
    spec = SandboxSpec.parse(network={"allow": ["pypi"], "deny": ["1.2.3.4"]})
    assert isinstance(spec.network, NetworkPolicy)
    assert SandboxSpec.parse(spec.model_dump(mode="json")) == spec  # the wire round trip
    with pytest.raises(InvalidArgument):
        SandboxSpec.parse(network={"allow": ["a.com"], "other": []})
    assert SandboxSpec.parse(network="bridge").network == "bridge"  # a named network's
    for bad in ("Bridge", "a/b", "..", "", "x" * 64):
        with pytest.raises(InvalidArgument):
            SandboxSpec.parse(network=bad)
    assert SandboxSpec.parse(network={"max_mbps": 8}).network.max_mbps == 8
    for bad in (0, -1, 100_001, "8", 1.5, True):
        with pytest.raises(InvalidArgument):
            SandboxSpec.parse(network={"max_mbps": bad})


def test_private_ranges_need_an_explicit_cidr():
    pol = NetworkPolicy(allow=["10.1.2.0/24", "0.0.0.0/0"])
    assert pol.names_special() == ["10.1.2.0/24"]
    c = policy.Compiled.of(pol)
    ip = ipaddress.ip_address
    assert c.decide(None, ip("10.1.2.3"), 22).allowed
    assert not c.decide(None, ip("10.1.3.3"), 22).allowed  # 0.0.0.0/0 unlocks no private
    assert not c.decide(None, ip("169.254.169.254"), 80).allowed
    assert c.decide(None, ip("8.8.8.8"), 53).allowed


def test_allow_wins_over_deny_and_deny_only_policies():
    ip = ipaddress.ip_address("93.184.216.34")
    c = policy.Compiled.of(NetworkPolicy(allow=["a.example.com"], deny=["*.example.com"]))
    assert c.name_allowed("a.example.com") and not c.name_allowed("b.example.com")
    assert c.decide("a.example.com", ip, 443).allowed
    assert not c.decide(None, ip, 443).allowed  # an allow list: the rest is refused
    deny_only = policy.Compiled.of(NetworkPolicy(deny=["*.example.com", "93.184.0.0/16"]))
    assert deny_only.name_allowed("other.org") and not deny_only.name_allowed("x.example.com")
    assert not deny_only.decide(None, ip, 443).allowed
    assert deny_only.decide(None, ipaddress.ip_address("1.1.1.1"), 443).allowed
    ports = policy.Compiled.of(NetworkPolicy(allow=["example.com:443"]))
    assert ports.decide("example.com", ip, 443).allowed
    assert not ports.decide("example.com", ip, 80).allowed


def test_pypi_preset_reads_the_hosts_pip(monkeypatch):
    policy.pip_index_hosts.cache_clear()
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.corral.test/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://extra.corral.test/simple file:///x")
    try:
        c = policy.Compiled.of(NetworkPolicy(allow=["pypi"]))
        assert c.name_allowed("mirror.corral.test") and c.name_allowed("extra.corral.test")
        assert not c.name_allowed("example.com")
    finally:
        policy.pip_index_hosts.cache_clear()


def _client_hello(name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_sni_and_host_are_read():
    hello = _client_hello("pypi.corral.test")
    assert sniff.requested_name(hello) == "pypi.corral.test"
    assert sniff.requested_name(hello[:20]) is sniff.MORE
    assert sniff.requested_name(b"GET / HTTP/1.1\r\nHost: a.test:8080\r\n\r\n") == "a.test"
    assert sniff.requested_name(b"GET / HTTP/1.1\r\nHost: a.test\r\n") is sniff.MORE
    two = b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n"
    assert sniff.requested_name(two) is None  # ambiguous: no name
    assert sniff.requested_name(b"SSH-2.0-x\r\n\r\n") is None
    assert sniff.requested_name(b"\x16\x03\x01\x01\x00" + b"\0" * 10) is sniff.MORE
    assert sniff.requested_name(b"\x16\x03\x01\xff\xff" + b"\0" * 10) is None  # > MAX_PEEK
    assert sniff.requested_name(b"\x16\x03\x01\x00\x04\x01\x00\x00\x00") is None  # truncated


def test_dns_wire():
    q = struct.pack("!6H", 7, 0x0100, 1, 0, 0, 0) + b"\x04good\x04test\x00" + struct.pack("!2H", 1, 1)
    parsed = dns.parse_query(q)
    assert parsed is not None and (parsed.name, parsed.qtype) == ("good.test", 1)
    ok = dns.answer(parsed, ["198.51.100.2"])
    assert struct.unpack("!6H", ok[:12])[3] == 1 and ok.endswith(bytes([198, 51, 100, 2]))
    nx = dns.answer(parsed, None)
    assert nx[3] & 0xF == dns.RCODE_NXDOMAIN
    for bad in (q[:11], q[:-3], q[:12] + b"\xc0\x0c" + q[-4:], q.replace(b"\x04good", b"\x50good")):
        assert dns.parse_query(bad) is None
    assert dns.parse_query(q[:2] + b"\x81\x00" + q[4:]) is None  # a response, not a query
    six = dns.parse_query(q[:-4] + struct.pack("!2H", dns.QTYPE_AAAA, 1))
    assert six is not None
    both = ["198.51.100.2", "2001:db8::2"]
    aaaa = dns.answer(six, both)  # AAAA records of the IPv6 addresses only
    assert struct.unpack("!6H", aaaa[:12])[3] == 1 and aaaa.endswith(bytes.fromhex("20010db8" + "00" * 11 + "02"))
    assert struct.unpack("!6H", dns.answer(parsed, both)[:12])[3] == 1  # A: the IPv4 one


def test_udp_allow_entries_never_overlap():
    """The kernel's UDP allow set is an interval set: its elements may not overlap."""
    import ipaddress

    from corral.network_schema import NetworkPolicy
    from corral.runtime.net.policy import Compiled

    rules = ["198.51.100.0/24:53", "198.51.100.7:53", "198.51.100.0/22:99", "198.51.100.7",
             "2001:db8::/32", "[2001:db8::1]:443", "example.com"]
    entries = Compiled.of(NetworkPolicy(allow=rules)).udp_entries()
    cells = [(ipaddress.ip_network(n), range(int(p.split("-")[0]), int(p.split("-")[-1]) + 1))
             for n, p in entries]
    for i, (net, ports) in enumerate(cells):
        for other, other_ports in cells[i + 1:]:
            assert not (net.version == other.version and net.overlaps(other)
                        and set(ports) & set(other_ports)), (net, other)
    covered = Compiled.of(NetworkPolicy(allow=rules))
    for ip, port, ok in (("198.51.100.7", 1234, True), ("198.51.100.8", 53, True),
                         ("198.51.100.8", 54, False), ("198.51.101.1", 99, True),
                         ("2001:db8::5", 7, True), ("192.0.2.1", 53, False)):
        assert covered.decide_udp(ipaddress.ip_address(ip), port).allowed is ok, (ip, port)
        assert any(ipaddress.ip_address(ip) in n and port in p for n, p in cells) is ok
    # what the relay would refuse anyway stays out of the kernel's set (refused at once)
    wide = Compiled.of(NetworkPolicy(allow=["0.0.0.0/0", "::/0"])).udp_entries()
    for ip in ("10.1.2.3", "127.0.0.1", "169.254.169.254", "10.219.0.1", "fd00::1", "fe80::1"):
        assert not any(ipaddress.ip_address(ip) in ipaddress.ip_network(n) for n, _ in wide), ip
    assert any(ipaddress.ip_address("198.51.100.7") in ipaddress.ip_network(n) for n, _ in wide)


async def test_one_sources_dns_flood_leaves_others_answered():
    """Queries in flight are capped per source: a sandbox flooding the resolver gets its
    excess dropped, another sandbox is still answered."""
    import asyncio
    import socket

    stuck = asyncio.Event()

    async def lookup(src: str, q: dns.Query) -> list[str] | None:
        if src == "127.0.0.1":
            await stuck.wait()  # the flooder's queries never finish
        return ["192.0.2.1"]

    resolver = dns.Resolver(lookup)
    await resolver.start()
    loop = asyncio.get_running_loop()
    q = struct.pack("!6H", 7, 0x0100, 1, 0, 0, 0) + b"\x01a\x00" + struct.pack("!2H", 1, 1)
    flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    other.bind(("127.0.0.2", 0))
    other.setblocking(False)
    try:
        for _ in range(dns.MAX_IN_FLIGHT * 4):
            flood.sendto(q, ("127.0.0.1", resolver.port))
        for _ in range(3000):  # until the resolver has taken in the flood
            await asyncio.sleep(0.01)
            if resolver._udp is not None and resolver._udp.get_protocol().per_src.get(
                    "127.0.0.1") == dns.MAX_IN_FLIGHT:
                break
        assert resolver._udp.get_protocol().per_src["127.0.0.1"] == dns.MAX_IN_FLIGHT
        other.sendto(q, ("127.0.0.1", resolver.port))
        reply = await asyncio.wait_for(loop.sock_recv(other, 512), 30)
        assert struct.unpack("!6H", reply[:12])[3] == 1  # answered
    finally:
        stuck.set()
        flood.close()
        other.close()
        resolver.close()


def test_doctor_warns_without_nft(monkeypatch):
    """``corral doctor`` says when policy sandboxes could not start (no nft), as a warning:
    the other network modes still work."""
    import shutil

    from corral.runtime import doctor

    real = shutil.which
    monkeypatch.setattr(doctor.shutil, "which", lambda t: None if t == "nft" else real(t))
    check = doctor.nftables()
    assert check.status == doctor.WARN and "nft" in check.detail and "nftables" in check.fix
