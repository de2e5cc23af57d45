"""Memory the daemon may hold for commands' output: a budget per tenant and in all.

A command run to completion (``exec``, ``POST /v1/run``, the front-ends' exec) keeps up
to ``max_output`` bytes of each of its two streams in the daemon's memory until its
result has been sent; a streamed command's events wait in memory for a slow reader.
``max_output`` may be up to 1 GiB, so without a budget a tenant running many such
commands at once could make the daemon hold more than the host has.

So what a command's output holds counts against the tenant of its sandbox
(``--tenant-output-memory-mb``, default half the daemon's) and the daemon's
(``--output-memory-mb``, default an eighth of the host's RAM, or of the daemon's cgroup
memory limit where lower), by the bytes really held, not by what it may hold:

- before it starts, a command takes a small floor, :data:`MIN_GRANT` per stream (or its
  ``max_output`` where smaller): when not even that is free it is refused,
  :class:`~corral.errors.OutputBudgetExceeded` (429), which says whose budget is spent
  and what to do. So hundreds of commands printing little run at once at any budget;
- as its output arrives, the command's room grows by the bytes it brings
  (:mod:`corral.runtime.output_room`); a streamed command gives them back as its reader
  takes them;
- when the budget has no more, the stream's cap is lowered there, mid-stream, to what
  it holds: a command run to completion keeps its head and, in the room it already
  holds, its last bytes (at most half its floor: where a verdict or a traceback is
  printed); a streamed command drops what its reader has not made room for and shows
  the gap as a cap's would. Its result says so: ``output_limited_to`` (the bytes per
  stream it could hold at most), ``*_truncated``, ``*_dropped``.

A tenant flooding output therefore never makes the daemon hold more than its share (nor
all tenants more than the daemon's budget). A result being sent holds only its real
size; everything is given back once the reply is written (or the client has gone).

An interactive process's unread output (``max_buffer`` per stream) counts against the
same budgets, by what it really holds (the tenant of its sandbox): output that comes
while they are spent is dropped like output past ``max_buffer`` (its result's
``*_truncated``), and reading or dropping it gives the room back.
"""

from __future__ import annotations

import os
from pathlib import Path

from corral.errors import OutputBudgetExceeded

__all__ = ["MIN_GRANT", "OutputBudget", "OutputHold", "host_output_bytes", "memory_limit"]

MIN_GRANT = 64 << 10
"""The floor a command takes per stream before it starts (its ``max_output`` where
smaller): the smallest cap it can be lowered to; when not even that is free, it is
refused."""
HOST_SHARE = 8
"""The daemon's default budget: the host's RAM divided by this."""
TENANT_SHARE = 2
"""A tenant's default budget: the daemon's divided by this."""


def host_output_bytes() -> int:
    """The daemon's default output budget: an eighth of the memory it may use (the
    host's RAM, or its own cgroup's limit where lower: a daemon in a container)."""
    return memory_limit() // HOST_SHARE


def memory_limit(self_cgroup: Path = Path("/proc/self/cgroup"),
                 cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The host's RAM, or the lowest memory limit of this process's cgroup and its
    ancestors (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) where lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return limit
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):
            try:
                value = (base.joinpath(*parts[:depth]) / name).read_text().strip()
            except OSError:
                continue
            if value.isdigit():
                limit = min(limit, int(value))
    return limit


class OutputHold:
    """What one command (or one reply) holds of the budget: its floor, then what it
    grows by (:meth:`grow`); :meth:`release` gives it all back (once, whatever calls it
    again). ``max_output`` is the cap per stream asked, lowered (``limited``) when the
    budget could not hold more (:mod:`corral.runtime.output_room`)."""

    __slots__ = ("_budget", "tenant", "nbytes", "floor", "max_output", "limited", "over")

    def __init__(self, budget: "OutputBudget | None", tenant: str | None, nbytes: int,
                 max_output: int, limited: bool = False) -> None:
        self._budget = budget
        self.tenant = tenant
        self.nbytes = nbytes
        self.floor = nbytes // 2  # per stream, taken before the command starts
        self.max_output = max_output  # the cap per stream: as asked, or as lowered
        self.limited = limited  # lowered from what was asked
        self.over = 0  # of nbytes, counted past the tenant's share (OutputBudget.over)

    def grow(self, nbytes: int) -> int:
        """Hold up to ``nbytes`` more: what the tenant's and the daemon's budgets have
        (0 when spent)."""
        budget = self._budget
        n = 0 if budget is None else max(0, min(nbytes, budget.free_for(self.tenant)))
        if n:
            assert budget is not None
            budget._add(self.tenant, n)
            self.nbytes += n
        return n

    def shrink(self, nbytes: int) -> None:
        """Keep only ``nbytes`` (a result's real size, while it is sent; a streamed
        command's room once its reader has taken the output)."""
        if self._budget is not None and nbytes < self.nbytes:
            less = self.nbytes - nbytes
            over = min(self.over, less)  # what was past the share goes first
            self._budget._give_back(self.tenant, less, over)
            self.nbytes, self.over = nbytes, self.over - over

    def fit(self, nbytes: int) -> None:
        """Hold exactly ``nbytes`` (a reply's real size, while it is sent): less gives
        room back; more (a reply's encoding is larger than the output, ``\\u0001`` for
        a byte) is counted even past the budget, since those bytes exist already: the
        tenant's next reservation is refused instead. What is past the tenant's own free
        room counts against the tenant only, not the daemon's total: one tenant's
        replies never leave the others no room."""
        budget = self._budget
        if budget is None or nbytes == self.nbytes:
            return
        if nbytes < self.nbytes:
            self.shrink(nbytes)
            return
        more = nbytes - self.nbytes
        over = max(0, more - budget.free_for(self.tenant))
        budget._add(self.tenant, more, over)
        self.nbytes, self.over = nbytes, self.over + over

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.tenant, self.nbytes, self.over)


