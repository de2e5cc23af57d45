"""Private networks: the policy sandboxes that joined one named network reach each other
directly, on a bridge of their own, and nothing else through it.

One private network (a tenant's named network made with ``private=True``) is a
network namespace of its own holding a bridge; each member gets a second veth pair,
``eth1`` in its namespace, the other end a port of that bridge::

    member netns corral-N                 private netns corral-<engine>-pn-<hash>
      eth0  (the policy link, netns.py)     br0 (no address: nothing here answers)
      eth1  10.220.G.B/24 ──veth──────────  pB  ── br0 ── pC ──veth── eth1 of another member

The bridge's namespace has no address, no route and no link to the host: frames go
from member to member and nowhere else, so another network's sandboxes, another
tenant's, and the host itself cannot reach a member through it, and a member reaches
the rest of the world only through ``eth0`` (its policy; the private subnet is never
dialled by the proxy). Members find each other by name through corral's resolver
(their id, and their alias).

A sandbox cannot change its addresses (its namespace is the host user namespace's: no
CAP_NET_ADMIN, no raw sockets), and, should one ever gain that, the bridge's
``bridge guard`` table admits on each port only frames from that member's MAC with its
own IPv4 address (ARP included: the sender's MAC and address in the ARP body too);
nothing else (no IPv6: members have none there, no other ether type) crosses the bridge.

A member's ``max_mbps`` caps its traffic with the other members too: a token bucket on
its ``eth1`` (what it sends) and on its bridge port (what it receives), both set from
outside its namespace.

``CORRAL_NET_PRIVATE`` (default ``10.220.0.0/16``): the members' addresses, a /24 per
private network (256 networks per engine, 254 members each; a tenant's sandboxes are on
at most half of them at once, so one tenant cannot take them all): an address of another
network goes out through ``eth0``, where the proxy refuses it at once. A member's MAC is
derived from its address (``02:63:`` and the four bytes).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import subprocess
import threading
from dataclasses import dataclass, field

from corral.errors import CapacityExceeded, InvalidState
from corral.runtime.net.netns import NETNS_DIR, Link, _run, shape_ends

PRIVATE_ENV = "CORRAL_NET_PRIVATE"
DEFAULT_PRIVATE = "10.220.0.0/16"
GROUP_PREFIX = 24  # a private network's share of the range
BRIDGE = "br0"
MEMBER_IF = "eth1"


def private_subnet() -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(os.environ.get(PRIVATE_ENV, DEFAULT_PRIVATE))


def mac_of(ip: str) -> str:
    return "02:63:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(ip).packed)


GUARD = """table bridge guard {
  set members { type ifname . ether_addr . ipv4_addr; }
  chain pre { type filter hook prerouting priority filter; policy drop;
    ether type arp iifname . ether saddr . arp saddr ip @members iifname . arp saddr ether . arp saddr ip @members accept
    ether type ip iifname . ether saddr . ip saddr @members accept
  }
}
"""


@dataclass
class Member:
    sandbox_id: str
    ip: str
    alias: str | None

    @property
    def port(self) -> str:  # the bridge's end of its veth (unique in the group)
        return f"p{ipaddress.IPv4Address(self.ip).packed[3]}"


@dataclass
class Group:
    """One private network: its bridge's namespace and its members."""

    netns: str
    subnet: ipaddress.IPv4Network
    members: dict[str, Member] = field(default_factory=dict)

    def find(self, name: str) -> Member | None:
        for m in self.members.values():
            if name in (m.sandbox_id, m.alias):
                return m
        return None

    def free_ip(self) -> str:
        taken = {m.ip for m in self.members.values()}
        for ip in self.subnet.hosts():
            if str(ip) not in taken:
                return str(ip)
        raise CapacityExceeded(f"the private network has {len(taken)} sandboxes, the most "
                               "one has: make another network for more")


def _nft_in(netns: str, script: str) -> None:
    _run(["ip", "netns", "exec", netns, "nft", "-f", "-"], script)


