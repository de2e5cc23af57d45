"""Whose sandboxes, snapshots and pools a call may see: the one rule.

Each sandbox's spec names its owner (``spec.tenant``; None: the admin's). Every lookup
by id in the engine, its snapshots, pools, volumes and networks takes the owner it acts
for as an explicit ``owner=`` argument and asks :meth:`Owners.sees`; what that owner may
not see answers exactly like an id that does not exist. Acting as None (the admin)
sees everything.

Who acts is never assumed and never ambient (no context variable): the daemon's service
layer passes the owner of the :class:`~corral.server.caller.Caller` its door resolved,
and the daemon's own work passes None on purpose. Once the daemon has called
:meth:`Owners.require_caller`, an engine call that names no owner (:data:`UNSET`)
fails closed (:class:`~corral.errors.InternalError`) instead of seeing everything; an
engine used on its own, as a library, acts for the admin unless told otherwise.
"""

from __future__ import annotations

import enum
from typing import Literal, Union

from corral.errors import InternalError
from corral.schema import SandboxSpec

__all__ = ["UNSET", "Owner", "OwnerArg", "Owners"]


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET  # no owner named: raises once the daemon requires a caller
Owner = Union[str, None]  # a tenant's name; None: the admin (sees everything)
OwnerArg = Union[str, None, Literal[_Unset.UNSET]]


class Owners:
    """The visibility rule, and whether a call must name its owner."""

    def __init__(self) -> None:
        self._strict = False

    def require_caller(self) -> None:
        """From now on, a call naming no owner raises (the daemon calls it once)."""
        self._strict = True

    def of(self, owner: OwnerArg) -> Owner:
        """The owner a call acts for: ``owner``, or (none named) the admin for a library
        engine and :class:`~corral.errors.InternalError` for the daemon's (fail closed)."""
        if owner is UNSET:
            if self._strict:
                raise InternalError(
                    "engine code ran with no caller (fail closed): a request must pass the "
                    "owner of the caller its door resolved, the daemon's own work owner=None")
            return None
        return owner

    def sees(self, spec: SandboxSpec, owner: OwnerArg) -> bool:
        """Whether ``owner`` may see a thing made with ``spec``."""
        return self.sees_owner(spec.tenant, owner)

    def sees_owner(self, of: str | None, owner: OwnerArg) -> bool:
        """Whether ``owner`` may see a thing of ``of`` (None: the admin's)."""
        acting = self.of(owner)
        return acting is None or acting == of

    def stamp(self, spec: SandboxSpec, owner: OwnerArg) -> SandboxSpec:
        """``spec`` as ``owner`` makes it: a tenant's things are its own."""
        acting = self.of(owner)
        if acting is None or spec.tenant == acting:
            return spec
        return spec.model_copy(update={"tenant": acting})
