"""The race of a request's work against its client's hang-up (server/context.py).

The work runs in a task of its own, raced against a hang-up watcher that is no task. Both must give
the work's result, its exception, a cancellation, and the client's hang-up exactly as
an awaited coroutine would: these run the helper on a real event loop with an ASGI
``receive`` of our own (no daemon needed).
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect, Request

from corral.server import context


class Peer:
    """An ASGI ``receive``: the body was read; then a hang-up when ``hang_up`` is set."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = asyncio.Event()
        if gone:
            self.gone.set()
        self.waiting = 0

    async def receive(self) -> dict[str, object]:
        self.waiting += 1
        try:
            await self.gone.wait()
        finally:
            self.waiting -= 1
        return {"type": "http.disconnect"}


def request_of(peer: Peer) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, peer.receive)


async def at_once(value: str = "sb-1") -> str:
    return value


async def after(ev: asyncio.Event, value: str = "sb-2") -> str:
    await ev.wait()
    return value


def test_work_done_at_once_leaves_nothing_behind():
    async def main() -> None:
        peer = Peer()
        before = len(asyncio.all_tasks())
        got = await context._race_disconnect(request_of(peer), at_once(), recheck=True)
        assert got == ("sb-1", False)
        assert len(asyncio.all_tasks()) == before  # no watcher left behind
        assert peer.waiting == 0  # the peek did not stay parked in receive
        # a hang-up the server read already is seen before the work starts: never run
        ran: list[bool] = []

        async def marks() -> str:
            ran.append(True)
            return "sb-1"

        with pytest.raises(ClientDisconnect):
            await context._race_disconnect(request_of(Peer(gone=True)), marks(), recheck=True)
        assert ran == []
    asyncio.run(main())


def test_a_deadline_the_work_enters_at_once_times_out_the_work_not_the_caller():
    """``asyncio.timeout`` (and 3.12's ``wait_for``) belongs to the task it is entered
    in: work stepped once by the caller and resumed in a task of its own had its
    deadline cancel the caller (CancelledError, no reply) instead of timing out."""
    async def slow_line() -> str:
        async with asyncio.timeout(0.05):
            await asyncio.Event().wait()
        return "never"

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await context.unless_disconnected(request_of(Peer()), slow_line())
        assert asyncio.current_task().cancelling() == 0
    asyncio.run(main())


def test_an_error_raised_at_once_reaches_the_caller():
    async def boom() -> str:
        raise KeyError("no such pool")

    async def main() -> None:
        with pytest.raises(KeyError):
            await context.unless_disconnected(request_of(Peer()), boom())
    asyncio.run(main())


def test_work_that_waits_is_resumed_with_its_result_and_errors():
    async def fails_later(ev: asyncio.Event) -> str:
        await ev.wait()
        raise ValueError("bad")

    async def main() -> None:
        ev = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, ev.set)
        assert await context.unless_disconnected(request_of(Peer()), after(ev)) == "sb-2"
        ev2 = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, ev2.set)
        with pytest.raises(ValueError):
            await context.unless_disconnected(request_of(Peer()), fails_later(ev2))
    asyncio.run(main())


def test_a_hang_up_cancels_work_that_waits():
    cleaned: list[bool] = []

    async def forever() -> str:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)  # the cancellation reached the work itself
        return "never"

    async def main() -> None:
        peer = Peer()
        asyncio.get_running_loop().call_later(0.01, peer.gone.set)
        with pytest.raises(ClientDisconnect):
            await context.unless_disconnected(request_of(peer), forever())
        task = asyncio.current_task()
        if hasattr(task, "cancelling"):  # 3.11+: the hang-up's cancel was taken back
            assert task.cancelling() == 0
        await asyncio.sleep(0)  # and none is left pending for the handler's next await
    asyncio.run(main())
    assert cleaned == [True]


