"""Fan-out with handles: blocking corral calls run on the bridge's worker threads.

Every call that takes a while has a ``*_future`` twin that returns at once with a
:class:`Handle`; :func:`submit` does the same for any function, which is the
natural unit for "one sandbox per completion"::

    def score(code: str) -> corral.CommandResult:
        with corral.Sandbox.create(image="python", timeout=120) as sb:
            sb.files.write("solution.py", code)
            return sb.exec(["python3", "solution.py"], timeout=10)

    handles = [corral.submit(score, code) for code in completions]
    for h in corral.as_completed(handles, timeout=600):
        print(h.result().returncode)

    sandboxes = [h.result() for h in [corral.Sandbox.create_future() for _ in range(8)]]
    runs = [sb.exec_future("python3 -c 'print(1)'") for sb in sandboxes]
    done, pending = corral.wait(runs, num_returns=4, timeout=30)

asyncio code needs none of this: ``asyncio.gather`` / ``asyncio.TaskGroup`` over
:class:`~corral.AsyncSandbox` calls fan out without threads.

They run on the worker threads of corral's one sync/async bridge
(:mod:`corral._bridge`); ``CORRAL_MAX_WORKERS`` (default 64) caps how many run at
once, further calls wait their turn.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, ParamSpec, TypeVar

from typing_extensions import Self  # typing's since 3.11 only

from corral._bridge import submit_blocking
from corral.client._models import Command, CommandResult, describe_command
from corral.errors import InvalidArgument

T = TypeVar("T")
P = ParamSpec("P")


class Handle(Generic[T]):
    """A call running in the background; :meth:`result` waits for its value.

    Wraps a :class:`concurrent.futures.Future` (:attr:`future`), so it also works with
    the standard library's tools.
    """

    __slots__ = ("_future", "label")

    def __init__(self, future: concurrent.futures.Future[T], label: str = "") -> None:
        self._future = future
        self.label = label

    @property
    def future(self) -> concurrent.futures.Future[T]:
        return self._future

    def result(self, timeout: float | None = None) -> T:
        """The call's return value, waiting up to ``timeout`` seconds (``None``: no
        limit); re-raises the call's exception; :class:`TimeoutError` if not done."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, or ``None`` if it returned (waits like :meth:`result`)."""
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel the call if it has not started yet; True if it was cancelled."""
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[[Handle[T]], object]) -> None:
        """Call ``fn(handle)`` when the call ends (at once if it has ended)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        f = self._future
        if not f.done():
            status = "running" if f.running() else "pending"
        elif f.cancelled():
            status = "cancelled"
        else:
            status = "failed" if f.exception() is not None else "done"
        return f"<Handle {self.label or '?'} {status}>"


def submit(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Handle[T]:
    """Run ``fn(*args, **kwargs)`` on one of corral's worker threads.

    >>> h = corral.submit(sum, [1, 2, 3])
    >>> h.result(timeout=5)
    6
    """
    label = getattr(fn, "__qualname__", None) or repr(fn)
    return Handle(submit_blocking(functools.partial(fn, *args, **kwargs)), label)


def as_completed(handles: Iterable[Handle[T]], *, timeout: float | None = None) -> Iterator[Handle[T]]:
    """Yield the handles as their calls end (fastest first).

    Raises :class:`TimeoutError` if some are still running ``timeout`` seconds after
    the call.
    """
    by_future: dict[concurrent.futures.Future[T], list[Handle[T]]] = {}
    for h in handles:
        by_future.setdefault(h.future, []).append(h)
    for future in concurrent.futures.as_completed(by_future, timeout=timeout):
        yield from by_future[future]


def wait(
    handles: Iterable[Handle[T]],
    *,
    num_returns: int | None = None,
    timeout: float | None = None,
) -> tuple[list[Handle[T]], list[Handle[T]]]:
    """Wait until ``num_returns`` calls (default: all) have ended, or ``timeout`` passed.

    Returns ``(done, pending)``: ``done`` holds at most ``num_returns`` handles, in the
    order they ended; ``pending`` holds the others, in the order given. A timeout is
    not an error: look at ``pending``.

    >>> done, pending = corral.wait(handles, num_returns=10, timeout=60)  # doctest: +SKIP
    """
    handles = list(handles)
    want = len(handles) if num_returns is None else num_returns
    if not 0 <= want <= len(handles):
        raise InvalidArgument(
            f"num_returns must be between 0 and the number of handles ({len(handles)}), "
            f"got {num_returns}"
        )
    done: list[Handle[T]] = []
    if want:
        try:
            for h in as_completed(handles, timeout=timeout):
                done.append(h)
                if len(done) == want:
                    break
        except TimeoutError:
            pass
    finished = {id(h) for h in done}
    return done, [h for h in handles if id(h) not in finished]


class SandboxFutures:
    """The ``*_future`` methods of :class:`~corral.Sandbox` (blocking API only)."""

    @classmethod
    def create_future(cls, *args: Any, **kwargs: Any) -> Handle[Self]:
        """:meth:`create` in the background: a :class:`Handle` to the new sandbox.

        >>> hs = [corral.Sandbox.create_future(image="python") for _ in range(200)]
        >>> sandboxes = [h.result() for h in hs]                      # doctest: +SKIP
        """
        create: Callable[..., Self] = cls.create  # type: ignore[attr-defined]  # Sandbox's
        return Handle(submit_blocking(functools.partial(create, *args, **kwargs)), f"{cls.__name__}.create")

    def exec_future(self, cmd: Command, **kwargs: Any) -> Handle[CommandResult]:
        """:meth:`exec` in the background: a :class:`Handle` to its result."""
        run: Callable[..., CommandResult] = self.exec  # type: ignore[attr-defined]  # Sandbox's
        label = f"exec {describe_command(cmd)} in {self.id}"  # type: ignore[attr-defined]  # mixin
        return Handle(submit_blocking(functools.partial(run, cmd, **kwargs)), label)


class AsyncSandboxFutures:
    """Nothing to add for asyncio: a coroutine already is a future.

    Fan out with ``await asyncio.gather(*(sb.exec(cmd) for sb in sandboxes))`` or an
    ``asyncio.TaskGroup``; ``asyncio.as_completed`` collects them as they finish.
    """
