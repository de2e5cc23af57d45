"""A sandbox's egress policy: what ``network={"allow": [...], "deny": [...]}`` may say.

Shared by the SDK (it validates before sending) and the daemon (which enforces it,
:mod:`corral.runtime.net`). A rule is one string::

    example.com            the name, any port        (TCP 80/443: checked on Host / SNI)
    *.example.com          every name below it       (not example.com itself)
    example.com:443        the name, port 443 only
    *                      every name                (80/443; with "0.0.0.0/0": the internet)
    93.184.216.34          an IPv4 address           (any port, unless one is given)
    10.0.0.0/8:5432        a CIDR, one port          (private ranges: admins only)
    2001:db8::1            an IPv6 address; with a port in brackets: [2001:db8::1]:443
    pypi                   a preset: the index the host's pip uses, read at run time

A policy may also join a *private network* (``"join": "NAME"``, a named network made
with ``private=True``; ``"alias": "db"``, the name its other members reach it by,
besides its id): the members reach each other directly, and nothing else unless
their rules say so (docs/network.md, "Private networks").

A destination is allowed if an ``allow`` rule matches it (allow wins over deny);
otherwise it is refused if a ``deny`` rule matches, and otherwise allowed only when
the policy has no ``allow`` rule at all (``{"deny": [...]}`` alone: the public
internet but those). Private, loopback, link-local and metadata addresses are refused
whatever the rules say, unless an allow rule names a CIDR *inside* such a range
(``10.1.2.0/24``), which only an admin may do.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from enum import Enum
from typing import Union

from pydantic import ConfigDict, Field, StrictInt, field_validator, model_validator

from corral._model import Model

__all__ = [
    "ALIAS_RE",
    "MAX_RULES",
    "NETWORK_NAME_RE",
    "PRESETS",
    "RESERVED_NAMES",
    "NetworkInfo",
    "NetworkPolicy",
    "Rule",
    "RuleKind",
    "is_special",
    "parse_rule",
]

MAX_RULES = 256  # per list (allow, deny)
# a named network's (corral.Network): never "none" or "host" (the spec's own modes)
NETWORK_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
RESERVED_NAMES = ("none", "host")
# a member's name on a private network (a DNS label; sandbox ids are names there too)
ALIAS_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
PRESETS = ("pypi",)
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

# Never reached by a rule that does not name them explicitly (a CIDR inside one of them).
SPECIAL_NETS: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/3",
    "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "fc00::/7", "fe80::/10", "ff00::/8",
))


def is_special(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Private, loopback, link-local (metadata), multicast or reserved."""
    return any(ip in net for net in SPECIAL_NETS if net.version == ip.version)


class RuleKind(str, Enum):
    DOMAIN = "domain"  # exactly this name
    WILDCARD = "wildcard"  # names below this one
    ANY_NAME = "any_name"  # "*"
    CIDR = "cidr"  # an address is a /32 (/128)
    PRESET = "preset"


@dataclass(frozen=True)
class Rule:
    """One parsed rule: its kind, its value (a name, a network, a preset) and port."""

    kind: RuleKind
    value: str
    port: int | None = None

    @property
    def network(self) -> IPNetwork:
        return ipaddress.ip_network(self.value)

    def names_special(self) -> bool:
        """A CIDR inside a private / loopback / link-local range (admin only)."""
        if self.kind != RuleKind.CIDR:
            return False
        net = self.network
        return any(net.version == s.version and net.subnet_of(s)  # type: ignore[arg-type]
                   for s in SPECIAL_NETS)


def _port(text: str, rule: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"invalid port in {rule!r}: use 1-65535, e.g. 'example.com:443'")
    return int(text)


def _name(text: str, rule: str) -> str:
    name = text.lower().rstrip(".")
    if not name or len(name) > 253 or not all(_LABEL.match(p) for p in name.split(".")):
        raise ValueError(
            f"invalid rule {rule!r}: use a domain (example.com, *.example.com), an IP, a "
            f"CIDR (10.0.0.0/8), optionally ':PORT', or a preset ({', '.join(PRESETS)})")
    return name


