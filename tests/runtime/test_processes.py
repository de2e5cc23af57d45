"""Interactive processes in the engine: stdin kept open, output read as it comes."""

from __future__ import annotations

import asyncio
import hashlib
import signal

import pytest

from corral.errors import (
    ExecTimeout,
    FileNotFound,
    InvalidArgument,
    InvalidState,
    NotFound,
    SandboxLost,
    SandboxNotFound,
)
from corral.runtime import processes
from corral.runtime.processes import ProcessState, parse_signal
from corral.schema import SandboxState
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

UPPER = (
    "import sys\n"
    "for line in sys.stdin:\n"
    "    sys.stdout.write(line.upper())\n"
    "    sys.stdout.flush()\n"
)


async def collect(proc) -> tuple[bytes, bytes, object]:
    out, err = [], []
    async for event in proc.output():
        if event.kind == "exit":
            return b"".join(out), b"".join(err), event.result
        (out if event.kind == "stdout" else err).append(event.data)
    raise AssertionError("no exit event")


async def test_conversation_then_exit(engine):
    info = await engine.create()
    proc = await engine.spawn(info.id, ["python3", "-c", UPPER], env={"X": "1"}, cwd="/tmp")
    assert proc.id.startswith("proc-") and proc.pid > 1 and proc.state == ProcessState.RUNNING
    assert engine.get_process(info.id, proc.id) is proc
    assert [p.id for p in engine.list_processes(info.id)] == [proc.id]
    for word in (b"one", b"two", b"three"):
        await proc.write(word + b"\n")
        assert await proc.readline() == word.upper() + b"\n"
    await proc.write("half a ")
    await proc.write("line\n")
    assert await proc.readline() == b"HALF A LINE\n"
    await proc.close_stdin()
    await proc.close_stdin()  # idempotent
    result = await proc.wait()
    assert (result.returncode, result.timed_out, result.stdout) == (0, False, b"")
    assert proc.state == ProcessState.EXITED and proc.returncode == 0
    info_json = proc.info()
    assert info_json["state"] == "exited" and info_json["stdin_open"] is False
    assert info_json["cmd"] == ["python3", "-c", UPPER]
    assert await proc.readline() == b""  # exited, everything read
    with pytest.raises(InvalidState, match="has exited"):
        await proc.write(b"late\n")


async def test_output_events_and_wait_takes_unread_output(engine):
    info = await engine.create()
    proc = await engine.spawn(info.id, "echo out; echo err >&2; exit 3")
    out, err, result = await collect(proc)
    assert (out, err, result.returncode) == (b"out\n", b"err\n", 3)
    # A second reader after the exit still gets the exit.
    assert [e.kind async for e in proc] == ["exit"]

    proc = await engine.spawn(info.id, "printf 'a\\nb'; echo c >&2")
    result = await proc.wait()
    assert (result.stdout, result.stderr) == (b"a\nb", b"c\n")


async def test_large_input_and_output_keep_order(engine):
    info = await engine.create()
    data = bytes(range(256)) * 12288  # 3 MiB: several stdin frames, many output chunks
    proc = await engine.spawn(info.id, ["cat"], max_buffer=8 << 20)
    await proc.write(data)
    await proc.close_stdin()
    out, err, result = await collect(proc)
    assert hashlib.sha256(out).digest() == hashlib.sha256(data).digest()
    assert (err, result.returncode, result.stdout_truncated) == (b"", 0, False)


async def test_signals_kill_and_timeout(engine):
    info = await engine.create()
    proc = await engine.spawn(info.id, ["sleep", "60"])
    assert proc.signal("SIGTERM") is True
    result = await proc.wait()
    assert result.returncode == -signal.SIGTERM and not result.timed_out
    assert proc.signal(signal.SIGKILL) is False  # it has ended: nothing to do
    assert (await proc.kill()).returncode == -signal.SIGTERM  # idempotent

    proc = await engine.spawn(info.id, "sleep 60 & sleep 60; wait")
    assert (await proc.kill()).returncode == -signal.SIGKILL
    r = await engine.exec(info.id, "cat /proc/[0-9]*/comm | grep -c '^sleep$' || true")
    assert r.stdout == b"0\n"  # the whole group went

    proc = await engine.spawn(info.id, ["sleep", "60"], timeout=0.3)
    result = await proc.wait()
    assert result.timed_out and result.returncode == -signal.SIGKILL
    with pytest.raises(ExecTimeout, match="still runs"):
        await (await engine.spawn(info.id, ["sleep", "60"])).wait(timeout=0.1)


def test_parse_signal():
    assert parse_signal("TERM") == parse_signal("SIGTERM") == parse_signal("15") == 15
    assert parse_signal(9) == 9
    for bad in ("SIGNOPE", 0, 65, True, 1.5):
        with pytest.raises(InvalidArgument):
            parse_signal(bad)


