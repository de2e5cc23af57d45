"""The engine's end of the control channel to one sandbox's agent.

Requests are multiplexed by id over one socket: file operations wait for one reply,
commands receive a stream of events (started, stdout, stderr, exit).

Nothing read here is trusted. The agent is pid 1 of a sandbox whose code is written by
a model optimised to earn reward, so whatever arrives may be forged (docs/api.md,
"Sandbox faults"). The reader therefore:

- refuses a frame from its header alone (unknown type, longer than its type's cap
  in :mod:`~corral.runtime.protocol`, or longer than a control frame where no open
  request may be answered with so much: :meth:`AgentChannel.admit`) before reading
  its payload;
- checks every field (:func:`~corral.runtime.protocol.validate`);
- accepts frames only for requests it sent and that are still open, in order: a
  command gets one STARTED (or one ERR; one started with ``quiet_start`` may go straight
  to its output or EXIT, whose first frame then counts as the start), then output (per
  stream: its head, at most one TAIL and its tail; stdout only, if it runs on a
  terminal), then exactly one EXIT; a
  file operation exactly one OK or ERR. Anything else (a second EXIT, output after the
  exit, a reply to a request never made) is a violation;
- counts each command's output itself: more than ``max_output`` bytes of a stream, or
  a tail out of place, is a violation (:mod:`~corral.runtime.outputcap`; the agent's
  truncated flags are not read);
- bounds every wait: a request gets no answer within :data:`REQUEST_TIMEOUT_S` →
  the agent is unresponsive.

A violation, an unresponsive agent, or an agent that hangs up without being asked is
the sandbox's own doing: every waiter gets :class:`~corral.errors.SandboxProtocolError`
and :attr:`AgentChannel.reason` (``"sandbox fault: ..."``) says why the engine ended it.
Only an end the engine asked for, or a sandbox whose processes were killed from the
host, is :class:`~corral.errors.SandboxLost` (see :func:`eof_cause`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import select
import socket
import subprocess
from typing import TYPE_CHECKING, Callable, Iterable

from corral.errors import SANDBOX_FAULT, CorralError, SandboxLost, SandboxProtocolError
from corral.runtime.agent_exit import eof_cause
from corral.runtime.agent_exit import wait_exit as wait_exit  # engine.py imports it from here
from corral.runtime.agent_wire import AgentWire
from corral.runtime.cgroups import Cgroup
from corral.runtime.outputcap import StreamCap
from corral.runtime.protocol import (
    FIELD,
    Field,
    Fields,
    Msg,
    ProtocolViolation,
    Reply,
    Tag,
    encode,
    validate,
)

if TYPE_CHECKING:
    from corral.runtime.output_room import OutputRoom

logger = logging.getLogger("corral.runtime")

REQUEST_TIMEOUT_S = 60.0
"""How long a file operation (or a write to the agent) may go unanswered: then the
agent is unresponsive and the sandbox is ended."""
SLOW_REQUEST_TIMEOUT_S: dict[int, float] = {Msg.FREMOVE: 330.0}
"""Requests the agent may legitimately work on longer (a recursive remove of a huge
tree runs in a child of the agent, killed after 300 s)."""
READER_LIMIT = 256 << 10
"""The most bytes one read of the agent's socket returns (asyncio's): the wire holds at
most a partial frame plus this (:mod:`~corral.runtime.agent_wire`)."""


class StreamDeadline(Exception):
    """The deadline given to :meth:`ExecStream.next` passed with nothing to return."""


# Requests whose OK may be longer than a control frame (AgentChannel.admit), and what
# an FREAD's OK holds beside its data (its SIZE and DATA fields' headers, SIZE's value)
_LARGE_REPLIES = frozenset({Msg.FREAD, Msg.FLIST, Msg.FSTAT})
_FREAD_OVERHEAD = 2 * FIELD.size + 8

# The frames that say a command asked to start quietly (Tag.QUIET_START) has started.
_STARTS_QUIETLY = frozenset({Msg.STDOUT, Msg.STDERR, Msg.TAIL, Msg.EXIT})


class ExecStream:
    """Events of one running command, in the order the agent sent them.

    ``max_output`` (None: no cap) bounds the bytes received per stream, of which the
    last ``output_tail`` are its tail (:mod:`~corral.runtime.outputcap`): an agent
    flooding output is stopped at the cap, and costs the daemon no memory past it. A
    command on a pseudo-terminal (``terminal``) has one output stream: a STDERR frame
    for it is a violation.
    """

    def __init__(
        self, channel: "AgentChannel", request_id: int, max_output: int | None,
        output_tail: int = 0,
        terminal: bool = False,
        quiet_start: bool = False,
    ) -> None:
        self.channel = channel
        self.request_id = request_id
        self.max_output = max_output
        self.terminal = terminal
        self.queue: asyncio.Queue[Reply | BaseException] = asyncio.Queue()
        self.started = False
        # asked for no STARTED (Tag.QUIET_START): the first output or EXIT says it started
        # (an agent older than the tag sends STARTED all the same: accepted)
        self.quiet_start = quiet_start
        self.abandoned = False  # closed by its reader: frames still expected, dropped
        self.caps: dict[int, StreamCap] = {
            Msg.STDOUT: StreamCap("stdout", max_output, output_tail),
            Msg.STDERR: StreamCap("stderr", max_output, output_tail),
        }
        self.queued_bytes = 0  # output waiting in the queue
        self.peak_queued = 0
        self.room: OutputRoom | None = None  # its room in the output budget (output_room.py)

    @property
    def stdout(self) -> StreamCap:
        return self.caps[Msg.STDOUT]

    @property
    def stderr(self) -> StreamCap:
        return self.caps[Msg.STDERR]

    def _put(self, item: Reply | BaseException) -> None:
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)
            return
        for reply in self.room.admit(item) if self.room is not None else (item,):
            self.queued_bytes += len(reply.data)
            self.peak_queued = max(self.peak_queued, self.queued_bytes)
            self.queue.put_nowait(reply)

    async def next(self, deadline: float | None = None) -> Reply:
        """The next event; :class:`StreamDeadline` if none came by ``deadline``
        (``loop.time()`` seconds). Events already queued are returned at once."""
        if self.queue.empty() and deadline is not None:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await self.queue.get()
            except TimeoutError:
                raise StreamDeadline from None
        else:
            item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.queued_bytes -= len(item.data)
        if self.room is not None:
            self.room.handed(item)
        return item

    def send_stdin(self, data: bytes | memoryview) -> None:
        self.channel.send(Msg.STDIN, self.request_id, [(Tag.DATA, data)])

    def close_stdin(self) -> None:
        self.channel.send(Msg.STDIN_CLOSE, self.request_id)

    def signal(self, signum: int) -> None:
        self.channel.send(Msg.SIGNAL, self.request_id, [(Tag.SIGNAL, signum)])

    def resize(self, rows: int, cols: int) -> None:
        self.channel.send(Msg.RESIZE, self.request_id, [(Tag.ROWS, rows), (Tag.COLS, cols)])

    def close(self) -> None:
        """Stop reading: what still comes for it (up to its exit) is dropped."""
        if self.channel.streams.get(self.request_id) is self:
            if self.channel.closed:
                self.channel.streams.pop(self.request_id, None)
            self.abandoned = True
        if not self.queue.empty():
            self.queue = asyncio.Queue()
        self.queued_bytes = 0


class _Pending:
    """A request waiting for its OK or ERR."""

    __slots__ = ("msg", "future", "max_data")

    def __init__(self, msg: int, future: asyncio.Future[Reply], max_data: int | None) -> None:
        self.msg = msg
        self.future = future
        self.max_data = max_data


class AgentChannel:
    """Framed, multiplexed requests to one agent over a connected stream socket.

    ``proc`` (the sandbox's outer process, a child of the engine) and ``cgroup`` tell
    why the agent hung up, if it does (:func:`eof_cause`).
    """

    def __init__(
        self, sock: socket.socket, sandbox_id: str, *,
        proc: subprocess.Popen[bytes] | None = None,
        cgroup: Cgroup | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.sock = sock
        self.proc = proc
        self.cgroup = cgroup
        self.ids = itertools.count(1)
        self.last_id = 0
        self.pending: dict[int, _Pending] = {}
        self.streams: dict[int, ExecStream] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed = False  # nothing more is sent
        self.closing = False  # the engine closed it (an end it asked for)
        self.error: CorralError | None = None  # what every waiter got once it ended
        self.reason = "the sandbox's agent exited"  # why it ended, for the sandbox's record
        self.on_close: Callable[[], None] | None = None
        self._wire: AgentWire | None = None
        self._transport: asyncio.Transport | None = None
        self._gone: asyncio.Future[None] | None = None  # the hang-up told apart

    @property
    def received(self) -> int:
        """Bytes read from the agent."""
        return self._wire.received if self._wire is not None else 0

    @property
    def peak_buffered(self) -> int:
        """The most bytes the wire held at once."""
        return self._wire.peak_buffered if self._wire is not None else 0

    @property
    def faulted(self) -> bool:
        """True if the sandbox ended the channel by its own doing."""
        return isinstance(self.error, SandboxProtocolError)

    def unread(self) -> bool:
        """Whether the agent sent bytes not handed on yet (part of a frame held by the
        wire, or still in the socket): after the engine's loop stalled, a timer can run
        in the turn that sees them arrive, before the read's callback."""
        if self._wire is not None and self._wire.buffered():
            return True
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing there (EAGAIN), or the socket is closed
            return False

    def connected(self) -> bool:
        """Whether the agent's end is open and idle, asked of the kernel without a round
        trip (microseconds; the agent is not woken): it answered READY, no request is
        open, nothing it sent waits unread, and its end of the socket is not shut. An
        agent that exited — however it died, OOM kill or SIGKILL included — had its end
        closed by the kernel when it exited, so this is False from that moment on, even
        before the read loop has run. Not proof that it *serves* (a stopped agent is
        still connected): that takes :meth:`request`."""
        if self.error is not None or self.closed or not self.ready.done() \
                or self.pending or self.streams:
            return False
        if self._wire is not None and self._wire.buffered():
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLPRI | select.POLLRDHUP)
        try:  # POLLHUP and POLLERR are always reported
            return not poller.poll(0)
        except OSError:
            return False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._gone = loop.create_future()
        wire = AgentWire(self._on_frame, self._on_fault, self._on_lost, self.admit)
        self._transport, self._wire = await loop.create_unix_connection(lambda: wire, sock=self.sock)

    # ------------------------------------------------------------------ reading

    def _on_frame(self, msg: int, rid: int, fields: Fields) -> None:
        if self.error is None:
            self._dispatch(msg, rid, fields)

    def _on_fault(self, exc: BaseException) -> None:
        if isinstance(exc, ProtocolViolation):
            self.fault(exc.code, f"protocol violation: {exc.message}")
            return
        logger.error("sandbox %s: unexpected frame", self.sandbox_id, exc_info=exc)
        self.fault("malformed_frame", f"protocol violation: a malformed frame ({exc!r})")

    def _on_lost(self) -> None:
        task = asyncio.ensure_future(self._hung_up())
        gone = self._gone

        def told(_: object) -> None:
            if gone is not None and not gone.done():
                gone.set_result(None)

        task.add_done_callback(told)

    async def _hung_up(self) -> None:
        """The agent's end closed. Unless the engine asked for it, find out who did."""
        if self.error is not None:
            return
        if self.closing or not self.ready.done():
            # An end the engine asked for, or a start that failed (no code of the
            # sandbox's has run before READY): the machine's, not the sandbox's.
            self._end(SandboxLost(
                f"sandbox {self.sandbox_id} is gone: {self.reason}",
                details={"sandbox_id": self.sandbox_id},
            ), self.reason)
            return
        self.closed = True
        infrastructure, why = await eof_cause(self.proc, self.cgroup)
        if infrastructure:
            self._end(SandboxLost(
                f"sandbox {self.sandbox_id} is gone: {why}", details={"sandbox_id": self.sandbox_id}
            ), why)
        else:
            self.fault("agent_disconnected", why)

    def admit(self, msg: int, rid: int, length: int) -> None:
        """A frame of ``length`` bytes (more than a control frame) is coming for ``rid``:
        :class:`ProtocolViolation` at its header unless an open request may get that
        much (a command's output, at most its type's cap; an FREAD's reply, its data
        asked for; a listing's or a stat's). Else a hostile agent made the daemon hold
        up to :data:`~corral.runtime.protocol.MAX_FRAME` a sandbox, outside any budget,
        until the frame's last byte showed that nobody had asked for it."""
        if rid in self.streams:
            return  # output: bounded by its type's cap (check_header) and its stream's
        pending = self.pending.get(rid)
        if pending is None:
            self._unasked(msg, rid)
        elif msg != Msg.OK or pending.msg not in _LARGE_REPLIES:
            raise ProtocolViolation(
                "frame_too_large", f"a {Msg(msg).name} frame of {length} bytes answering "
                f"a {Msg(pending.msg).name} request, which is never answered with so much")
        elif pending.msg == Msg.FREAD and pending.max_data is not None \
                and length > pending.max_data + _FREAD_OVERHEAD:
            raise ProtocolViolation(
                "frame_too_large", f"an FREAD reply of {length} bytes where "
                f"{pending.max_data} bytes of data were asked")

    def _unasked(self, msg: int, rid: int) -> None:
        """A frame for ``rid``, which is no open request: the violation it is."""
        if rid == 0 or rid > self.last_id:
            raise ProtocolViolation(
                "unknown_request",
                f"a {Msg(msg).name} frame for request {rid}, which the engine never sent",
            )
        raise ProtocolViolation(
            "finished_request",
            f"a {Msg(msg).name} frame for request {rid}, which had already ended "
            "(a second exit, or output after the exit)",
        )

    def _dispatch(self, msg: int, rid: int, fields: Fields) -> None:
        if msg == Msg.READY:
            if rid != 0 or self.ready.done():
                raise ProtocolViolation("unexpected_ready", f"a READY frame for request {rid}")
            validate(msg, fields)
            self.ready.set_result(None)
            return
        stream = self.streams.get(rid)
        if stream is not None:
            validate(msg, fields)
            self._on_stream(stream, msg, fields)
            return
        pending = self.pending.get(rid)
        if pending is not None:
            if msg not in (Msg.OK, Msg.ERR):
                raise ProtocolViolation(
                    "unexpected_reply",
                    f"a {Msg(msg).name} frame answering a {Msg(pending.msg).name} request",
                )
            validate(msg, fields, pending.msg, pending.max_data)
            del self.pending[rid]
            if not pending.future.done():  # not abandoned by its caller
                pending.future.set_result(Reply(msg, fields))
            return
        self._unasked(msg, rid)

    def _on_stream(self, stream: ExecStream, msg: int, fields: Fields) -> None:
        rid = stream.request_id
        data = b""
        if stream.quiet_start and not stream.started and msg in _STARTS_QUIETLY:
            stream.started = True  # its first output or exit: it started (checked below)
        if msg == Msg.STARTED:
            if stream.started:
                raise ProtocolViolation("duplicate_started", f"a second STARTED for request {rid}")
            stream.started = True
        elif msg in (Msg.STDOUT, Msg.STDERR):
            if not stream.started:
                raise ProtocolViolation(
                    "output_before_start", f"output for request {rid} before its STARTED"
                )
            if msg == Msg.STDERR and stream.terminal:
                raise ProtocolViolation(
                    "stderr_on_terminal", f"a STDERR frame for request {rid}, which runs on a terminal"
                )
            data = fields.raw(Tag.DATA)
            stream.caps[msg].feed(len(data))
            if not data:
                return
        elif msg == Msg.TAIL:
            if not stream.started:
                raise ProtocolViolation("output_before_start", f"a TAIL for request {rid} before its STARTED")
            which = Msg.STDOUT if fields.u64(Tag.STREAM) == 1 else Msg.STDERR
            stream.caps[which].skip(fields.u64(Tag.DROPPED))
        elif msg == Msg.EXIT:
            if not stream.started:
                raise ProtocolViolation("exit_before_start", f"an EXIT for request {rid} before its STARTED")
            for cap in stream.caps.values():
                cap.end()
        elif msg == Msg.ERR:
            if stream.started:
                raise ProtocolViolation("error_after_start", f"an ERR for request {rid} after its STARTED")
        else:
            raise ProtocolViolation(
                "unexpected_reply", f"a {Msg(msg).name} frame for command request {rid}"
            )
        if msg in (Msg.EXIT, Msg.ERR):
            del self.streams[rid]  # exactly one end: anything later is a violation
        if not stream.abandoned:
            stream._put(Reply(msg, fields, data))

    # ----------------------------------------------------------------- ending

    def fault(self, violation: str, what: str) -> CorralError:
        """End the channel as the sandbox's fault; the error every waiter gets (a
        :class:`SandboxProtocolError`, unless the channel had ended already: its error)."""
        if self.error is None:
            reason = SANDBOX_FAULT + what
            self._end(SandboxProtocolError(
                f"sandbox {self.sandbox_id} was ended: {reason}",
                details={"sandbox_id": self.sandbox_id, "violation": violation},
            ), reason)
        return self.error_copy()

    def error_copy(self) -> CorralError:
        """A fresh instance of the error the channel ended with (one per raise)."""
        err = self.error
        assert err is not None
        return type(err)(err.message, details=err.details)

    def _end(self, err: CorralError, reason: str) -> None:
        if self.error is not None:
            return
        self.error, self.reason, self.closed = err, reason, True
        if self._wire is not None:
            self._wire.stop()  # read nothing more from it
        if self._transport is not None:
            self._transport.abort()
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()  # mark retrieved
        for pending in self.pending.values():
            if not pending.future.done():
                pending.future.set_exception(self.error_copy())
        self.pending.clear()
        for stream in self.streams.values():
            if not stream.abandoned:
                stream._put(self.error_copy())
        self.streams.clear()
        if self.on_close:
            self.on_close()

    # ----------------------------------------------------------------- sending

    def send(self, msg: int, rid: int, fields: Iterable[Field] = ()) -> None:
        if self.error is not None or self._transport is None:
            raise self.error_copy() if self.error is not None else SandboxLost(
                f"sandbox {self.sandbox_id} is not connected", details={"sandbox_id": self.sandbox_id}
            )
        if not self.closed:  # closed without an error yet: the end is being told apart
            self._transport.write(encode(msg, rid, fields))

    def _next_id(self) -> int:
        self.last_id = next(self.ids)
        return self.last_id

    async def request(
        self, msg: int, fields: Iterable[Field] = (), *, max_data: int | None = None
    ) -> Reply:
        """Send one request and wait for its OK or ERR reply (an FREAD's data at most
        ``max_data`` bytes). An agent that does not answer in time is a fault."""
        rid = self._next_id()
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.pending[rid] = _Pending(msg, fut, max_data)
        try:
            self.send(msg, rid, fields)
        except BaseException:
            self.pending.pop(rid, None)
            raise
        timeout = SLOW_REQUEST_TIMEOUT_S.get(msg, REQUEST_TIMEOUT_S)
        try:
            while True:  # ends with the reply, the channel's end, or a fault
                try:
                    async with asyncio.timeout(timeout):
                        await self._drain()
                        return await asyncio.shield(fut)
                except TimeoutError:
                    if not self._frozen():
                        fut.cancel()  # this caller gets the fault itself
                        raise self.fault(
                            "agent_unresponsive",
                            f"its agent did not answer a {Msg(msg).name} request within "
                            f"{timeout:g} s",
                        ) from None
        except asyncio.CancelledError:
            fut.cancel()  # the entry stays: the late reply is checked, then dropped
            raise

    def open_exec(
        self,
        fields: Iterable[Field],
        *,
        max_output: int | None = None,
        output_tail: int = 0,
        terminal: bool = False,
        quiet_start: bool = False,
    ) -> ExecStream:
        """Start a command (``fields``: its EXEC fields); ``quiet_start``: the agent sends
        no STARTED (nobody waits for it: one frame and one wake-up fewer per command)."""
        rid = self._next_id()
        stream = ExecStream(self, rid, max_output, output_tail, terminal, quiet_start)
        self.streams[rid] = stream
        if quiet_start:
            fields = [*fields, (Tag.QUIET_START, b"")]
        try:
            self.send(Msg.EXEC, rid, fields)
        except BaseException:
            self.streams.pop(rid, None)
            raise
        return stream

    async def _drain(self) -> None:
        if self._wire is not None and not self.closed:
            try:
                await self._wire.drain()
            except (ConnectionError, OSError):
                pass  # the agent hung up: the reader finds out why and fails the waiters

    async def drain(self) -> None:
        """Wait until what was sent is on its way; a fault if the agent stops reading."""
        while True:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    await self._drain()
                break
            except TimeoutError:
                if not self._frozen():
                    raise self.fault(
                        "agent_unresponsive",
                        f"its agent read nothing from the engine for {REQUEST_TIMEOUT_S:g} s",
                    ) from None
        if self.error is not None:
            raise self.error_copy()

    def _frozen(self) -> bool:
        """The engine froze the sandbox (pause, snapshot): its agent cannot answer."""
        try:
            return self.cgroup is not None and bool(self.cgroup.frozen())
        except (OSError, CorralError):
            return False

    async def close(self) -> None:
        """Close our end: the agent sees EOF and exits, ending the sandbox."""
        self.closing = True
        if self._transport is not None:
            self._transport.close()
        else:
            self.sock.close()
        if self._gone is not None and self._transport is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._gone), 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        self._end(SandboxLost(
            f"sandbox {self.sandbox_id} is gone: {self.reason}",
            details={"sandbox_id": self.sandbox_id},
        ), self.reason)
