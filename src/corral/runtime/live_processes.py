"""A live checkpoint's interactive processes, carried into its restored copies
(docs/live.md, "Processes in a copy").

A process started with ``spawn`` (an RL environment server, a REPL) talks to the engine
through the agent, by the id of its EXEC request. CRIU restores the agent with that
process, its pipes and its request id; the copy's engine must know them too, or the
agent's frames for it would be a protocol violation. So:

- at the checkpoint (the sandbox frozen) the engine writes :data:`FILE` next to CRIU's
  images: each running process's id, request id, command, pid, terminal, buffer size and
  the output nobody had read yet (its first :data:`UNREAD_KEPT` bytes: :func:`record`);
- at a restore it reads that record back as hostile input (:func:`read`: every field
  checked), names the request ids in the ``R`` message to the restored agent (which
  keeps those commands and forgets every other request: agent.c), registers their
  streams on the new channel before it reads a frame (:func:`adopt_streams`), and once
  the copy runs, puts a :class:`~corral.runtime.processes.Process` under the **same
  id** on the copy's record (:func:`adopt`): ``copy.process(id)`` writes to and reads
  from the copy's own server.

Output is carried whole: what the frozen agent had sent is read first (:func:`settle`),
what a copy's agent sends before it has its new channel is read from the socket CRIU
gave it (:func:`drain_old`). What is lost: bytes written to a process's stdin that the
agent had not read when the sandbox was frozen (request/reply servers, read to the
reply before the checkpoint, lose nothing), and the end of a frame larger than the
socket's room at the freeze. The engine does not enforce a spawn's ``timeout`` in a
copy (the agent still does).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import math
import os
import re
import socket
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.api.models import MAX_OUTPUT_LIMIT
from corral.errors import InvalidState
from corral.runtime.agentconn import Deadline
from corral.runtime.channel import AgentChannel, ExecStream
from corral.runtime.process_start import keep
from corral.runtime.processes import Process, ProcessEngine, ProcessState, kept
from corral.runtime.protocol import (
    HEADER,
    Fields,
    Msg,
    ProtocolViolation,
    check_header,
    validate,
)
from corral.runtime.terminal import TerminalSize

if TYPE_CHECKING:
    from corral.runtime.live import Live

FILE = "processes.json"
MAX_PROCESSES = 256  # the agent's MAX_EXECS
_ID = re.compile(r"^proc-[0-9a-f]{12}$")
_MAX_ARGV = 1 << 20
UNREAD_KEPT = 1 << 20  # a process's unread output a copy gets (the first bytes)
_MAX_FILE = 128 << 20
OLD_SOCKET_WAIT_S = 5.0  # drain_old: a restored agent's READY on its old socket
SETTLE_S = 1.0  # settle: the engine's read of what a frozen agent had sent


async def settle(live: Live, timeout: float = SETTLE_S) -> None:
    """Let the engine read what the (frozen) agent had sent before the freeze: that
    output is the processes' unread output in :func:`record`, not lost to the copies."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def pending() -> bool:  # in the socket, or read and not yet in a process's buffer
        return (live.channel is not None and live.channel.unread()) or any(
            not p._stream.queue.empty() for p in kept(live) if p.state == ProcessState.RUNNING)

    while pending() and loop.time() < deadline:
        await asyncio.sleep(0.001)


def record(live: Live) -> list[dict[str, Any]]:
    """The running processes of ``live`` (frozen), as a restore needs them."""
    out = []
    for proc in kept(live):
        if proc.state != ProcessState.RUNNING:
            continue
        unread, room = [], UNREAD_KEPT
        for c in proc._events:
            data = bytes(c.data[:room])
            room -= len(data)
            if data:
                unread.append([c.kind, base64.b64encode(data).decode()])
        out.append({
            "id": proc.id, "rid": proc._stream.request_id, "argv": list(proc.argv),
            "pid": proc.pid, "terminal": list(proc.terminal) if proc.terminal else None,
            "max_buffer": proc.max_buffer, "stdin_open": proc.stdin_open,
            "started_at": proc.started_at, "unread": unread,
        })
    return out


