"""E2B's (and Tensorlake's) egress options as a corral policy (docs/network.md)."""

from __future__ import annotations

from typing import Any

from corral.errors import InvalidArgument

ALL_TRAFFIC = "0.0.0.0/0"  # E2B's name for every destination


def egress_policy(raw: Any) -> dict[str, list[str]]:
    """E2B's ``network={"allowOut", "denyOut"}`` as a corral policy (:func:`out_rules`)."""
    if not isinstance(raw, dict) or set(raw) - {"allowOut", "denyOut", "allowPublicTraffic",
                                                "dnsServers"}:
        raise InvalidArgument("these network options are not supported by corral's E2B "
                              "front-end: it maps allow_out and deny_out only")
    allow, deny = raw.get("allowOut") or [], raw.get("denyOut") or []
    if not isinstance(allow, list) or not isinstance(deny, list):
        raise InvalidArgument("network.allowOut and network.denyOut are lists of strings")
    return out_rules(allow, deny)


def out_rules(allow: list[str], deny: list[str]) -> dict[str, list[str]]:
    """``allow_out`` / ``deny_out`` (E2B's and Tensorlake's: what is not denied is
    allowed, and ``allow_out`` are exceptions to ``deny_out``) as a corral policy: with
    ``0.0.0.0/0`` denied that is corral's allow list exactly; otherwise the exceptions
    are dropped (stricter: what deny_out names stays refused)."""
    return {"allow": allow if ALL_TRAFFIC in deny else [],
            "deny": [d for d in deny if d != ALL_TRAFFIC]}