async def test_unread_output_is_bounded_per_stream(engine):
    info = await engine.create()
    noisy = (
        "import sys\n"
        "sys.stderr.write('e' * 200000); sys.stderr.flush()\n"
        "for line in sys.stdin:\n"
        "    sys.stderr.write('log ' * 1000); sys.stderr.flush()\n"
        "    sys.stdout.write(line); sys.stdout.flush()\n"
    )
    proc = await engine.spawn(info.id, ["python3", "-c", noisy], max_buffer=4096)
    for i in range(20):  # stderr overflows its budget; stdout keeps flowing
        await proc.write(b"%d\n" % i)
        assert await proc.readline() == b"%d\n" % i
    assert proc.unread_bytes <= 4096
    await proc.close_stdin()
    # wait(), not a reader: the last line's stderr may still be on its way when its
    # stdout line was read, and a reader would make room for it
    result = await proc.wait()
    assert len(result.stderr) == 4096 and result.stderr.startswith(b"e" * 4096)
    assert result.stderr_truncated and not result.stdout_truncated


async def test_one_reader_at_a_time(engine):
    info = await engine.create()
    proc = await engine.spawn(info.id, ["python3", "-c", UPPER])
    events = proc.output()
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.05)
    await proc.write(b"x\n")
    assert await proc.readline() == b"X\n"  # takes the output over
    with pytest.raises(InvalidState, match="another reader"):
        await first
    # A reader cancelled while it waits for a line (a timeout) loses nothing.
    await proc.write(b"no newline yet")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(proc.readline(), 0.2)
    await proc.write(b", now\n")
    assert await proc.readline() == b"NO NEWLINE YET, NOW\n"
    # A line longer than the limit comes in pieces.
    await proc.write(b"a" * 50 + b"\n")
    assert await proc.readline(limit=20) == b"A" * 20
    assert await proc.readline() == b"A" * 30 + b"\n"
    await proc.kill()


async def test_processes_end_with_their_sandbox(engine):
    info = await engine.create()
    proc = await engine.spawn(info.id, ["sleep", "60"])
    reading = asyncio.ensure_future(collect(proc))
    await asyncio.sleep(0.05)
    await engine.delete(info.id)
    with pytest.raises(SandboxLost):
        await reading
    with pytest.raises(SandboxLost):
        await proc.wait()
    assert proc.state == ProcessState.LOST and proc.info()["error"] is not None
    with pytest.raises(SandboxLost):
        await proc.write(b"x")
    with pytest.raises(SandboxNotFound):
        engine.get_process(info.id, proc.id)  # the sandbox is gone, and its processes


async def test_a_live_process_keeps_the_sandbox_busy(engine):
    # 5 s idle: the spawn must come before (1 s, then 2 s, could pass first, loaded);
    # the process runs until the test kills it
    info = await engine.create(idle_timeout=5.0)
    proc = await engine.spawn(info.id, ["sleep", "600"])
    await asyncio.sleep(6)  # past the idle timeout: the running process is activity
    assert engine.get(info.id).state == SandboxState.RUNNING
    proc.signal("SIGKILL")
    await proc.wait()
    for _ in range(600):  # now idle: the reaper ends it
        if engine.get(info.id).state == SandboxState.STOPPED:
            break
        await asyncio.sleep(0.1)
    assert engine.get(info.id).state == SandboxState.STOPPED
    assert "idle" in engine.get(info.id).reason


async def test_bad_input_is_refused_and_leaves_nothing(engine):
    info = await engine.create()
    with pytest.raises(InvalidArgument):
        await engine.spawn(info.id, [])
    with pytest.raises(InvalidArgument):
        await engine.spawn(info.id, ["cat"], max_buffer=-1)
    with pytest.raises(InvalidArgument):
        await engine.spawn(info.id, ["cat"], timeout=0)
    with pytest.raises(FileNotFound):
        await engine.spawn(info.id, ["cat"], cwd="/no/such/dir")
    assert engine.list_processes(info.id) == []
    assert engine._live[info.id].busy == 0
    with pytest.raises(NotFound, match="no process"):
        engine.get_process(info.id, "proc-000000000000")

    proc = await engine.spawn(info.id, ["cat"])
    await proc.close_stdin()
    with pytest.raises(InvalidState, match="stdin"):
        await proc.write(b"x")
    await proc.wait()

    proc = await engine.spawn(info.id, ["cat"])
    await engine.pause(info.id)
    with pytest.raises(InvalidState, match="paused"):
        await proc.write(b"x")
    await engine.resume(info.id)
    await proc.write(b"back\n")
    assert await proc.readline() == b"back\n"
    await proc.kill()
    assert engine._live[info.id].busy == 0


async def test_old_exited_processes_are_forgotten(engine, monkeypatch):
    monkeypatch.setattr(processes, "MAX_EXITED_KEPT", 2)
    info = await engine.create()
    done = [await engine.spawn(info.id, ["true"]) for _ in range(4)]
    for proc in done:
        await proc.wait()
    running = await engine.spawn(info.id, ["sleep", "60"])
    kept = [p.id for p in engine.list_processes(info.id)]
    assert kept == [done[2].id, done[3].id, running.id]
    engine.forget_process(info.id, done[2].id)
    assert [p.id for p in engine.list_processes(info.id)] == [done[3].id, running.id]
    await running.kill()