def test_cancelling_the_caller_cancels_work_that_waits():
    cleaned: list[bool] = []

    async def forever() -> str:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)
        return "never"

    async def main() -> None:
        task = asyncio.ensure_future(context.unless_disconnected(request_of(Peer()), forever()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    assert cleaned == [True]


def test_a_sandbox_got_as_the_client_left_is_reported_gone():
    async def main() -> None:
        peer = Peer()
        ev = asyncio.Event()

        async def work() -> str:
            await ev.wait()
            peer.gone.set()  # the hang-up is read just as the sandbox is ready
            return "sb-3"

        asyncio.get_running_loop().call_later(0.01, ev.set)
        got = await context._race_disconnect(request_of(peer), work(), recheck=True)
        assert got == ("sb-3", True)
    asyncio.run(main())


def test_the_hang_up_is_watched_without_a_task():
    """The hang-up is watched through the future ``receive`` waits on: the work that
    waits has its task, the watcher none."""
    async def main() -> None:
        peer = Peer()
        before = len(asyncio.all_tasks())
        seen: list[int] = []

        async def work() -> str:
            await asyncio.sleep(0.01)
            seen.append(len(asyncio.all_tasks()))
            return "sb-4"

        assert await context.unless_disconnected(request_of(peer), work()) == "sb-4"
        assert seen == [before + 1]
        assert peer.waiting == 0  # the receive under way was closed, its waiter gone
        assert not peer.gone._waiters
    asyncio.run(main())


def test_a_message_before_the_hang_up_is_passed_over():
    """``receive`` may hand over a message nobody asked for (more body) first."""
    class Chatty(Peer):
        def __init__(self) -> None:
            super().__init__()
            self.sent = False

        async def receive(self) -> dict[str, object]:
            if not self.sent:
                self.sent = True
                await asyncio.sleep(0.005)
                return {"type": "http.request", "body": b"", "more_body": False}
            return await super().receive()

    async def forever() -> str:
        await asyncio.Event().wait()
        return "never"

    async def main() -> None:
        peer = Chatty()
        asyncio.get_running_loop().call_later(0.05, peer.gone.set)
        with pytest.raises(ClientDisconnect):
            await context.unless_disconnected(request_of(peer), forever())
    asyncio.run(main())


def test_a_receive_that_waits_on_no_future_is_watched_by_a_task():
    """Another server's ``receive`` (here: one that polls with ``sleep(0)``, which
    yields no future) is watched by a task, as before."""
    gone = {"now": False}

    async def polling() -> dict[str, object]:
        while not gone["now"]:
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def forever() -> str:
        await asyncio.Event().wait()
        return "never"

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.02, gone.update, {"now": True})
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, polling)
        with pytest.raises(ClientDisconnect):
            await context.unless_disconnected(request, forever())
        ev = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, ev.set)
        gone["now"] = False
        assert await context.unless_disconnected(request, after(ev)) == "sb-2"
    asyncio.run(main())


def test_a_caller_cancelled_again_and_again_lets_the_work_clean_up():
    """A revoked token's cancel scope cancels the handler again on every turn of the
    loop until it returns: the work is cancelled once, and its clean-up (here a wait,
    like a sandbox's delete) runs to its end."""
    cleaned: list[str] = []

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.02)  # awaited clean-up: never interrupted
            cleaned.append("deleted")
        return "never"

    async def main() -> None:
        handler = asyncio.ensure_future(context.unless_disconnected(request_of(Peer()), work()))
        await asyncio.sleep(0.01)
        while not handler.done():  # as anyio's cancel scope does
            handler.cancel()
            await asyncio.sleep(0)
        await asyncio.sleep(0.1)
    asyncio.run(main())
    assert cleaned == ["deleted"]


def test_work_under_way_before_its_task_ran_is_closed_when_the_client_left():
    """Work already under way when it is handed over (a command the exec route started
    in its handler: ``StartedExec``) is no coroutine; if the client had gone before its
    task's first step, its ``close()`` is still called (the command is killed), never
    left running unawaited."""

    class Started:
        def __init__(self) -> None:
            self.closed = False

        def __await__(self):  # type: ignore[no-untyped-def]
            return at_once().__await__()

        def close(self) -> None:
            self.closed = True

    async def main() -> None:
        work = Started()
        with pytest.raises(ClientDisconnect):
            await context._race_disconnect(request_of(Peer(gone=True)), work, recheck=False)
        assert work.closed
    asyncio.run(main())
