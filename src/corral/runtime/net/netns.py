"""Network namespaces of policy sandboxes, linked to the host by a veth pair, and the
nftables table that sends everything they send to corral's resolver and proxy.

One sandbox, one *link* (an index machine-wide, flock'd like uids)::

    sandbox netns "corral-N"            host
      eth0 10.219.x.(4N+2)/30  ──veth──  crvN 10.219.x.(4N+1)/30
           fd63:6f72:7261:1::(4N+2)/126       fd63:6f72:7261:1::(4N+1)/126
      default routes via the host end

The namespace belongs to the host's user namespace (``ip netns add``, as root): the
sandbox, root in its own user namespace or not, cannot change its addresses, routes
or rules. The launcher joins it before it becomes bwrap (``agent/launch.c --netns``).

The host's table (one per engine, ``inet corral_<engine key>``), for packets coming
in on the engine's links (the set ``@links``): TCP and UDP to port 53 go to the
resolver (:mod:`.dns`), every other TCP connection to the proxy (:mod:`.proxy`, which
reads its original destination), IPv4 and IPv6 alike. UDP to a destination in the
link's allow set (``@udp4`` / ``@udp6``: the policy's CIDR rules, filled by the
daemon) goes to the UDP relay (:mod:`.udp`, by TPROXY: the relay reads the original
destination, judges it again and relays from the host); other UDP is recorded in
``@refused4`` / ``@refused6`` (link, address, port: what :meth:`refused` reads back
for ``network_events``) and sent to a closed port (refused at once: ICMP port
unreachable). Other protocols are dropped and recorded (``@refused_proto``), but
neighbour discovery (IPv6 needs it on the link); nothing is forwarded. A packet whose
source the host would not route back through the link it came in on (strict reverse
path: ``fib saddr . iif``) is dropped first: a sandbox may bind another
sandbox's IPv6 address with ``IPV6_FREEBIND`` (no capability needed) and would be
judged, counted and answered as that sandbox by the resolver, the proxy and the relay. A packet that claims a link's address but did not come in on a
link (of any engine: ``crv*``) is dropped (a host process could bind one with
IP_FREEBIND and pose as a sandbox to the resolver or the proxy, which know sandboxes by
address). No rule names the resolver's and proxy's ports outside the links, and none
names one engine's links against another's, so a table a killed daemon left behind, or
another daemon's, blocks nothing. A sandbox reaches no address directly, not even the host's.

``CORRAL_NET_SUBNET`` (default ``10.219.0.0/16``) and ``CORRAL_NET_SUBNET6`` (default
``fd63:6f72:7261:1::/64``, a ULA prefix): where links take their addresses.

Why TPROXY for UDP, not forwarding: a routed UDP flow needs the host to forward (the
global ``ip_forward``, for the replies on the outside interface too) and would take
the sandbox's packets out unread; TPROXY hands them to the relay with their original
destination, needs only a policy route for its mark (:func:`ensure_tproxy_route`,
which touches no unmarked packet), and nothing leaves but what the relay sends. That
route (an ``ip rule`` and table :data:`TPROXY_TABLE`) is the host's, shared by every
engine: the engine whose table is the last ``inet corral_*`` one removes it with its
table (:func:`drop_table`), under a host-wide lock that :func:`create_table` takes too.
A table a killed daemon left counts as an engine's: the route stays until that state
directory's next engine replaces it and stops (a route that matches only marked
packets blocks nothing; a missing one would cut a running engine's UDP).
Why sets for refusals, not NFLOG: the kernel refuses at once (ICMP), and the daemon
reads the set only when asked for events: no per-packet netlink stream to parse and
keep up with under a flood (a set is bounded; one entry per link, address and port).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.errors import CapacityExceeded, SandboxStartError, Unsupported
from corral.runtime.fsutil import _flock, try_lock

SUBNET_ENV = "CORRAL_NET_SUBNET"
DEFAULT_SUBNET = "10.219.0.0/16"
SUBNET6_ENV = "CORRAL_NET_SUBNET6"
DEFAULT_SUBNET6 = "fd63:6f72:7261:1::/64"
# the packet mark and routing table of TPROXY'd UDP (a policy route delivers the
# marked packets to the relay's socket instead of forwarding them)
TPROXY_MARK = 0x636F
TPROXY_TABLE = 25455
REFUSED_TIMEOUT_S = 3600  # a refusal stays in its set this long (then a new one is recorded)
REFUSED_TIMEOUT = f"{REFUSED_TIMEOUT_S}s"
REFUSED_SIZE = 65536
NETNS_DIR = Path("/run/netns")
TABLE_PREFIX = "corral_"  # every engine's host table: inet corral_<engine key>
ROUTE_LOCK = "tproxy.lock"  # in the links' lock directory: the TPROXY route's changes
# the host ends of every engine's links: the anti-spoofing rule admits a link address
# from any of them (another daemon's sandboxes are not spoofers; a table that counted
# only its own engine's links dropped every other engine's sandbox traffic, and a
# killed daemon's leftover table every sandbox's on the host)
LINK_PREFIX = "crv"
REFUSED_UDP_PORT = 9  # "discard": nothing listens, the input chain refuses it


def subnet() -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(os.environ.get(SUBNET_ENV, DEFAULT_SUBNET))


def subnet6() -> ipaddress.IPv6Network:
    return ipaddress.IPv6Network(os.environ.get(SUBNET6_ENV, DEFAULT_SUBNET6))


def ipv6_on() -> bool:
    """Whether the host has IPv6 (links get IPv6 addresses only then)."""
    try:
        return Path("/proc/sys/net/ipv6/conf/all/disable_ipv6").read_text().strip() == "0"
    except OSError:
        return False


def _run(argv: list[str], stdin: str | None = None) -> None:
    try:
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30,
                           check=False)
    except FileNotFoundError:
        raise Unsupported(f"{argv[0]} is not installed: apt-get install iproute2 nftables "
                          "(scripts/install.sh does this)") from None
    if r.returncode != 0:
        raise SandboxStartError(f"{' '.join(argv[:3])} failed: {r.stderr.strip()[:500]}")


@dataclass
class Link:
    """One sandbox's network namespace and veth pair."""

    index: int
    lock_fd: int

    @property
    def netns(self) -> str:
        return f"corral-{self.index}"

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def host_if(self) -> str:
        return f"{LINK_PREFIX}{self.index}"

    @property
    def host_ip(self) -> str:
        return str(subnet().network_address + 4 * self.index + 1)

    @property
    def sandbox_ip(self) -> str:
        return str(subnet().network_address + 4 * self.index + 2)

    @property
    def host_ip6(self) -> str:
        return str(subnet6().network_address + 4 * self.index + 1)

    @property
    def sandbox_ip6(self) -> str:
        return str(subnet6().network_address + 4 * self.index + 2)