def parse_rule(rule: str) -> Rule:
    """Parse one rule; ValueError says what is wrong and what would do."""
    if not isinstance(rule, str) or not rule or len(rule) > 300 or rule != rule.strip():
        raise ValueError(f"invalid rule {rule!r}: a non-empty string without spaces")
    if rule in PRESETS:
        return Rule(RuleKind.PRESET, rule)
    host, port = rule, None
    if rule.startswith("["):  # [v6]:port or [v6/len]:port
        end = rule.find("]")
        if end < 0 or not rule[end + 1:].startswith(":"):
            raise ValueError(f"invalid rule {rule!r}: write an IPv6 address with a port as "
                             "[2001:db8::1]:443")
        host, port = rule[1:end], _port(rule[end + 2:], rule)
    elif rule.count(":") == 1:
        host, _, p = rule.partition(":")
        port = _port(p, rule)
    try:
        net = ipaddress.ip_network(host, strict=True)
    except ValueError as exc:
        if "/" in host or host.count(":") > 1 or host.replace(".", "").isdigit():
            raise ValueError(f"invalid IP or CIDR in {rule!r}: {exc}") from None
    else:
        return Rule(RuleKind.CIDR, str(net), port)
    if host == "*":
        return Rule(RuleKind.ANY_NAME, "*", port)
    if host.startswith("*."):
        return Rule(RuleKind.WILDCARD, _name(host[2:], rule), port)
    return Rule(RuleKind.DOMAIN, _name(host, rule), port)


class NetworkPolicy(Model):
    """``network={"allow": [...], "deny": [...]}``: the sandbox reaches what is allowed,
    through corral's resolver and proxy (see the module's docstring for the rules)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[str] = Field(default_factory=list, max_length=MAX_RULES)
    deny: list[str] = Field(default_factory=list, max_length=MAX_RULES)
    # A cap on the sandbox's bandwidth, each way, in megabits per second (None: none).
    max_mbps: StrictInt | None = Field(None, ge=1, le=100_000)
    # The private network (a named network made with private=True) the sandbox joins,
    # fixed at create, and the name its other members reach it by (its id also works).
    join: str | None = Field(None, pattern=NETWORK_NAME_RE.pattern)
    alias: str | None = Field(None, pattern=ALIAS_RE.pattern)

    @field_validator("alias")
    @classmethod
    def _alias(cls, alias: str | None) -> str | None:
        if alias is not None and alias.startswith("sb-"):
            raise ValueError(f"alias {alias!r} looks like a sandbox id: pick another")
        return alias

    @model_validator(mode="after")
    def _joined(self) -> NetworkPolicy:
        if self.alias is not None and self.join is None:
            raise ValueError("an alias names a sandbox on a private network: give 'join' too")
        return self

    @field_validator("allow", "deny")
    @classmethod
    def _rules(cls, rules: list[str]) -> list[str]:
        for r in rules:
            parse_rule(r)
        return list(dict.fromkeys(rules))

    def rules(self) -> tuple[list[Rule], list[Rule]]:
        """The parsed (allow, deny) rules."""
        return [parse_rule(r) for r in self.allow], [parse_rule(r) for r in self.deny]

    def names_special(self) -> list[str]:
        """Allow rules naming a private / loopback / link-local CIDR (admin only)."""
        return [r for r in self.allow if parse_rule(r).names_special()]


class NetworkInfo(Model):
    """A named network (``corral.Network``): a policy stored on the daemon, per tenant,
    that sandboxes use by name (``network="NAME"``); each sandbox gets the policy as it
    is when the sandbox is created. A ``private`` one also joins its sandboxes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NETWORK_NAME_RE.pattern)
    policy: NetworkPolicy
    created_at: float = 0.0
    # A private network: its sandboxes (network="NAME", or a policy with "join": "NAME")
    # reach each other directly, on a bridge of their own (docs/network.md).
    private: bool = False

    @field_validator("name")
    @classmethod
    def _not_a_mode(cls, name: str) -> str:
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} is a network mode, not a name: pick another")
        return name
