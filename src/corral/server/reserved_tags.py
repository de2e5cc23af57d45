"""Tags a front-end keeps for itself: its names, namespaces and metadata.

E2B keeps ``e2b`` and ``e2b.*`` (its template and metadata), Tensorlake ``tensorlake``
and ``tensorlake.*`` (its namespaces and sandbox names), SandboxFusion
``sandboxfusion`` (its pools). Such a tag is set only by its own front-end: a sandbox
or pool made through any other (the native API, cwsandbox) carrying one is refused,
so nobody plants a name another front-end's client would look up. Lookups by those
tags (a Tensorlake name, E2B metadata) resolve only within the caller's own sandboxes
(:meth:`~corral.server.service.SandboxService.own`), the admin's included.
"""

from __future__ import annotations

from collections.abc import Iterable

from corral.errors import InvalidArgument

__all__ = ["FRONTENDS", "check_tags", "owner_of_tag"]

FRONTENDS = {"e2b": "E2B", "tensorlake": "Tensorlake", "sandboxfusion": "SandboxFusion"}
"""Each reserved tag root and the front-end it belongs to."""


def owner_of_tag(tag: str) -> str | None:
    """The front-end (its tag root) a tag is reserved for, or None."""
    root = tag.partition(".")[0]
    return root if root in FRONTENDS else None


def check_tags(tags: Iterable[str], frontend: str) -> None:
    """:class:`InvalidArgument` if ``tags`` hold a tag reserved for a front-end other
    than ``frontend`` (``"native"``, ``"cwsandbox"``, or a root of :data:`FRONTENDS`)."""
    for tag in tags:
        owner = owner_of_tag(tag)
        if owner is not None and owner != frontend:
            raise InvalidArgument(
                f"tag {tag[:100]!r} is reserved: tags '{owner}' and '{owner}.*' are set only "
                f"by corral's {FRONTENDS[owner]} front-end (its names and metadata); "
                "choose another tag",
                details={"field": "tags", "tag": tag[:100]},
            )
