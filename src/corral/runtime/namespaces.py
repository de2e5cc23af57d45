"""Which of the things holding a name a lookup by that name finds: names per owner.

Snapshot and pool names are unique per owner (a tenant, or the admin: ``None``), not
across the daemon: tenant bob may name a snapshot or pool ``x`` although alice has one,
and nothing bob does tells him whether she has. A lookup by name resolves in the
caller's namespace only:

- a tenant finds its own thing of that name, or nothing (another tenant's answers
  exactly like a free name);
- the admin finds its own first; failing that, the one tenant's that holds the name;
  if several tenants hold it, :class:`~corral.errors.InvalidArgument` listing them
  (address the thing by id, or act with the tenant's token).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from corral.errors import InvalidArgument

__all__ = ["pick"]

T = TypeVar("T")


def pick(kind: str, name: str, acting: str | None,
         holders: Iterable[tuple[str | None, str, T]]) -> T | None:
    """The thing named ``name`` that ``acting`` (None: the admin) finds among
    ``holders``: ``(owner, id, thing)`` of every thing with that name."""
    held = [(owner or None, ident, thing) for owner, ident, thing in holders]
    for owner, _, thing in held:
        if owner == acting:
            return thing
    if acting is not None or not held:
        return None
    if len(held) == 1:
        return held[0][2]
    listed = ", ".join(sorted(f"{ident} (tenant {owner!r})" for owner, ident, _ in held))
    raise InvalidArgument(
        f"several tenants have a {kind} named {name!r} and the admin has none: {listed}; "
        f"address the {kind} by id, or act with its tenant's token",
        details={"name": name, "candidates": sorted(
            ({"id": ident, "tenant": owner} for owner, ident, _ in held),
            key=lambda c: (str(c["tenant"]), c["id"]))},
    )
