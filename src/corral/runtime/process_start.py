"""Starting an interactive process: the agent's EXEC request with stdin kept open, the
wait for its ``STARTED`` (or the error that says why not), and the hand-over of the
stream to a :class:`~corral.runtime.processes.Process` kept on the sandbox's record.
What a process does once it runs is :mod:`corral.runtime.processes`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from corral.api.process_models import DEFAULT_MAX_BUFFER
from corral.errors import InvalidArgument
from corral.runtime import channel as agent_channel
from corral.runtime.agentconn import (
    UNLIMITED_OUTPUT,
    Deadline,
    exec_error,
    limit_fields,
)
from corral.runtime.channel import StreamDeadline
from corral.runtime.processes import Process, ProcessEngine
from corral.runtime.protocol import Msg, Tag
from corral.runtime.terminal import TerminalSize, terminal_env, terminal_fields, terminal_size

if TYPE_CHECKING:
    from corral.runtime.live import Live as _Live


async def spawn(
    engine: ProcessEngine,
    live: _Live,
    cmd: str | Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    max_buffer: int = DEFAULT_MAX_BUFFER,
    terminal: TerminalSize | None = None,
    user: str | int | None = None,
) -> Process:
    """Start ``cmd`` in a running sandbox with its stdin open (see :meth:`Engine.spawn`),
    on a pseudo-terminal of that size if ``terminal`` is given."""
    if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 0:
        raise InvalidArgument(f"max_buffer must be >= 0 bytes, got {max_buffer!r}")
    if terminal is not None:
        terminal = terminal_size(*terminal)
        env = terminal_env(env, live.spec.env)
    fields = engine.command_fields(live, cmd, env, cwd, None,
                                   limit_fields(timeout, UNLIMITED_OUTPUT, 0), user)
    fields.append((Tag.STDIN_OPEN, 1))
    if terminal is not None:
        fields += terminal_fields(terminal)
    channel = live.channel
    assert channel is not None
    oom_before = live.cgroup.oom_kills()
    stream = channel.open_exec(fields, terminal=terminal is not None)
    limit = Deadline(live, stream, timeout)  # the timeout holds from now, agent or not
    try:
        try:
            await channel.drain()
            reply = await stream.next(limit.started + agent_channel.REQUEST_TIMEOUT_S)
        except StreamDeadline:
            raise channel.fault(
                "agent_unresponsive",
                f"its agent did not start a process within {agent_channel.REQUEST_TIMEOUT_S:g} s",
            ) from None
        if reply.msg != Msg.STARTED:  # the channel lets only STARTED or ERR come first
            raise exec_error(live.id, reply.fields, cwd)
    except BaseException:
        limit.cancel()
        stream.close()
        raise
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    proc = Process(
        engine, live, stream, argv, pid=reply.fields.u64(Tag.PID), max_buffer=max_buffer,
        oom_before=oom_before, deadline=limit, terminal=terminal,
    )
    keep(engine, live, proc)
    return proc


def keep(engine: ProcessEngine, live: _Live, proc: Process) -> None:
    """Keep ``proc`` on its sandbox's record (they end together) and pump its output."""
    live.processes[proc.id] = proc
    live.busy += 1
    task = asyncio.get_running_loop().create_task(proc._pump(), name=f"process-{proc.id}")
    engine._tasks.add(task)
    task.add_done_callback(engine._tasks.discard)
