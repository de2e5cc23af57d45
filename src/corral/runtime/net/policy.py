"""A policy compiled for enforcement: the verdict on one name, address and port.

:class:`Compiled` is what the resolver (:mod:`.dns`) and the proxy (:mod:`.proxy`)
ask. Presets are expanded here, on the host, when the policy is compiled (``pypi``:
the hosts of the index URLs the host's pip is configured with, :func:`pip_index_hosts`).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

from corral.network_schema import SPECIAL_NETS, NetworkPolicy, Rule, RuleKind, is_special
from corral.runtime.net import netns

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str


def _pip_config() -> dict[str, str]:
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        found[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    return found


@lru_cache(maxsize=1)
def pip_index_hosts() -> tuple[str, ...]:
    """The hosts of the package indexes the host's pip uses (``index-url`` and
    ``extra-index-url`` of its configuration and environment; pip's own default index
    and file host when none is set)."""
    conf = _pip_config()
    for key in ("index-url", "extra-index-url"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            conf[key] = env
    urls = [u for k in ("index-url", "extra-index-url") for u in conf.get(k, "").split()]
    hosts = [urlsplit(u).hostname for u in urls if urlsplit(u).scheme in ("http", "https")]
    if "index-url" not in conf:
        try:
            from pip._internal.models.index import PyPI  # pip's own default, not ours
        except ImportError:
            pass
        else:
            hosts += [urlsplit(PyPI.simple_url).hostname, PyPI.file_storage_domain]
    return tuple(dict.fromkeys(h.lower() for h in hosts if h))


def _expand(rules: list[Rule]) -> list[Rule]:
    out: list[Rule] = []
    for r in rules:
        if r.kind == RuleKind.PRESET:  # only "pypi" exists
            out += [Rule(RuleKind.DOMAIN, h, None) for h in pip_index_hosts()]
        else:
            out.append(r)
    return out


def _name_match(rule: Rule, name: str) -> bool:
    if rule.kind == RuleKind.DOMAIN:
        return name == rule.value
    if rule.kind == RuleKind.WILDCARD:
        return name.endswith("." + rule.value)
    return rule.kind == RuleKind.ANY_NAME


def _port_ok(rule: Rule, port: int | None) -> bool:
    return rule.port is None or port is None or rule.port == port


@dataclass
class Compiled:
    """The rules of one :class:`NetworkPolicy`, presets expanded."""

    policy: NetworkPolicy
    allow: list[Rule] = field(default_factory=list)
    deny: list[Rule] = field(default_factory=list)

    @classmethod
    def of(cls, policy: NetworkPolicy) -> "Compiled":
        allow, deny = policy.rules()
        return cls(policy, _expand(allow), _expand(deny))

    def _names(self, rules: list[Rule], name: str, port: int | None) -> bool:
        return any(_name_match(r, name) and _port_ok(r, port) for r in rules)

    def _nets(self, rules: list[Rule], ip: IPAddress, port: int | None, *,
              special: bool = False) -> bool:
        return any(r.kind == RuleKind.CIDR and _port_ok(r, port) and ip in r.network
                   and (not special or r.names_special()) for r in rules)

    def name_allowed(self, name: str, port: int | None = None) -> bool:
        """Whether the resolver answers ``name`` (and the proxy dials it)."""
        name = name.lower().rstrip(".")
        if self._names(self.allow, name, port):
            return True
        return not self.allow and not self._names(self.deny, name, port)

    def decide(self, name: str | None, ip: IPAddress, port: int) -> Verdict:
        """The verdict on a connection to ``ip``:``port`` (``name``: the one the
        sandbox asked for, from Host / SNI; the address is then the host's resolution
        of it, never the sandbox's)."""
        if name is not None and not self.name_allowed(name, port):
            return Verdict(False, f"the name {name} is not allowed")
        if is_special(ip) and not self._nets(self.allow, ip, port, special=True):
            return Verdict(False, f"{ip} is a private, loopback or link-local address")
        if name is not None:
            return Verdict(True, f"the name {name} is allowed")
        if self._nets(self.allow, ip, port):
            return Verdict(True, f"{ip} is allowed")
        if self.allow or self._nets(self.deny, ip, port):
            return Verdict(False, f"{ip}:{port} is not allowed")
        return Verdict(True, "not denied")

    def decide_udp(self, ip: IPAddress, port: int) -> Verdict:
        """The verdict on UDP to ``ip``:``port`` (not DNS): allowed only by an allow rule
        naming its address (an IP or CIDR; a deny-only policy opens no UDP)."""
        if is_special(ip) and not self._nets(self.allow, ip, port, special=True):
            return Verdict(False, f"{ip} is a private, loopback or link-local address")
        if self._nets(self.allow, ip, port):  # allow wins over deny
            return Verdict(True, f"UDP to {ip}:{port} is allowed")
        return Verdict(False, f"UDP to {ip}:{port} is not allowed (UDP needs an allow rule "
                       "naming its address: an IP or CIDR, optionally with a port)")

    def udp_entries(self) -> list[tuple[str, str]]:
        """The kernel's prefilter for this policy's UDP: (CIDR, port range) of each
        allow rule naming addresses (the relay decides each flow again)."""
        entries = []
        for r in self.allow:
            if r.kind != RuleKind.CIDR:
                continue
            # ranges the relay refuses anyway are left to the kernel, which refuses at
            # once (ICMP): special ones a rule does not name, and the links' subnets
            nets = [r.network]
            for hole in (*SPECIAL_NETS, netns.subnet(), netns.subnet6()):
                if hole.version == r.network.version and not (
                        r.names_special() and r.network.subnet_of(hole)):  # type: ignore[arg-type]
                    nets = [piece for n in nets for piece in _minus(n, hole)]
            entries += [(n, r.port) for n in nets]
        return disjoint(entries)


def disjoint(entries: list[tuple[IPNetwork, int | None]]) -> list[tuple[str, str]]:
    """(network, port or None) entries as non-overlapping (CIDR, port range) elements
    (an interval set refuses overlaps): networks of one port collapsed, and those any
    port covers left out."""
    out: list[tuple[str, str]] = []
    for version in (4, 6):
        mine = [(n, p) for n, p in entries if n.version == version]
        anyport = list(ipaddress.collapse_addresses(n for n, p in mine if p is None))  # type: ignore[type-var]
        out += [(str(n), "0-65535") for n in anyport]
        for port in sorted({p for _, p in mine if p is not None}):
            nets = list(ipaddress.collapse_addresses(n for n, p in mine if p == port))  # type: ignore[type-var]
            for cover in anyport:
                nets = [piece for n in nets for piece in _minus(n, cover)]
            out += [(str(n), str(port)) for n in nets]
    return out


def _minus(net: IPNetwork, cover: IPNetwork) -> list[IPNetwork]:
    if net.subnet_of(cover):  # type: ignore[arg-type]
        return []
    if cover.subnet_of(net):  # type: ignore[arg-type]
        return list(net.address_exclude(cover))  # type: ignore[arg-type]
    return [net]