class PrivateNets:
    """The private networks of one engine (``table``: its name prefixes theirs).

    Places are taken in memory (:meth:`reserve`); the kernel's part (``ip``, ``nft``:
    blocking, call it from threads) is ordered by one lock, so a network's last member
    leaving never races its next one joining."""

    def __init__(self, table: str) -> None:
        self.prefix = table.replace("_", "-") + "-pn-"
        self.groups: dict[tuple[str | None, str], Group] = {}
        self.of: dict[str, tuple[str | None, str]] = {}  # sandbox id -> its group's key
        self._lock = threading.Lock()  # the records
        self._kernel = threading.Lock()  # namespaces, links, the guard's elements

    def _netns(self, owner: str | None, name: str) -> str:
        digest = hashlib.sha256(f"{owner or ''}\0{name}".encode()).hexdigest()[:16]
        return self.prefix + digest

    def members(self, owner: str | None, name: str) -> list[str]:
        group = self.groups.get((owner, name))
        return sorted(group.members) if group else []

    def member(self, sandbox_id: str) -> tuple[Group, Member] | None:
        key = self.of.get(sandbox_id)
        group = self.groups.get(key) if key else None
        return (group, group.members[sandbox_id]) if group else None

    def holder(self, owner: str | None, name: str, alias: str) -> str | None:
        """The sandbox holding ``alias`` on ``owner``'s network ``name``, or None."""
        group = self.groups.get((owner, name))
        found = group.find(alias) if group else None
        return found.sandbox_id if found else None

    def lookup(self, sandbox_id: str, name: str) -> str | None:
        """The address of ``name`` (a member's id or alias) on ``sandbox_id``'s private
        network, or None."""
        found = self.member(sandbox_id)
        other = found[0].find(name) if found else None
        return other.ip if other else None

    def reserve(self, owner: str | None, name: str, sandbox_id: str, alias: str | None
                ) -> tuple[Group, Member]:
        """A place on the network (an address; the alias checked): at once, in memory.
        :meth:`plug` then links the sandbox's namespace to the bridge."""
        with self._lock:
            group = self.groups.get((owner, name))
            if group is not None and alias is not None and group.find(alias) is not None:
                raise InvalidState(f"alias {alias!r} is taken on network {name!r}: pick "
                                   "another", details={"network": name, "alias": alias})
            if group is None:
                group = Group(self._netns(owner, name), self._free_subnet(owner))
                self.groups[(owner, name)] = group
            member = Member(sandbox_id, group.free_ip(), alias)
            group.members[sandbox_id] = member
            self.of[sandbox_id] = (owner, name)
            return group, member

    def plug(self, group: Group, member: Member, link: Link, mbps: int | None = None) -> None:
        """Put ``link``'s namespace on the bridge (made at the first member), its traffic
        there capped at ``mbps`` each way like its policy link's; blocking."""
        with self._kernel:
            if not (NETNS_DIR / group.netns).exists():
                self._make(group.netns)
            self._plug(group.netns, member, link)
            if mbps is not None:
                shape_ends(self._ends(group, member, link), mbps)

    def shape(self, sandbox_id: str, link: Link, mbps: int | None) -> None:
        """Cap (None: uncap) a member's traffic with the other members at ``mbps`` each
        way: a token bucket on its ``eth1`` (what it sends) and on its bridge port (what
        it receives), both out of its reach; blocking. Not a member: nothing."""
        found = self.member(sandbox_id)
        if found is not None:
            shape_ends(self._ends(*found, link), mbps)

    @staticmethod
    def _ends(group: Group, member: Member, link: Link) -> tuple[tuple[str, str], ...]:
        return ((link.netns, MEMBER_IF), (group.netns, member.port))

    def adopt(self, owner: str | None, name: str, sandbox_id: str, alias: str | None,
              link: Link) -> None:
        """A member handed over by the previous engine (live restore): its veth and the
        bridge stay; its address is read back from its namespace."""
        r = subprocess.run(["ip", "-n", link.netns, "-j", "-4", "addr", "show", "dev",
                            MEMBER_IF], capture_output=True, text=True, check=False)
        addrs = [a["local"] for i in (json.loads(r.stdout or "[]") or [])
                 for a in i.get("addr_info", [])] if r.returncode == 0 else []
        if not addrs:
            return
        subnet = ipaddress.IPv4Network(f"{addrs[0]}/{GROUP_PREFIX}", strict=False)
        with self._lock:
            group = self.groups.setdefault((owner, name),
                                           Group(self._netns(owner, name), subnet))
            group.members[sandbox_id] = Member(sandbox_id, addrs[0], alias)
            self.of[sandbox_id] = (owner, name)

    def leave(self, sandbox_id: str) -> None:
        """Take it off its network (the bridge goes with the last member); blocking."""
        with self._lock:
            key = self.of.pop(sandbox_id, None)
            group = self.groups.get(key) if key else None
            if group is None or key is None:
                return
            member = group.members.pop(sandbox_id, None)
            if not group.members:
                del self.groups[key]
        with self._kernel:
            with self._lock:
                again = self.groups.get(key)  # a member joined meanwhile: it keeps the bridge
            if again is None:
                subprocess.run(["ip", "netns", "del", group.netns], capture_output=True,
                               check=False)
            elif member is not None:
                subprocess.run(["ip", "netns", "exec", group.netns, "nft", "delete",
                                "element", "bridge", "guard", "members", "{",
                                self._element(member), "}"], capture_output=True, check=False)
                subprocess.run(["ip", "-n", group.netns, "link", "del", member.port],
                               capture_output=True, check=False)

    def sweep(self) -> list[str]:
        """Remove this engine's private namespaces that no known group holds (a killed
        daemon's). The names removed."""
        known = {g.netns for g in self.groups.values()}
        gone = []
        for path in sorted(NETNS_DIR.glob(self.prefix + "*")) if NETNS_DIR.is_dir() else []:
            if path.name not in known:
                subprocess.run(["ip", "netns", "del", path.name], capture_output=True,
                               check=False)
                gone.append(path.name)
        return gone

    def _free_subnet(self, owner: str | None) -> ipaddress.IPv4Network:
        taken = {g.subnet for g in self.groups.values()}
        total = 1 << max(0, GROUP_PREFIX - private_subnet().prefixlen)
        mine = sum(1 for (who, _) in self.groups if who == owner)
        if owner is not None and mine >= max(1, total // 2):
            raise CapacityExceeded(
                f"tenant {owner!r} has sandboxes on {mine} private networks, half of the "
                f"{total} this host has ({PRIVATE_ENV}): end some first",
                details={"tenant": owner, "private_networks": mine, "total": total})
        for net in private_subnet().subnets(new_prefix=GROUP_PREFIX):
            if net not in taken:
                return net
        raise CapacityExceeded(f"{len(taken)} private networks have sandboxes on this host, "
                               f"the most {PRIVATE_ENV} holds: end some first")

    # ----------------------------------------------------------------- the kernel

    @staticmethod
    def _element(member: Member) -> str:
        return f'"{member.port}" . {mac_of(member.ip)} . {member.ip}'

    @staticmethod
    def _make(netns: str) -> None:
        _run(["ip", "netns", "add", netns])
        try:
            _run(["ip", "-n", netns, "-batch", "-"],
                 f"link add {BRIDGE} type bridge\nlink set {BRIDGE} addrgenmode none\n"
                 f"link set {BRIDGE} up\n")
            _nft_in(netns, GUARD)
        except BaseException:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
            raise

    def _plug(self, netns: str, member: Member, link: Link) -> None:
        prefix = GROUP_PREFIX
        _run(["ip", "-n", link.netns, "link", "add", MEMBER_IF, "address", mac_of(member.ip),
              "type", "veth", "peer", "name", member.port, "netns", netns])
        _run(["ip", "-n", link.netns, "-batch", "-"],  # no IPv6 link-local address on it
             f"link set {MEMBER_IF} addrgenmode none\n"
             f"addr add {member.ip}/{prefix} dev {MEMBER_IF}\nlink set {MEMBER_IF} up\n")
        _run(["ip", "-n", netns, "-batch", "-"],
             f"link set {member.port} addrgenmode none\n"
             f"link set {member.port} master {BRIDGE}\nlink set {member.port} up\n")
        _nft_in(netns, f"add element bridge guard members {{ {self._element(member)} }}\n")
