"""sb.spawn: interactive processes through the SDK (blocking and asyncio)."""

from __future__ import annotations

import inspect

import pytest

import corral
from tests.client.conftest import astreamed_connection, streamed_connection
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

UPPER = (
    "import sys\n"
    "for line in sys.stdin:\n"
    "    sys.stderr.write('got ' + line)\n"
    "    sys.stdout.write(line.upper())\n"
    "    sys.stdout.flush()\n"
)


def test_write_readline_iterate_wait(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        with sb.spawn(["python3", "-c", UPPER]) as proc:
            assert isinstance(proc, corral.Process) and proc.sandbox_id == sb.id
            assert proc.id.startswith("proc-") and proc.pid > 1 and proc.returncode is None
            proc.write("one\n")
            assert proc.readline() == "ONE\n"
            proc.write(b"two\nthree\n")
            proc.close_stdin()
            assert list(proc) == ["TWO\n", "THREE\n"]
            result = proc.wait()
            assert isinstance(result, corral.CommandResult) and result.ok
            assert proc.returncode == 0 and proc.result is result
            assert proc.stderr == result.stderr == "got one\ngot two\ngot three\n"
            assert proc.readline() == ""  # end of output
            assert proc.refresh()["state"] == "exited"

        proc = sb.spawn("printf 'no newline'; echo err >&2; exit 5", text=False)
        chunks = list(proc.chunks())
        assert b"".join(c.data for c in chunks if c.stream == "stdout") == b"no newline"
        assert proc.result.returncode == 5 and proc.result.stderr == "err\n"

        proc = sb.spawn(["sleep", "60"])
        assert proc.kill().returncode == -9
        proc.signal("TERM")  # it has ended: nothing happens

        with sb.spawn(["sleep", "60"]) as proc:
            pass  # leaving the block killed it
        listed = sb.exec("cat /proc/[0-9]*/comm | grep -c '^sleep$' || true")
        assert listed.stdout == "0\n"


def test_exchange_and_exchange_all(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as a, \
            corral.Sandbox.create(memory_mb=128, client=client) as b:
        pa = a.spawn(["python3", "-c", UPPER])
        pb = b.spawn(["python3", "-c", UPPER], text=False)
        assert pa.exchange("ping\n") == "PING\n"
        assert corral.Process.exchange_all([(pa, "x\n"), (pb, b"y\n")]) == ["X\n", b"Y\n"]
        with pytest.raises(corral.ExecTimeout):
            pa.exchange("half", timeout=0.2)
        assert pa.exchange(" done\n") == "HALF DONE\n"
        pb.write(b"stream\n")
        assert pb.readline() == b"STREAM\n"
        assert pb.exchange(b"z\n") == b"Z\n"  # on the stream now: write + readline
        with pytest.raises(corral.InvalidState, match="streamed"):
            corral.Process.exchange_all([(pb, b"w\n")])  # cannot be batched any more
        pa.close_stdin()
        assert pa.exchange("") == ""  # exited
        assert pa.wait().stderr == "got ping\ngot x\ngot half done\n"  # kept for wait()
        pc = b.spawn(["cat"])
        with pytest.raises(corral.InvalidArgument):
            corral.Process.exchange_all([(pc, "1\n"), (pc, "2\n")])  # one item per process
        pb.close()


def test_consume_ends_the_process_and_its_sandbox(client):
    """proc.consume: the line, the exit, the sandbox deleted, in one request; typed
    errors for a bad argument or a streamed process (nothing deleted then)."""
    once = "import sys\nsys.stdout.write(sys.stdin.readline().upper()); print('left')\n"
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        proc = sb.spawn(["python3", "-c", once])
        with pytest.raises(corral.InvalidArgument):
            proc.consume("x\n", exit_timeout=None)  # type: ignore[arg-type]
        line, ended = proc.consume("ok\n", timeout=30)
        assert line == "OK\n" and ended.returncode == 0 and ended.stdout == "left\n"
        assert proc.result is ended  # ended: closing it sends no kill
        with pytest.raises(corral.SandboxNotFound):
            corral.Sandbox.connect(sb.id, client=client)
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        proc = sb.spawn(["python3", "-c", UPPER])
        proc.write("a\n")
        assert proc.readline() == "A\n"
        with pytest.raises(corral.InvalidState, match="streamed"):
            proc.consume("b\n")
        assert sb.exec(["true"]).ok  # refused: the sandbox stays
        proc.close()


def test_errors_are_typed(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        with pytest.raises(corral.InvalidArgument):
            sb.spawn([])
        with pytest.raises(corral.FileNotFound):
            sb.spawn(["true"], cwd="/no/such/dir")
        proc = sb.spawn(["cat"])
        proc.close_stdin()
        proc.wait()
        with pytest.raises(corral.InvalidState):
            proc.write("late\n")
        proc.close()
    with pytest.raises(corral.SandboxNotFound):
        sb.spawn(["true"])  # the sandbox was deleted
    with pytest.raises(corral.SandboxNotFound):
        proc.refresh()  # and its processes with it


async def test_async_process(aclient):
    sb = await corral.AsyncSandbox.create(memory_mb=128, client=aclient)
    try:
        async with await sb.spawn(["python3", "-c", UPPER]) as proc:
            assert isinstance(proc, corral.AsyncProcess)
            await proc.write("a\nb\n")
            assert await proc.readline() == "A\n"
            await proc.close_stdin()
            assert [line async for line in proc] == ["B\n"]
            assert (await proc.wait()).returncode == 0
        other = await sb.spawn(["python3", "-c", UPPER])
        assert await other.exchange("q\n") == "Q\n"
        assert await corral.AsyncProcess.exchange_all([(other, "r\n")]) == ["R\n"]
        assert (await other.kill()).returncode == -9
    finally:
        await sb.delete()


def test_reading_to_the_exit_keeps_the_connection(client):
    """After a process's exit the SDK reads its output reply to the end, so the next
    streamed call reuses that connection (closing it cost a new connection per process)."""
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        stream = streamed_connection(client)
        for _ in range(2):
            assert sb.spawn(["true"]).wait().returncode == 0
            assert streamed_connection(client) is stream


async def test_async_reading_to_the_exit_keeps_the_connection(aclient):
    sb = await corral.AsyncSandbox.create(memory_mb=128, client=aclient)
    try:
        stream = await astreamed_connection(aclient)
        for _ in range(2):
            proc = await sb.spawn("echo out; echo err >&2")
            result = await proc.wait()
            assert (result.stdout, result.stderr) == ("out\n", "err\n")
            assert await astreamed_connection(aclient) is stream
            assert await proc.readline() == ""
            with pytest.raises(corral.InvalidState):
                await proc.write("late\n")
    finally:
        await sb.delete()


def test_the_twins_match():
    renamed = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__",
               "__aiter__": "__iter__"}
    names = {renamed.get(n, n) for n in dir(corral.AsyncProcess)
             if not n.startswith("_") or n in renamed}
    assert names <= set(dir(corral.Process))
    assert inspect.iscoroutinefunction(corral.AsyncProcess.exchange)
    assert not inspect.iscoroutinefunction(corral.Process.exchange)
    assert inspect.iscoroutinefunction(corral.AsyncSandbox.spawn)
