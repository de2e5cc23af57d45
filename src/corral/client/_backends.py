"""What differs between the asyncio client and the blocking one, behind one interface.

The client is written once, as asyncio code under ``corral/client/_async/``, and
``scripts/gen_sync.py`` generates the blocking twin under ``_sync/`` by renaming
(``AsyncBackend`` → ``SyncBackend``, ``await x`` → ``x``, ...). What renaming cannot
express lives here, in two hand-written classes with the same methods.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, BinaryIO, Generic, Protocol, TypeVar

from typing_extensions import Self  # typing's since 3.11 only

from corral._bridge import in_parallel
from corral.client._body import AsyncFileBody, SyncFileBody

T = TypeVar("T")

_MAX_GATHER_THREADS = 32

# The client used when a call is given none: one per process (and per event loop for
# asyncio, whose connections belong to one loop). A cache, built on first use.
_shared_lock = threading.Lock()
_shared_sync: dict[Any, Any] = {}
_shared_async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Any]] = (
    weakref.WeakKeyDictionary()
)


def _shared_in(cache: dict[Any, Any], factory: type[T], kwargs: dict[str, Any]) -> T:
    # A forked child must not share its parent's sockets.
    key = (os.getpid(), factory, tuple(sorted(kwargs.items())))
    with _shared_lock:
        client = cache.get(key)
        if client is None or client.is_closed:
            client = cache[key] = factory(**kwargs)
        return client


class _AsyncOpenable(Protocol):
    """What :class:`AsyncOpening` opens: an async context manager entered as itself."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None, /,
    ) -> bool | None: ...


OpenedT = TypeVar("OpenedT", bound=_AsyncOpenable)


class AsyncOpening(Coroutine[Any, Any, OpenedT], Generic[OpenedT]):
    """What ``AsyncSandbox.create(...)`` returns: a coroutine to ``await`` for the
    sandbox, that is also an async context manager opening it, so both
    ``async with await AsyncSandbox.create()`` and ``async with AsyncSandbox.create()``
    work (and ``asyncio.create_task`` takes it, as any coroutine)."""

    def __init__(self, coro: Coroutine[Any, Any, OpenedT]) -> None:
        self._coro = coro
        self._opened: OpenedT | None = None

    def __await__(self) -> Generator[Any, None, OpenedT]:
        return self._coro.__await__()

    def send(self, value: Any) -> Any:
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        return self._coro.throw(*args)

    def close(self) -> None:
        self._coro.close()

    async def __aenter__(self) -> OpenedT:
        self._opened = await self._coro
        return await self._opened.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None, /,
    ) -> bool | None:
        assert self._opened is not None  # entered: __aenter__ opened it
        return await self._opened.__aexit__(exc_type, exc, tb)


Opening = Annotated[T, "the blocking twin of AsyncOpening: the value itself"]


class AsyncBackend:
    """asyncio implementations."""

    @staticmethod
    def opening(coro: Coroutine[Any, Any, OpenedT]) -> AsyncOpening[OpenedT]:
        """``coro``, awaitable and usable with ``async with`` (see :class:`AsyncOpening`)."""
        return AsyncOpening(coro)

    @staticmethod
    async def sleep(seconds: float) -> None:
        await asyncio.sleep(seconds)

    @staticmethod
    async def run_blocking(fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (file I/O, starting a daemon) without stalling the loop."""
        return await asyncio.to_thread(fn, *args)

    @staticmethod
    async def gather(calls: list[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
        """Run every call concurrently; each result or exception, in order."""
        return await asyncio.gather(*(c() for c in calls), return_exceptions=True)

    @staticmethod
    def shared(factory: type[T], **kwargs: Any) -> T:
        """The shared ``factory(**kwargs)`` for this process and running event loop."""
        loop = asyncio.get_running_loop()
        with _shared_lock:
            cache = _shared_async.setdefault(loop, {})
        return _shared_in(cache, factory, kwargs)

    @staticmethod
    def lock() -> asyncio.Lock:
        return asyncio.Lock()

    @staticmethod
    def run_in_constructor(fn: Callable[[], Awaitable[object]]) -> None:
        """I/O a constructor should do at once: ``__init__`` cannot await, so with
        asyncio it is left to the object's first awaited call."""

    @staticmethod
    async def read_file(path: str | os.PathLike[str]) -> bytes:
        return await asyncio.to_thread(Path(path).read_bytes)

    @staticmethod
    async def write_file(path: str | os.PathLike[str], data: bytes) -> None:
        await asyncio.to_thread(Path(path).write_bytes, data)

    @staticmethod
    async def file_body(path: str | os.PathLike[str]) -> AsyncFileBody:
        """A local file as a request body, read in pieces as it is sent."""
        return await asyncio.to_thread(AsyncFileBody, path)

    @staticmethod
    async def save(pieces: AsyncIterator[bytes], path: Path) -> None:
        """Write ``pieces`` to ``path`` as they come, through a temporary file beside
        it, so a failed download leaves nothing at ``path``."""
        f, tmp = await asyncio.to_thread(_open_beside, path)
        try:
            async for piece in pieces:
                await asyncio.to_thread(f.write, piece)
            await asyncio.to_thread(_finish, f, tmp, path)
        except BaseException:
            await asyncio.to_thread(_discard, f, tmp)
            raise


class SyncBackend:
    """Blocking implementations."""

    @staticmethod
    def opening(value: T) -> T:
        """The value itself: a blocking call has already opened it."""
        return value

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    @staticmethod
    def run_blocking(fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    @staticmethod
    def gather(calls: list[Callable[[], T]]) -> list[T | BaseException]:
        """Run every call on the bridge's threads; each result or exception, in order."""
        return in_parallel(calls, limit=_MAX_GATHER_THREADS)

    @staticmethod
    def shared(factory: type[T], **kwargs: Any) -> T:
        """The shared ``factory(**kwargs)`` for this process."""
        return _shared_in(_shared_sync, factory, kwargs)

    @staticmethod
    def lock() -> threading.Lock:
        return threading.Lock()

    @staticmethod
    def run_in_constructor(fn: Callable[[], object]) -> None:
        """I/O a constructor should do at once: the blocking client does it now."""
        fn()

    @staticmethod
    def read_file(path: str | os.PathLike[str]) -> bytes:
        return Path(path).read_bytes()

    @staticmethod
    def write_file(path: str | os.PathLike[str], data: bytes) -> None:
        Path(path).write_bytes(data)

    @staticmethod
    def file_body(path: str | os.PathLike[str]) -> SyncFileBody:
        """A local file as a request body, read in pieces as it is sent."""
        return SyncFileBody(path)

    @staticmethod
    def save(pieces: Iterator[bytes], path: Path) -> None:
        """Write ``pieces`` to ``path`` as they come (see :meth:`AsyncBackend.save`)."""
        f, tmp = _open_beside(path)
        try:
            for piece in pieces:
                f.write(piece)
            _finish(f, tmp, path)
        except BaseException:
            _discard(f, tmp)
            raise


def _open_beside(path: Path) -> tuple[BinaryIO, Path]:
    # O_EXCL on a fresh name, with the mode a plain open() gives (the umask applies)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.corral-part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "wb"), tmp


def _finish(f: BinaryIO, tmp: Path, path: Path) -> None:
    f.close()
    os.replace(tmp, path)


def _discard(f: BinaryIO, tmp: Path) -> None:
    f.close()
    tmp.unlink(missing_ok=True)
