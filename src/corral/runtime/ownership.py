"""Whose sandboxes, snapshots and pools the running task may see: the one rule.

Each sandbox's spec names its owner (``spec.tenant``; None: the admin's). The server
sets the owner a request acts for (:meth:`Owners.acting_as`, from its token) around
the whole request; every lookup by id in the engine, its snapshots and its pools asks
:meth:`Owners.sees`, and what the acting owner may not see answers exactly like an id
that does not exist. Acting as None (the admin, the daemon's own background work)
sees everything.

A context variable carries the acting owner, so tasks a request starts keep it; work
that must act for the daemon itself (a pool's refills) runs in a fresh context
(:meth:`Owners.detached`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from corral.schema import SandboxSpec

__all__ = ["Owners"]


class Owners:
    """The acting owner of the current task, and the visibility rule."""

    def __init__(self) -> None:
        self._acting: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            "corral_acting_owner", default=None
        )

    def acting(self) -> str | None:
        """The tenant the current task acts for; None: the admin (sees everything)."""
        return self._acting.get()

    @contextmanager
    def acting_as(self, owner: str | None) -> Iterator[None]:
        """Act for ``owner`` (None: the admin) until the block ends."""
        reset = self._acting.set(owner)
        try:
            yield
        finally:
            self._acting.reset(reset)

    def sees(self, spec: SandboxSpec) -> bool:
        """Whether the acting owner may see a thing made with ``spec``."""
        return self.sees_owner(spec.tenant)

    def sees_owner(self, owner: str | None) -> bool:
        """Whether the acting owner may see a thing of ``owner`` (None: the admin's)."""
        acting = self._acting.get()
        return acting is None or acting == owner

    def stamp(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` as the acting owner makes it: a tenant's things are its own."""
        acting = self._acting.get()
        if acting is None or spec.tenant == acting:
            return spec
        return spec.model_copy(update={"tenant": acting})

    @staticmethod
    def detached() -> contextvars.Context:
        """A context acting for the admin, for background work of the daemon's own."""
        return contextvars.Context()