class Links:
    """Allocates link indexes machine-wide (``<run dir>/net/N.lock``, flock'd)."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self.size = min(subnet().num_addresses, subnet6().num_addresses) // 4

    def acquire(self) -> Link:
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        for index in random.sample(range(self.size), min(self.size, 64)):
            if (fd := try_lock(self.lock_dir / f"{index}.lock")) is not None:
                return Link(index, fd)
        raise CapacityExceeded(f"no free network link in {subnet()}: too many sandboxes "
                               f"with a network policy on this host (set {SUBNET_ENV})")

    @staticmethod
    def release(link: Link) -> None:
        os.close(link.lock_fd)

    def sweep(self) -> list[str]:
        """Remove the namespaces (and veths) of links whose owner is gone (a killed
        daemon): those whose lock nobody holds. The names removed."""
        gone = []
        for path in sorted(NETNS_DIR.glob("corral-*")) if NETNS_DIR.is_dir() else []:
            index = path.name.removeprefix("corral-")
            if not index.isdigit() or int(index) >= self.size:
                continue
            fd = try_lock(self.lock_dir / f"{index}.lock") if self.lock_dir.is_dir() else None
            if fd is None:
                continue
            link = Link(int(index), fd)
            try:
                teardown(link, "", quiet=True)
                gone.append(path.name)
            finally:
                self.release(link)
        return gone


def setup(link: Link, table: str) -> None:
    """Make the namespace, the veth pair and their addresses; add the host end to
    ``table``'s links. Leftovers of a crashed owner of the same index go first."""
    teardown(link, table, quiet=True)
    six = ipv6_on()
    host = (f"netns add {link.netns}\n"
            f"link add {link.host_if} type veth peer name eth0 netns {link.netns}\n"
            f"addr add {link.host_ip}/30 dev {link.host_if}\n")
    if six:  # nodad: usable at once (the link has two ends, both ours)
        host += f"addr add {link.host_ip6}/126 dev {link.host_if} nodad\n"
    _run(["ip", "-batch", "-"], host + f"link set {link.host_if} up\n")
    inside = ("link set lo up\n"
              f"addr add {link.sandbox_ip}/30 dev eth0\n"
              + (f"addr add {link.sandbox_ip6}/126 dev eth0 nodad\n" if six else "")
              + "link set eth0 up\n"
              f"route add default via {link.host_ip}\n"
              + (f"route add default via {link.host_ip6}\n" if six else ""))
    _run(["ip", "-n", link.netns, "-batch", "-"], inside)
    _run(["nft", "add", "element", "inet", table, "links", "{", link.host_if, "}"])


