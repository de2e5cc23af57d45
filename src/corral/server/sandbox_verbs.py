"""What one caller may do inside a sandbox: exec, processes, files, pause, snapshots.

The service layer's verbs on a running sandbox, for one :class:`~corral.server.caller.Caller`
passed explicitly (:func:`corral.server.context.sandboxes` makes one per request). Each
verb names its sandbox, and a caller scoped to one sandbox (an E2B access token) reaches
that sandbox only: any other id answers exactly like one that does not exist. Below
that, the engine's ownership rule (given the caller's owner explicitly, with every
call) hides other tenants' sandboxes the same way. A command or file operation on a
hibernated sandbox restores it first (``Engine.wake``).

Front-ends call these instead of the engine's methods of the same names and
signatures, so the rule lives here once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from corral.errors import FileTooLarge, OutputBudgetExceeded, SandboxNotFound
from corral.runtime.engine import Engine
from corral.runtime.output_budget import MIN_GRANT, OutputHold
from corral.schema import SandboxInfo
from corral.server.caller import Caller, Scope

__all__ = ["SandboxVerbs"]


class SandboxVerbs:
    """The engine's per-sandbox verbs, for ``caller`` (see the module docstring)."""

    def __init__(self, engine: Engine, caller: Caller) -> None:
        self._engine = engine
        self.caller = caller
        self._owner = caller.name  # passed to every engine call: never ambient

    def _check(self, sandbox_id: str) -> str:
        if self.caller.scope is Scope.SANDBOX and sandbox_id != self.caller.sandbox_id:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found",
                                  details={"sandbox_id": sandbox_id})
        return sandbox_id

    def get(self, sandbox_id: str) -> SandboxInfo:
        return self._engine.get(self._check(sandbox_id), owner=self._owner)

    async def _awake(self, verb: Callable[..., Awaitable[Any]], sandbox_id: str, *args: Any,
                     **kwargs: Any) -> Any:
        """``verb`` on the sandbox, restored first if it was hibernated (docs/live.md)."""
        await self._engine.wake(sandbox_id, owner=self._owner)
        return await verb(sandbox_id, *args, **kwargs, owner=self._owner)

    async def _stream_awake(self, sandbox_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        await self._engine.wake(sandbox_id, owner=self._owner)
        async for event in self._engine.exec_stream(sandbox_id, *args, **kwargs,
                                                    owner=self._owner):
            yield event

    # ------------------------------------------------------------ lifecycle

    def pause(self, sandbox_id: str) -> Any:
        return self._engine.pause(self._check(sandbox_id), owner=self._owner)

    def resume(self, sandbox_id: str) -> Any:
        return self._engine.resume(self._check(sandbox_id), owner=self._owner)

    def hibernate(self, sandbox_id: str) -> Any:
        return self._engine.hibernate(self._check(sandbox_id), owner=self._owner)

    def snapshot(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._engine.snapshot(self._check(sandbox_id), *args, **kwargs, owner=self._owner)

    def checkpoint(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._engine.checkpoint(self._check(sandbox_id), *args, **kwargs, owner=self._owner)

    def connect_port(self, sandbox_id: str, port: int) -> Any:
        return self._engine.connect_port(self._check(sandbox_id), port, owner=self._owner)

    def output_hold(self) -> OutputHold:
        """An empty hold of the caller's output budget (what a relay holds for it)."""
        return self._engine.output_budget.hold(self._engine.owners.of(self._owner))

    def network_events(self, sandbox_id: str) -> Any:
        return self._engine.network_events(self._check(sandbox_id), owner=self._owner)

    def usage(self, sandbox_id: str) -> Any:
        return self._engine.usage(self._check(sandbox_id), owner=self._owner)

    # ------------------------------------------------------------- commands

    def exec(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.exec, self._check(sandbox_id), *args, **kwargs)

    def start_exec(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """:meth:`exec`, its command started before this returns when the sandbox needs
        no waking (the EXEC frame on its way, its deadline armed:
        :meth:`~corral.runtime.engine_commands.CommandOps.start_exec`), else as
        :meth:`exec` (woken first, by whoever awaits). Await it, or ``close()`` it
        unawaited: a started command is killed."""
        sandbox_id = self._check(sandbox_id)
        if not self._engine.awake(sandbox_id):
            return self._awake(self._engine.exec, sandbox_id, *args, **kwargs)
        return self._engine.start_exec(sandbox_id, *args, **kwargs, owner=self._owner)

    def reserve_output(self, sandbox_id: str, max_output: int) -> OutputHold:
        """Room for a command's output in the caller's output budget, for a reply that
        holds it until sent (``exec(..., output_hold=)``, :class:`~corral.server.wire.HeldJSONResponse`)."""
        return self._engine.reserve_output(self._check(sandbox_id), max_output, owner=self._owner)

    def exec_stream(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._stream_awake(self._check(sandbox_id), *args, **kwargs)

    def spawn(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.spawn, self._check(sandbox_id), *args, **kwargs)

    def get_process(self, sandbox_id: str, process_id: str) -> Any:
        return self._engine.get_process(self._check(sandbox_id), process_id, owner=self._owner)

    def list_processes(self, sandbox_id: str) -> Any:
        return self._engine.list_processes(self._check(sandbox_id), owner=self._owner)

    def forget_process(self, sandbox_id: str, process_id: str) -> Any:
        return self._engine.forget_process(self._check(sandbox_id), process_id, owner=self._owner)

    def kill_processes(self, sandbox_id: str) -> Any:
        return self._engine.kill_processes(self._check(sandbox_id), owner=self._owner)

    # ---------------------------------------------------------------- files

    def read_file(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.read_file, self._check(sandbox_id), *args, **kwargs)

    async def read_file_held(self, sandbox_id: str, path: str, cap: int,
                             held: Callable[[int], int] = lambda n: n,
                             ) -> tuple[bytes, OutputHold]:
        """A file read whole into the daemon's memory for a reply (at most ``cap`` bytes:
        FileTooLarge), its room in the caller's output budget taken before it is read,
        sized by its ``stat`` (``held(n)`` for ``n`` bytes: its copies until the reply is
        written), lowered to what is free (it then reads less), then kept to what it
        read; the caller releases the hold once the reply is written.
        :class:`OutputBudgetExceeded` when the budget has room for less than the file."""
        info = await self.stat(sandbox_id, path)  # a link's own size: read as the cap
        size = cap if info.is_symlink else min(info.size + (64 << 10), cap)  # it may grow
        budget = self._engine.output_budget
        tenant = self._engine.owners.of(self._owner)
        while True:
            want, free = held(size), budget.free_for(tenant)
            if want > free and free < 2 * MIN_GRANT:  # refused as a command would be
                budget.reserve(tenant, max(want // 2, MIN_GRANT + 1), sandbox_id).release()
            hold = budget.hold(tenant)
            hold.fit(min(want, free))
            room = size if want <= free else free * size // max(1, want)
            try:
                data = bytes(await self.read_file(sandbox_id, path, max_bytes=min(cap, room)))
                break
            except FileTooLarge:
                hold.release()
                if room >= cap:
                    raise
                if want <= free:  # it grew since its stat: once more, as large as it may be
                    size = cap
                    continue
                raise OutputBudgetExceeded(
                    f"sandbox {sandbox_id}: reading {path[:200]!r}: the output budget had "
                    f"room for {room} bytes of it (the daemon's memory for output is taken "
                    "by requests in flight): retry when some have ended, or read less",
                    details={"sandbox_id": sandbox_id}) from None
            except BaseException:
                hold.release()
                raise
        hold.shrink(held(len(data)))
        return data, hold

    def write_file(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.write_file, self._check(sandbox_id), *args, **kwargs)

    def write_from(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.write_from, self._check(sandbox_id), *args, **kwargs)

    def open_read(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.open_read, self._check(sandbox_id), *args, **kwargs)

    def stat(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.stat, self._check(sandbox_id), *args, **kwargs)

    def list_dir(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.list_dir, self._check(sandbox_id), *args, **kwargs)

    def mkdir(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.mkdir, self._check(sandbox_id), *args, **kwargs)

    def remove(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._awake(self._engine.remove, self._check(sandbox_id), *args, **kwargs)
