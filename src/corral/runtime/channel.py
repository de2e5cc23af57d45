"""The engine's end of the control channel to one sandbox's agent.

Requests are multiplexed by id over one socket: file operations wait for one reply,
commands receive a stream of events (started, stdout, stderr, exit).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Callable, Iterable

from corral.errors import SandboxLost
from corral.runtime.protocol import HEADER, Field, Fields, Msg, encode


class Reply:
    """One frame from the agent."""

    __slots__ = ("msg", "fields")

    def __init__(self, msg: int, fields: Fields) -> None:
        self.msg = msg
        self.fields = fields


class ExecStream:
    """Events of one running command, in the order the agent sent them."""

    def __init__(self, channel: "AgentChannel", request_id: int) -> None:
        self.channel = channel
        self.request_id = request_id
        self.queue: asyncio.Queue[Reply | BaseException] = asyncio.Queue()

    async def next(self) -> Reply:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def send_stdin(self, data: bytes) -> None:
        self.channel.send(Msg.STDIN, self.request_id, [(9, data)])

    def close_stdin(self) -> None:
        self.channel.send(Msg.STDIN_CLOSE, self.request_id)

    def signal(self, signum: int) -> None:
        self.channel.send(Msg.SIGNAL, self.request_id, [(16, signum)])

    def close(self) -> None:
        self.channel.streams.pop(self.request_id, None)


class AgentChannel:
    """Framed, multiplexed requests to one agent over a connected stream socket."""

    def __init__(self, sock: socket.socket, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.sock = sock
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        self.streams: dict[int, ExecStream] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed = False
        self.close_reason = "the sandbox's agent exited"
        self.on_close: Callable[[], None] | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=self.sock, limit=1 << 26
        )
        self._task = asyncio.create_task(self._read_loop(), name=f"agent-{self.sandbox_id}")

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                hdr = await self._reader.readexactly(HEADER.size)
                length, msg, rid = HEADER.unpack(hdr)
                payload = await self._reader.readexactly(length) if length else b""
                self._dispatch(Reply(msg, Fields(payload)), rid)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._fail_all()

    def _dispatch(self, reply: Reply, rid: int) -> None:
        if reply.msg == Msg.READY:
            if not self.ready.done():
                self.ready.set_result(None)
            return
        stream = self.streams.get(rid)
        if stream is not None:
            stream.queue.put_nowait(reply)
            if reply.msg in (Msg.EXIT, Msg.ERR):
                self.streams.pop(rid, None)
            return
        fut = self.pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _fail_all(self) -> None:
        if self.closed:
            return
        self.closed = True
        err = SandboxLost(
            f"sandbox {self.sandbox_id} is gone: {self.close_reason}",
            details={"sandbox_id": self.sandbox_id},
        )
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()  # mark retrieved
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()
        for stream in self.streams.values():
            stream.queue.put_nowait(err)
        self.streams.clear()
        if self.on_close:
            self.on_close()

    def _lost(self) -> SandboxLost:
        return SandboxLost(
            f"sandbox {self.sandbox_id} is gone: {self.close_reason}",
            details={"sandbox_id": self.sandbox_id},
        )

    def send(self, msg: int, rid: int, fields: Iterable[Field] = ()) -> None:
        if self.closed or self._writer is None:
            raise self._lost()
        self._writer.write(encode(msg, rid, fields))

    async def request(self, msg: int, fields: Iterable[Field] = ()) -> Reply:
        """Send one request and wait for its OK or ERR reply."""
        rid = next(self.ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            self.send(msg, rid, fields)
            assert self._writer is not None
            await self._writer.drain()
            return await fut
        finally:
            self.pending.pop(rid, None)

    def open_exec(self, fields: Iterable[Field]) -> ExecStream:
        rid = next(self.ids)
        stream = ExecStream(self, rid)
        self.streams[rid] = stream
        try:
            self.send(Msg.EXEC, rid, fields)
        except BaseException:
            self.streams.pop(rid, None)
            raise
        return stream

    async def drain(self) -> None:
        if self._writer is not None and not self.closed:
            await self._writer.drain()

    async def close(self) -> None:
        """Close our end: the agent sees EOF and exits, ending the sandbox."""
        if self._writer is not None:
            self._writer.close()
        else:
            self.sock.close()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        self._fail_all()