def teardown(link: Link, table: str, *, quiet: bool = False) -> None:
    """Remove the namespace (its end of the veth goes with it, and so the host's)."""
    for argv in (["nft", "delete", "element", "inet", table, "links", "{", link.host_if, "}"],
                 ["ip", "link", "del", link.host_if], ["ip", "netns", "del", link.netns]):
        if argv[0] == "nft" and quiet:
            continue
        if argv[1] == "link" and not Path(f"/sys/class/net/{link.host_if}").exists():
            continue
        if argv[1] == "netns" and not link.netns_path.exists():
            continue
        try:
            _run(argv)
        except SandboxStartError:
            if not quiet:
                raise


def shape(link: Link, mbps: int | None) -> None:
    """Cap the link at ``mbps`` each way (a token bucket on both ends of the veth: the
    host's end shapes what the sandbox receives, the sandbox's end what it sends, out of
    its reach); None removes the cap."""
    shape_ends(((None, link.host_if), (link.netns, "eth0")), mbps)


def shape_ends(ends: Iterable[tuple[str | None, str]], mbps: int | None) -> None:
    """Cap each ``(netns or None for the host's, device)`` at ``mbps`` as it sends
    (a token bucket, tbf); None removes the cap."""
    for ns, dev in ends:
        tc = ["tc"] if ns is None else ["tc", "-n", ns]
        if mbps is None:
            subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True,
                           check=False)
            continue
        burst = max(32 * 1024, mbps * 1_000_000 // 8 // 100)  # >= 10 ms at that rate
        _run([*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbps}mbit",
              "burst", str(burst), "latency", "100ms"])


