"""The read end of a sandbox launcher's stderr: drained, capped, kept in memory.

The launcher, bwrap and the agent inside the sandbox write their messages to stderr.
That is a pipe, never a host file: a file would be a host descriptor held inside the
sandbox, which could be written past the sandbox's own ``disk_mb`` by whatever got
hold of it. The engine drains the pipe from its event loop and keeps only the last
:data:`KEEP_BYTES` (what a start failure or a death reason needs), counting the rest.
"""

from __future__ import annotations

import asyncio
import os

KEEP_BYTES = 64 << 10
READ_BYTES = 64 << 10
READS_PER_WAKEUP = 16  # then yield to the loop: a chatty writer cannot starve it


class LogTail:
    """Drains ``fd`` (taking ownership of it) and keeps the last ``keep`` bytes."""

    def __init__(self, fd: int, *, keep: int = KEEP_BYTES) -> None:
        self.fd = fd
        self.keep = keep
        self.dropped = 0  # bytes read and thrown away because they did not fit
        self._buf = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        os.set_blocking(fd, False)

    def start(self) -> None:
        """Drain from the running event loop from now on."""
        if self.fd >= 0 and self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.fd, self._drain)

    def _drain(self, reads: int = READS_PER_WAKEUP) -> None:
        for _ in range(reads):
            if self.fd < 0:
                return
            try:
                data = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every writer has gone
                self.close()
                return
            self._buf += data
            excess = len(self._buf) - self.keep
            if excess > 0:
                del self._buf[:excess]
                self.dropped += excess

    def text(self) -> str:
        """What is kept, after taking whatever is already waiting in the pipe."""
        self._drain(reads=self.keep // READ_BYTES + 2)
        text = self._buf.decode(errors="replace").strip()
        if self.dropped:
            text = f"[{self.dropped} earlier bytes dropped]\n{text}"
        return text

    def close(self) -> None:
        """Stop draining and close the pipe (idempotent; what was kept stays).

        Safe from any thread: off the loop's thread it is handed to the loop."""
        loop = self._loop
        if self.fd >= 0 and loop is not None and not loop.is_closed() and not _on(loop):
            loop.call_soon_threadsafe(self.close)
            return
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        if loop is not None and not loop.is_closed():
            loop.remove_reader(fd)
        os.close(fd)


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
