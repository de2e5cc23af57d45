"""Whose sandboxes, snapshots and pools the running task may see: the one rule.

Each sandbox's spec names its owner (``spec.tenant``; None: the admin's). Every lookup
by id in the engine, its snapshots and its pools asks :meth:`Owners.sees`, and what
the acting owner may not see answers exactly like an id that does not exist. Acting
as None (the admin) sees everything.

Who acts is never assumed. The daemon's door resolves each request's caller and runs
it acting for that caller (:meth:`Owners.acting_as`); the daemon's own background
work (a pool's refills, sweeps) runs in a context that says so
(:meth:`Owners.detached`). Once the daemon has called :meth:`Owners.require_caller`,
engine code reached with no owner set fails closed (:class:`~corral.errors.InternalError`)
instead of seeing everything; an engine used on its own, as a library, acts for the
admin unless told otherwise.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from corral.errors import InternalError
from corral.schema import SandboxSpec

__all__ = ["Owners"]

_NOBODY = "\0nobody"  # no owner set: the context variable's default


class Owners:
    """The acting owner of the current task, and the visibility rule."""

    def __init__(self) -> None:
        self._acting: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            "corral_acting_owner", default=_NOBODY
        )
        self._strict = False

    def require_caller(self) -> None:
        """From now on, acting with no owner set raises (the daemon calls it once)."""
        self._strict = True

    def acting(self) -> str | None:
        """The tenant the current task acts for; None: the admin (sees everything)."""
        acting = self._acting.get()
        if acting == _NOBODY:
            if self._strict:
                raise InternalError(
                    "engine code ran with no caller (fail closed): a request must act for "
                    "the caller its door resolved, background work for the daemon")
            return None
        return acting

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
        acting = self.acting()
        return acting is None or acting == owner

    def stamp(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` as the acting owner makes it: a tenant's things are its own."""
        acting = self.acting()
        if acting is None or spec.tenant == acting:
            return spec
        return spec.model_copy(update={"tenant": acting})

    def detached(self) -> contextvars.Context:
        """A context acting for the daemon itself (the admin), for its background work."""
        context = contextvars.Context()
        context.run(self._acting.set, None)
        return context