def table_script(table: str, *, proxy_port: int, dns_port: int, udp_port: int) -> str:
    """The engine's nftables table (see the module's docstring)."""
    nd = "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert }"
    # the kernel's own chatter on a new link (router solicitations, multicast listener
    # reports): dropped unrecorded, no attempt of the sandbox's code
    chatter = ("icmpv6 type { nd-router-solicit, mld-listener-report, mld2-listener-report, "
               "mld-listener-done }")
    refused = (f"flags dynamic,timeout; timeout {REFUSED_TIMEOUT}; size {REFUSED_SIZE};")
    return f"""table inet {table} {{
  set links {{ type ifname; }}
  set udp4 {{ type ifname . ipv4_addr . inet_service; flags interval; }}
  set udp6 {{ type ifname . ipv6_addr . inet_service; flags interval; }}
  set refused4 {{ type ifname . ipv4_addr . inet_service; {refused} }}
  set refused6 {{ type ifname . ipv6_addr . inet_service; {refused} }}
  set refused_proto {{ type ifname . inet_proto; {refused} }}
  chain pre {{ type filter hook prerouting priority mangle; policy accept;
    iifname @links {nd} accept
    iifname @links {chatter} drop
    iifname @links fib saddr . iif oif missing drop
    iifname @links meta l4proto != {{ tcp, udp }} update @refused_proto {{ iifname . meta l4proto }} drop
    iifname @links udp dport 53 accept
    iifname @links iifname . ip daddr . udp dport @udp4 tproxy ip to :{udp_port} meta mark set {TPROXY_MARK} accept
    iifname @links iifname . ip6 daddr . udp dport @udp6 tproxy ip6 to :{udp_port} meta mark set {TPROXY_MARK} accept
    iifname @links meta l4proto udp meta nfproto ipv4 update @refused4 {{ iifname . ip daddr . udp dport }}
    iifname @links meta l4proto udp meta nfproto ipv6 update @refused6 {{ iifname . ip6 daddr . udp dport }}
  }}
  chain nat {{ type nat hook prerouting priority dstnat; policy accept;
    iifname @links meta mark {TPROXY_MARK} accept
    iifname @links meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns_port}
    iifname @links meta l4proto tcp redirect to :{proxy_port}
    iifname @links meta l4proto udp redirect to :{REFUSED_UDP_PORT}
  }}
  chain input {{ type filter hook input priority filter; policy accept;
    iifname @links {nd} accept
    iifname @links meta mark {TPROXY_MARK} meta l4proto udp accept
    iifname @links tcp dport {{ {dns_port}, {proxy_port} }} accept
    iifname @links udp dport {dns_port} accept
    iifname @links meta l4proto tcp reject with tcp reset
    iifname @links reject
    ip saddr {subnet()} iifname != "{LINK_PREFIX}*" drop
    ip6 saddr {subnet6()} iifname != "{LINK_PREFIX}*" drop
  }}
  chain forward {{ type filter hook forward priority filter; policy accept;
    iifname @links drop
    oifname @links drop
  }}
}}
"""


def create_table(table: str, *, proxy_port: int, dns_port: int, udp_port: int,
                 links: Sequence[str] = (), lock_dir: Path | None = None) -> None:
    """The engine's table, made new in one transaction with ``links`` (the host ends of
    links handed over by the engine before: live restore) in its set. One transaction:
    a table left by the previous engine is replaced with no moment without one, when
    its links' traffic would meet no rule. With ``lock_dir`` (the links' lock
    directory), under the lock :func:`drop_table` takes: no engine stopping meanwhile
    removes the TPROXY route this one is about to need."""
    script = table_script(table, proxy_port=proxy_port, dns_port=dns_port, udp_port=udp_port)
    if links:
        script += f"add element inet {table} links {{ {', '.join(links)} }}\n"
    with _route_lock(lock_dir):
        ensure_tproxy_route()
        _run(["nft", "-f", "-"],
             f"table inet {table} {{}}\ndelete table inet {table}\n" + script)


def drop_table(table: str, lock_dir: Path) -> bool:
    """Delete the engine's table and, when no other engine's is left on the host, the
    TPROXY route; whether the route went."""
    with _route_lock(lock_dir):
        delete_table(table)
        if engine_tables():
            return False
        remove_tproxy_route()
        return True


@contextlib.contextmanager
def _route_lock(lock_dir: Path | None) -> Iterator[None]:
    if lock_dir is None:
        yield
        return
    lock_dir.mkdir(parents=True, exist_ok=True)
    with _flock(lock_dir / ROUTE_LOCK):
        yield


def engine_tables() -> list[str]:
    """The names of the engines' tables on the host (``inet corral_*``)."""
    out = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True,
                         check=False).stdout
    return [line.split()[2] for line in out.splitlines()
            if line.startswith(f"table inet {TABLE_PREFIX}")]