def write(images: Path, records: list[dict[str, Any]]) -> None:
    """Keep ``records`` with the checkpoint's images (root's, 0600, like them)."""
    fd = os.open(images / FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(records, f)


def read(images: Path) -> list[dict[str, Any]]:
    """The records of a checkpoint's processes (none for one taken before they were
    kept); :class:`InvalidState` if the file is not one this engine wrote."""
    path = images / FILE
    if not path.exists() and not path.is_symlink():
        return []
    try:  # never through a link, never a FIFO's open or read (the daemon's loop reads it)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_FILE:
                raise ValueError("not a plain file of a sane size")
            records = json.loads(f.read(_MAX_FILE + 1))
        if not isinstance(records, list) or len(records) > MAX_PROCESSES:
            raise ValueError("not a list of processes")
        seen: set[int] = set()
        for r in records:
            _check(r)
            if r["rid"] in seen:
                raise ValueError("a request id twice")
            seen.add(r["rid"])
            r["unread"] = [(kind, base64.b64decode(data, validate=True))
                           for kind, data in r["unread"]]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise InvalidState(f"{images}: its record of processes is damaged ({exc})") from None
    return records


def _check(r: Any) -> None:
    ok = (isinstance(r, dict) and isinstance(r["id"], str) and _ID.fullmatch(r["id"])
          and type(r["rid"]) is int and 0 < r["rid"] < 1 << 32
          and isinstance(r["argv"], list) and all(isinstance(a, str) for a in r["argv"])
          and sum(map(len, r["argv"])) <= _MAX_ARGV
          and type(r["pid"]) is int and r["pid"] > 0
          and (r["terminal"] is None or (isinstance(r["terminal"], list)
                                         and len(r["terminal"]) == 2
                                         and all(type(x) is int and 0 < x < 1 << 16
                                                 for x in r["terminal"])))
          and type(r["max_buffer"]) is int and 0 <= r["max_buffer"] <= MAX_OUTPUT_LIMIT
          and type(r["stdin_open"]) is bool
          and isinstance(r["started_at"], (int, float)) and math.isfinite(r["started_at"])
          and isinstance(r["unread"], list)
          and all(isinstance(u, list) and len(u) == 2 and u[0] in ("stdout", "stderr")
                  and isinstance(u[1], str) for u in r["unread"])
          and sum(len(u[1]) for u in r["unread"]) <= 2 * UNREAD_KEPT)  # base64: 4/3
    if not ok:
        raise ValueError("a process record of the wrong shape")


def reattach_message(records: list[dict[str, Any]]) -> bytes:
    """The ``R`` message's bytes: the byte, then each adopted request id (u32)."""
    return b"R" + struct.pack(f"<{len(records)}I", *(r["rid"] for r in records))


def adopt_streams(channel: AgentChannel, records: list[dict[str, Any]]) -> dict[int, ExecStream]:
    """Register the adopted commands' streams on the copy's channel (before it reads a
    frame: their output may follow READY at once); new request ids start past them."""
    streams = {}
    for r in records:
        stream = ExecStream(channel, r["rid"], None, 0, r["terminal"] is not None)
        stream.started = True  # its STARTED went to the original's engine
        channel.streams[r["rid"]] = stream
        streams[r["rid"]] = stream
    if records:
        top = max(r["rid"] for r in records)
        channel.last_id = max(channel.last_id, top)
        channel.ids = itertools.count(channel.last_id + 1)
    return streams


async def drain_old(old: socket.socket, channel: AgentChannel,
                    streams: dict[int, ExecStream], timeout: float = OLD_SOCKET_WAIT_S) -> None:
    """Read what the restored agent sent on the control socket CRIU gave it (output it
    had read from a process's pipe when it was frozen), up to the READY it sends there
    once it has its new channel (agent.c, ``R``): the adopted commands' output goes to
    their streams first, checked as on the new channel; any other request's is
    dropped; then ``old`` is closed. Anything that does not parse (the end of a frame
    the agent was half-way through when frozen, whose start went to the original's
    engine) ends the read there: what follows on it is lost, the copy is not. An agent
    of an older build sends no READY there: after ``timeout``, the same."""
    try:
        reader, writer = await asyncio.open_unix_connection(sock=old)
    except OSError:
        old.close()
        return
    try:
        async with asyncio.timeout(timeout):
            while True:
                length, msg, rid = HEADER.unpack(await reader.readexactly(HEADER.size))
                check_header(length, msg)  # before a byte of the payload is read
                payload = await reader.readexactly(length) if length else b""
                if msg == Msg.READY:
                    return
                stream = streams.get(rid)
                if stream is not None and channel.streams.get(rid) is stream:
                    fields = Fields(payload)
                    validate(msg, fields)
                    channel._on_stream(stream, msg, fields)
    except (TimeoutError, ProtocolViolation, asyncio.IncompleteReadError, OSError):
        pass
    except Exception:  # noqa: BLE001 - a frame our checks missed: still not one to trust
        pass
    finally:
        writer.transport.abort()


def adopt(engine: ProcessEngine, live: Live, records: list[dict[str, Any]],
          streams: dict[int, ExecStream]) -> None:
    """The copy runs: a :class:`Process` under each recorded id, pumping its stream."""
    for r in records:
        stream = streams[r["rid"]]
        proc = Process(engine, live, stream, r["argv"], pid=r["pid"],
                       max_buffer=r["max_buffer"], oom_before=live.cgroup.oom_kills(),
                       deadline=Deadline(live, stream, None),
                       terminal=TerminalSize(*r["terminal"]) if r["terminal"] else None)
        proc.id, proc.started_at, proc.stdin_open = r["id"], r["started_at"], r["stdin_open"]
        for kind, data in r["unread"]:
            proc._push(kind, data)
        keep(engine, live, proc)