class OutputBudget:
    """Bytes of output held at once: at most ``total`` in all and ``per_tenant`` per
    tenant (the admin, tenant None, counts as one). See the module docstring."""

    def __init__(self, total: int | None = None, per_tenant: int | None = None) -> None:
        self.total = host_output_bytes() if total is None else total
        self.per_tenant = self.total // TENANT_SHARE if per_tenant is None else per_tenant
        if self.total < 2 * MIN_GRANT or self.per_tenant < 2 * MIN_GRANT:
            raise ValueError(f"an output budget must be at least {2 * MIN_GRANT} bytes")
        self.used = 0  # bytes held in all
        self.over = 0  # of them, held by replies past their tenant's share (OutputHold.fit)
        self.by_tenant: dict[str | None, int] = {}

    def free_for(self, tenant: str | None) -> int:
        return max(0, min(self.total - (self.used - self.over),
                          self.per_tenant - self.by_tenant.get(tenant, 0)))

    def reserve(self, tenant: str | None, max_output: int, sandbox_id: str = "") -> OutputHold:
        """A command's floor, ``2 × min(max_output, MIN_GRANT)``; the rest is taken as
        its output comes (:meth:`OutputHold.grow`). A refusal
        (:class:`OutputBudgetExceeded`) if not even the floor is free."""
        floor = 2 * min(max(max_output, 0), MIN_GRANT)
        if floor <= self.free_for(tenant):
            self._add(tenant, floor)
            return OutputHold(self, tenant, floor, max_output)
        tenant_used = self.by_tenant.get(tenant, 0)
        whose = ("the daemon's" if self.total - (self.used - self.over) < self.per_tenant - tenant_used
                 else "its tenant's")
        raise OutputBudgetExceeded(
            f"sandbox {sandbox_id}: no memory left to hold the command's output: {whose} "
            f"output budget is held by output not yet sent ({self.used} of {self.total} "
            f"bytes in all, {tenant_used} of {self.per_tenant} for the tenant); retry when "
            "some commands have ended or their output has been read, or ask a smaller "
            "max_output (its output_tail keeps the end)",
            details={"sandbox_id": sandbox_id, "tenant": tenant, "used": self.used,
                     "limit": self.total, "tenant_used": tenant_used,
                     "tenant_limit": self.per_tenant, "requested": max_output},
        )

    def hold(self, tenant: str | None) -> OutputHold:
        """Room for a reply made of output whose own room was given back as it was read
        (a process's line): nothing yet, its size counted by :meth:`OutputHold.fit`."""
        return OutputHold(self, tenant, 0, 0, False)

    def take(self, tenant: str | None, nbytes: int) -> int:
        """Room for up to ``nbytes`` more of a process's unread output: what fits, never
        refused (0 when the budget is spent); given back with :meth:`give`."""
        n = max(0, min(nbytes, self.free_for(tenant)))
        if n:
            self._add(tenant, n)
        return n

    def give(self, tenant: str | None, nbytes: int) -> None:
        """Give back what :meth:`take` granted (output read or dropped)."""
        if nbytes > 0:
            self._give_back(tenant, nbytes)

    def _add(self, tenant: str | None, nbytes: int, over: int = 0) -> None:
        """Count ``nbytes`` for ``tenant``; ``over`` of them (past its share) held but
        not taken from the others' room (:meth:`free_for`)."""
        self.used += nbytes
        self.over += over
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + nbytes

    def _give_back(self, tenant: str | None, nbytes: int, over: int = 0) -> None:
        self.used -= nbytes
        self.over -= over
        left = self.by_tenant.get(tenant, 0) - nbytes
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)