def remove_tproxy_route() -> None:
    """Remove :func:`ensure_tproxy_route`'s rules and routes (both families)."""
    for fam in ("-4", "-6"):
        for _ in range(8):  # one rule each, unless made twice by a race of old engines
            if subprocess.run(["ip", fam, "rule", "del", "fwmark", str(TPROXY_MARK), "lookup",
                               str(TPROXY_TABLE)], capture_output=True, check=False).returncode:
                break
        subprocess.run(["ip", fam, "route", "flush", "table", str(TPROXY_TABLE)],
                       capture_output=True, check=False)


def add_link(table: str, link: Link) -> None:
    """Put a link handed over by the previous engine in ``table``'s set again."""
    _run(["nft", "add", "element", "inet", table, "links", "{", link.host_if, "}"])


def link_of_lock(fd: int, lock_dir: Path) -> Link | None:
    """The link whose lock (``<lock_dir>/N.lock``, held) ``fd`` is, or None."""
    try:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
    index = path.name.removesuffix(".lock")
    if path.parent != lock_dir or not path.name.endswith(".lock") or not index.isdigit():
        return None
    return Link(int(index), fd)


def ensure_tproxy_route() -> None:
    """The policy route of TPROXY'd packets (shared by every engine; it matches only
    packets carrying :data:`TPROXY_MARK`): deliver them locally."""
    for fam, default in (("-4", "0.0.0.0/0"), ("-6", "::/0")):
        if fam == "-6" and not ipv6_on():
            continue
        rules = subprocess.run(["ip", fam, "rule", "show", "table", str(TPROXY_TABLE)],
                               capture_output=True, text=True, check=False).stdout
        if "fwmark" not in rules:
            _run(["ip", fam, "rule", "add", "fwmark", str(TPROXY_MARK), "lookup",
                  str(TPROXY_TABLE)])
        _run(["ip", fam, "route", "replace", "local", default, "dev", "lo", "table",
              str(TPROXY_TABLE)])


def _elements(rows: list[tuple[str, str, str]], table: str, op: str) -> None:
    """One statement per set (one element per statement is far slower to delete)."""
    by_set: dict[str, list[str]] = {}
    for name, ifname, net_ports in rows:
        net, ports = net_ports.split(" ", 1)
        by_set.setdefault(name, []).append(f'"{ifname}" . {net} . {ports}')
    script = "".join(f"{op} element inet {table} {name} {{ {', '.join(elems)} }}\n"
                     for name, elems in by_set.items())
    if script:
        _run(["nft", "-f", "-"], script)


def set_udp(link: Link, table: str, old: list[tuple[str, str]],
            new: list[tuple[str, str]]) -> None:
    """Replace the link's UDP allow entries ``old`` by ``new``: (CIDR, port range)."""
    def rows(entries: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
        return [("udp6" if ":" in net else "udp4", link.host_if, f"{net} {ports}")
                for net, ports in entries]
    _elements(rows([e for e in old if e not in new]), table, "delete")
    _elements(rows([e for e in new if e not in old]), table, "add")


def refused(table: str, host_if: str) -> list[dict[str, object]]:
    """What the kernel refused for the link ``host_if`` (UDP by address and port, other
    protocols by name), each with the time of its latest attempt (each packet refreshes
    its entry: a link's next sandbox, counting from its start, sees only its own)."""
    out: list[dict[str, object]] = []
    now = time.time()
    for name in ("refused4", "refused6", "refused_proto"):
        r = subprocess.run(["nft", "-j", "list", "set", "inet", table, name],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            continue
        for item in json.loads(r.stdout).get("nftables", []):
            for elem in item.get("set", {}).get("elem", []):
                val = elem.get("elem", {})
                key = val.get("val", elem) if isinstance(val, dict) else elem
                parts = key.get("concat", []) if isinstance(key, dict) else []
                if not parts or parts[0] != host_if:
                    continue
                left = val.get("expires", 0) if isinstance(val, dict) else 0
                age = REFUSED_TIMEOUT_S - left if left else 0
                ev: dict[str, object] = {"time": now - age}
                if name == "refused_proto":
                    ev.update(kind="other", protocol=parts[1])
                else:
                    ev.update(kind="udp", ip=parts[1], port=parts[2])
                out.append(ev)
    return out


def delete_table(table: str) -> None:
    subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, check=False)
