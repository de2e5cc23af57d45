"""Network namespaces of policy sandboxes, linked to the host by a veth pair, and the
nftables table that sends everything they send to corral's resolver and proxy.

One sandbox, one *link* (an index machine-wide, flock'd like uids)::

    sandbox netns "corral-N"            host
      eth0 10.219.x.(4N+2)/30  ──veth──  crvN 10.219.x.(4N+1)/30
      default route via the host end

The namespace belongs to the host's user namespace (``ip netns add``, as root): the
sandbox, root in its own user namespace or not, cannot change its addresses, routes
or rules. The launcher joins it before it becomes bwrap (``agent/launch.c --netns``).

The host's table (one per engine, ``inet corral_<engine key>``), for packets coming
in on the engine's links (the set ``@links``): TCP and UDP to port 53 go to the
resolver (:mod:`.dns`), every other TCP connection to the proxy (:mod:`.proxy`, which
reads its original destination), other UDP to a closed port (refused at once: ICMP
port unreachable); IPv6 and other protocols are dropped (the host ends have no IPv6);
nothing is forwarded. A packet that claims a link's address but did not come in on a
link (of any engine: ``crv*``) is dropped (a host process could bind one with
IP_FREEBIND and pose as a sandbox to the resolver or the proxy, which know sandboxes by
address). No rule names the resolver's and proxy's ports outside the links, and none
names one engine's links against another's, so a table a killed daemon left behind, or
another daemon's, blocks nothing. A sandbox reaches no address directly, not even the host's.

``CORRAL_NET_SUBNET`` (default ``10.219.0.0/16``): where links take their addresses.
"""

from __future__ import annotations

import ipaddress
import os
import random
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.errors import CapacityExceeded, SandboxStartError, Unsupported
from corral.runtime.fsutil import try_lock

SUBNET_ENV = "CORRAL_NET_SUBNET"
DEFAULT_SUBNET = "10.219.0.0/16"
NETNS_DIR = Path("/run/netns")
# the host ends of every engine's links: the anti-spoofing rule admits a link address
# from any of them (another daemon's sandboxes are not spoofers; a table that counted
# only its own engine's links dropped every other engine's sandbox traffic, and a
# killed daemon's leftover table every sandbox's on the host)
LINK_PREFIX = "crv"
REFUSED_UDP_PORT = 9  # "discard": nothing listens, the input chain refuses it


def subnet() -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(os.environ.get(SUBNET_ENV, DEFAULT_SUBNET))


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


class Links:
    """Allocates link indexes machine-wide (``<run dir>/net/N.lock``, flock'd)."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self.size = subnet().num_addresses // 4

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
    host = (f"netns add {link.netns}\n"
            f"link add {link.host_if} type veth peer name eth0 netns {link.netns}\n"
            f"addr add {link.host_ip}/30 dev {link.host_if}\n")
    _run(["ip", "-batch", "-"], host + f"link set {link.host_if} up\n")
    # No IPv6 on the host end: the sandbox's link-local address has nobody to talk to.
    Path(f"/proc/sys/net/ipv6/conf/{link.host_if}/disable_ipv6").write_text("1")
    inside = ("link set lo up\n"
              f"addr add {link.sandbox_ip}/30 dev eth0\n"
              "link set eth0 up\n"
              f"route add default via {link.host_ip}\n")
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
    ends = ((["tc"], link.host_if), (["tc", "-n", link.netns], "eth0"))
    for tc, dev in ends:
        if mbps is None:
            subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True,
                           check=False)
            continue
        burst = max(32 * 1024, mbps * 1_000_000 // 8 // 100)  # >= 10 ms at that rate
        _run([*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbps}mbit",
              "burst", str(burst), "latency", "100ms"])


def table_script(table: str, *, proxy_port: int, dns_port: int) -> str:
    """The engine's nftables table (see the module's docstring)."""
    return f"""table inet {table} {{
  set links {{ type ifname; }}
  chain pre {{ type filter hook prerouting priority raw; policy accept;
    iifname @links meta nfproto ipv6 drop
    iifname @links meta l4proto != {{ tcp, udp }} drop
  }}
  chain nat {{ type nat hook prerouting priority dstnat; policy accept;
    iifname @links meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns_port}
    iifname @links meta l4proto tcp redirect to :{proxy_port}
    iifname @links meta l4proto udp redirect to :{REFUSED_UDP_PORT}
  }}
  chain input {{ type filter hook input priority filter; policy accept;
    iifname @links tcp dport {{ {dns_port}, {proxy_port} }} accept
    iifname @links udp dport {dns_port} accept
    iifname @links meta l4proto tcp reject with tcp reset
    iifname @links reject
    ip saddr {subnet()} iifname != "{LINK_PREFIX}*" drop
  }}
  chain forward {{ type filter hook forward priority filter; policy accept;
    iifname @links drop
    oifname @links drop
  }}
}}
"""


def create_table(table: str, *, proxy_port: int, dns_port: int,
                 links: Sequence[str] = ()) -> None:
    """The engine's table, made new in one transaction with ``links`` (the host ends of
    links handed over by the engine before: live restore) in its set. One transaction:
    a table left by the previous engine is replaced with no moment without one, when
    its links' traffic would meet no rule."""
    script = table_script(table, proxy_port=proxy_port, dns_port=dns_port)
    if links:
        script += f"add element inet {table} links {{ {', '.join(links)} }}\n"
    _run(["nft", "-f", "-"], f"table inet {table} {{}}\ndelete table inet {table}\n" + script)


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


def delete_table(table: str) -> None:
    subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, check=False)
