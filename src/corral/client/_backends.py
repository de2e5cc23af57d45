"""What differs between the asyncio client and the blocking one, behind one interface.

The client is written once, as asyncio code under ``corral/client/_async/``, and
``scripts/gen_sync.py`` generates the blocking twin under ``_sync/`` by renaming
(``AsyncBackend`` → ``SyncBackend``, ``await x`` → ``x``, ...). What renaming cannot
express lives here, in two hand-written classes with the same methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
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
from corral.client._tarstream import AsyncTarBody, SyncTarBody

T = TypeVar("T")

_MAX_GATHER_THREADS = 32

# The client used when a call is given none: one per process (and per event loop for
# asyncio, whose connections belong to one loop). A cache, built on first use.
_shared_lock = threading.Lock()
_shared_sync: dict[Any, Any] = {}
_shared_async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Any]] = (
    weakref.WeakKeyDictionary()
)


def _shared_in(
    cache: dict[Any, Any], factory: type[T], kwargs: dict[str, Any], env: tuple[Any, ...] = ()
) -> T:
    # A forked child must not share its parent's sockets; ``env``: what the factory
    # reads from the environment, so that changing it gives another client.
    key = (os.getpid(), factory, tuple(sorted(kwargs.items())), env)
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


class AsyncPuller(Generic[T]):
    """The items of an async iterator, each awaited with a timeout. A wait that times
    out leaves its read pending, so the item it was waiting for is not lost: the next
    :meth:`next` gets it. ``None`` once the iterator is exhausted."""

    def __init__(self, items: AsyncIterator[T]) -> None:
        self._items = items
        self._pending: asyncio.Future[T] | None = None
        self._done = False

    async def next(self, timeout: float | None) -> T | None:
        """The next item; :class:`TimeoutError` if none comes within ``timeout`` s."""
        if self._done:
            return None
        if self._pending is None:
            self._pending = asyncio.ensure_future(anext(self._items))
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            raise TimeoutError
        pending, self._pending = self._pending, None
        try:
            return pending.result()
        except StopAsyncIteration:
            self._done = True
            return None

    async def aclose(self) -> None:
        self._done = True
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(BaseException):
                await self._pending
            self._pending = None
        closing = getattr(self._items, "aclose", None)
        if closing is not None:
            await closing()


class Puller(Generic[T]):
    """:class:`AsyncPuller` for a blocking iterator: a thread reads it one item ahead
    (a queue of one), so a wait can time out without losing what it waited for."""

    def __init__(self, items: Iterator[T]) -> None:
        self._items = items
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._done = False

    def _put(self, entry: tuple[bool, Any]) -> bool:
        """Hand ``entry`` to the reader; False once it stopped reading (closed)."""
        while not self._done:
            try:
                self._queue.put(entry, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        try:
            for item in self._items:
                if not self._put((True, item)):
                    return
            self._put((False, None))
        except BaseException as exc:  # handed to the reader
            self._put((False, exc))

    def next(self, timeout: float | None) -> T | None:
        """The next item; :class:`TimeoutError` if none comes within ``timeout`` s."""
        if self._done:
            return None
        if self._thread is None:
            self._thread = threading.Thread(target=self._read, name="corral-output", daemon=True)
            self._thread.start()
        try:
            ok, value = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if ok:
            return value  # type: ignore[no-any-return]
        self._done = True
        if value is not None:
            raise value
        return None

    def close(self) -> None:
        """Stop handing out items (the thread ends when its iterator does: the
        caller ends that, e.g. by killing the process whose output it reads)."""
        self._done = True
        with contextlib.suppress(queue.Empty):
            self._queue.get_nowait()  # unblock a thread waiting to put


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
    def shared(factory: type[T], env: tuple[Any, ...] = (), **kwargs: Any) -> T:
        """The shared ``factory(**kwargs)`` for this process, running event loop and
        ``env`` (the environment variables the factory reads, as they are now)."""
        loop = asyncio.get_running_loop()
        with _shared_lock:
            cache = _shared_async.setdefault(loop, {})
        return _shared_in(cache, factory, kwargs, env)

    @staticmethod
    def lock() -> asyncio.Lock:
        return asyncio.Lock()

    @staticmethod
    def puller(items: AsyncIterator[T]) -> AsyncPuller[T]:
        """``items`` read with timeouts that lose nothing (see :class:`AsyncPuller`)."""
        return AsyncPuller(items)

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
    async def tar_body(source: str | os.PathLike[str]) -> AsyncTarBody:
        """A directory or tarball as a tar, made as it is sent (:mod:`corral.client._tarstream`)."""
        return await asyncio.to_thread(AsyncTarBody, source)

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
    def shared(factory: type[T], env: tuple[Any, ...] = (), **kwargs: Any) -> T:
        """The shared ``factory(**kwargs)`` for this process and ``env``."""
        return _shared_in(_shared_sync, factory, kwargs, env)

    @staticmethod
    def lock() -> threading.Lock:
        return threading.Lock()

    @staticmethod
    def puller(items: Iterator[T]) -> Puller[T]:
        """``items`` read with timeouts that lose nothing (see :class:`Puller`)."""
        return Puller(items)

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
    def tar_body(source: str | os.PathLike[str]) -> SyncTarBody:
        """A directory or tarball as a tar, made as it is sent (:mod:`corral.client._tarstream`)."""
        return SyncTarBody(source)

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
