"""A cwsandbox exec cancelled while its command starts leaves no command behind, however
often it is cancelled (server/compat/cwsandbox_exec.py).

The call waits for the start it began and kills what started. A second cancel during
that wait (a revoke ends the call, then the client gives up on it too: cwsandbox waits
5 s for a command to start) cut the wait short, and the command, once started, ran on
with nobody to end it. Here the start is slow for certain, not by timing: the sandbox
is hibernated, so the command waits for its restore.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from corral.server.caller import Caller
from corral.server.compat import cwsandbox_exec
from corral.server.sandbox_verbs import SandboxVerbs
from corral.server.settings import ServerSettings
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(180)]


class _Watched(SandboxVerbs):
    """The engine's verbs, noting the process each spawn started (nothing else changes)."""

    started: list[Any]

    def spawn(self, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        async def noted() -> Any:
            proc = await SandboxVerbs.spawn(self, sandbox_id, *args, **kwargs)
            self.started.append(proc)
            return proc
        return noted()


class _Call:
    """The call's side the handler uses before the command starts: no deadline."""

    def time_remaining(self) -> None:
        return None


async def test_a_start_cancelled_twice_leaves_no_command(engine):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True)
    await engine.hibernate(sb.id)  # the next command waits for the restore
    verbs = _Watched(engine, Caller())
    verbs.started = []
    call = asyncio.ensure_future(cwsandbox_exec._interactive(
        verbs, ServerSettings(), _Call(), sb.id, ["sleep", "600"], {}))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # it waits for the start
    call.cancel()  # the revoke
    await asyncio.sleep(0)  # it waits for the start it began, to end what started
    call.cancel()  # the client gives up too
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(1200):  # (before: the call ended here, the start still going)
        if verbs.started:
            break
        await asyncio.sleep(0.05)
    [proc] = verbs.started
    # killed, not left to run its 600 s (before: this wait ran out)
    assert await asyncio.wait_for(proc.wait(), 60) is not None
    assert proc.returncode == -9
    await engine.delete(sb.id)
