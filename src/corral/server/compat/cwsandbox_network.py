"""CoreWeave Sandbox's ``NetworkOptions(egress=[EgressRule(...)])`` as a corral egress
policy (docs/network.md): ``dns_name`` → the name on port 443 (its HTTPS hostname),
``cidr`` → the range (on each TCP port it names), ``any`` → every name and address.
What corral cannot enforce is refused (ValueError, the front-end's "unsupported"):
ingress rules, tenant and pod-selector rules, ``except`` lists, UDP, port ranges."""

from __future__ import annotations

from typing import Any

MAX_RANGE = 16  # a port range is expanded into this many rules at most


def _ports(rule: Any) -> list[int | None]:
    out: list[int | None] = []
    for p in rule.ports:
        if p.protocol and p.protocol.upper() != "TCP":
            raise ValueError(f"egress rules on {p.protocol} (corral allows TCP only)")
        last = p.end_port or p.port
        if last - p.port >= MAX_RANGE:
            raise ValueError(f"an egress port range over {MAX_RANGE} ports")
        out += list(range(p.port, last + 1))
    return out or [None]


def egress_policy(network: Any) -> dict[str, list[str]] | None:
    """The policy of a ``NetworkOptions`` (None: it asks for no network)."""
    if len(network.ingress):
        raise ValueError("network ingress rules (expose ports with corral's own API)")
    allow: list[str] = []
    for rule in network.egress:
        dest = rule.WhichOneof("destination")
        if len(rule.https_hostname_except) or (dest == "cidr" and len(getattr(rule.cidr, "except"))):
            raise ValueError("egress rules with exceptions")
        if dest == "https_hostname":
            allow += [f"{rule.https_hostname}:{port or 443}" for port in _ports(rule)]
        elif dest == "cidr":
            allow += [rule.cidr.cidr + (f":{p}" if p else "") for p in _ports(rule)]
        elif dest == "any" and rule.any:
            allow += ["*", "0.0.0.0/0"]
        else:
            raise ValueError(f"egress rules by {dest} (corral allows names and CIDRs)")
    if not allow:
        return None
    return {"allow": allow}
