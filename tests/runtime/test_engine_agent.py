"""The agent inside a sandbox: commands, output, timeouts, limits and files."""

from __future__ import annotations

import asyncio
import io
import time
import zipfile

import pytest

from corral.errors import (
    CorralError,
    FileError,
    FileNotFound,
    FileTooLarge,
    InvalidArgument,
)
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

COUNT_SLEEPS = "cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$' || true"


async def test_argv_shell_env_cwd_stdin(engine):
    info = await engine.create(env={"GREETING": "hi"}, workdir="/app")
    r = await engine.exec(info.id, ["python3", "-c", "import os; print(os.getcwd(), os.environ['GREETING'])"])
    assert (r.returncode, r.stdout) == (0, b"/app hi\n")
    r = await engine.exec(info.id, "echo $GREETING $EXTRA; pwd", env={"EXTRA": "there"}, cwd="/tmp")
    assert r.stdout == b"hi there\n/tmp\n"
    r = await engine.exec(info.id, ["cat"], stdin=b"piped\x00bytes")
    assert r.stdout == b"piped\x00bytes"
    r = await engine.exec(info.id, "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    r = await engine.exec(info.id, ["no-such-command"])
    assert r.returncode == 127 and b"no-such-command" in r.stderr
    with pytest.raises(FileNotFound):
        await engine.exec(info.id, ["true"], cwd="/does/not/exist")
    with pytest.raises(InvalidArgument):
        await engine.exec(info.id, [])
    with pytest.raises(InvalidArgument):
        await engine.exec(info.id, ["true"], timeout=-1)


async def test_commands_are_found_as_glibc_execvp_finds_them(engine):
    # The agent searches PATH itself (agent/exec.c: exec_path), whichever libc it is
    # built with: a script without a #! line runs under /bin/sh, a file on PATH
    # that may not be run is passed over, and reported when nothing else ran.
    info = await engine.create()
    await engine.exec(info.id, "mkdir -p /tmp/bin /tmp/locked && printf 'echo plain $1\\n' > /tmp/bin/plain"
                               " && chmod +x /tmp/bin/plain && cp /tmp/bin/plain /tmp/locked/plain"
                               " && chmod 0 /tmp/locked/plain && printf 'x' > /tmp/bin/noexec")
    r = await engine.exec(info.id, ["plain", "arg"], env={"PATH": "/tmp/locked:/tmp/bin"})
    assert (r.returncode, r.stdout) == (0, b"plain arg\n"), r.stderr
    r = await engine.exec(info.id, ["/tmp/bin/plain", "x"])
    assert (r.returncode, r.stdout) == (0, b"plain x\n"), r.stderr
    r = await engine.exec(info.id, ["plain"], env={"PATH": "/tmp/locked"})
    assert r.returncode == 126 and b"Permission denied" in r.stderr
    r = await engine.exec(info.id, ["/tmp/bin/noexec"])
    assert r.returncode == 126 and b"Permission denied" in r.stderr


async def test_large_stdin_is_delivered_whole(engine):
    info = await engine.create()
    data = bytes(range(256)) * 8192  # 2 MiB, more than a pipe holds
    r = await engine.exec(info.id, ["sha256sum"], stdin=data)
    import hashlib

    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


async def test_streaming_keeps_order_and_separates_streams(engine):
    info = await engine.create()
    events = []
    cmd = "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done; exit 7"
    async for ev in engine.exec_stream(info.id, cmd):
        events.append(ev)
    assert events[-1].kind == "exit" and events[-1].result.returncode == 7
    out = b"".join(e.data for e in events if e.kind == "stdout")
    err = b"".join(e.data for e in events if e.kind == "stderr")
    assert out == b"out1\nout2\nout3\n" and err == b"err1\nerr2\nerr3\n"
    # with a pause between lines, they arrive as separate chunks, in order
    kinds = [(e.kind, e.data) for e in events if e.kind != "exit"]
    assert kinds.index(("stdout", b"out1\n")) < kinds.index(("stdout", b"out2\n"))
    assert kinds.index(("stderr", b"err1\n")) < kinds.index(("stdout", b"out2\n"))


async def test_closing_a_stream_kills_the_command(engine):
    info = await engine.create()
    gen = engine.exec_stream(info.id, "echo started; exec sleep 60")
    ev = await gen.__anext__()
    assert ev.data == b"started\n"
    await gen.aclose()
    for _ in range(600):
        r = await engine.exec(info.id, COUNT_SLEEPS)
        if r.stdout.strip() == b"0":
            break
        await asyncio.sleep(0.05)
    assert r.stdout.strip() == b"0"


async def test_timeout_kills_the_whole_process_group(engine):
    info = await engine.create()
    # 5 s: "begun" is surely written first, even on a loaded host (0.5 s was not)
    r = await engine.exec(info.id, "sleep 600 & sleep 600 & echo begun; wait", timeout=5)
    assert r.timed_out and r.returncode == -9 and r.stdout == b"begun\n"
    r = await engine.exec(info.id, COUNT_SLEEPS)
    assert r.stdout.strip() == b"0"


async def test_output_flood_is_truncated(engine):
    info = await engine.create()
    r = await engine.exec(info.id, "head -c 5000000 /dev/zero; echo tail >&2", max_output=100_000)
    assert r.stdout_truncated and len(r.stdout) == 100_000 and r.returncode == 0
    assert not r.stderr_truncated and r.stderr == b"tail\n"


def seq_bytes(n: int) -> bytes:
    """What `seq 1 n` prints."""
    return "".join(f"{i}\n" for i in range(1, n + 1)).encode()


async def test_a_20_mb_flood_keeps_its_final_verdict(engine):
    """Issue 13.5: a solution printing 20 MB, then its verdict: the verdict is kept (the
    default tail is half of the 1 MiB cap), and the bytes dropped are counted exactly."""
    info = await engine.create()
    r = await engine.exec(info.id, "head -c 20000000 /dev/zero | tr '\\0' x; echo 'VERDICT: 3 passed'")
    assert r.returncode == 0 and r.stdout_truncated and not r.stderr_truncated
    assert len(r.stdout) == 1 << 20 and r.output_tail == 512 << 10
    assert r.stdout == b"x" * ((1 << 20) - 18) + b"VERDICT: 3 passed\n"
    assert r.stdout_dropped == 20_000_000 + 18 - (1 << 20)


async def test_head_and_tail_are_exact_and_in_order(engine):
    """`seq` output through a small ring that wraps many times: head, then tail, byte
    for byte; stdout and stderr each keep their own."""
    info = await engine.create()
    out, err = seq_bytes(200_000), seq_bytes(50_000)
    r = await engine.exec(
        info.id, "seq 1 200000; seq 1 50000 >&2; exit 4", max_output=10_000, output_tail=3_333
    )
    assert r.returncode == 4 and r.output_tail == 3_333
    assert r.stdout == out[:6_667] + out[-3_333:] and r.stdout_dropped == len(out) - 10_000
    assert r.stderr == err[:6_667] + err[-3_333:] and r.stderr_dropped == len(err) - 10_000
    assert r.stdout_truncated and r.stderr_truncated


async def test_output_tail_0_keeps_the_head_only(engine):
    info = await engine.create()
    out = seq_bytes(100_000)
    r = await engine.exec(info.id, "seq 1 100000; echo err >&2", max_output=50_000, output_tail=0)
    assert r.stdout == out[:50_000] and r.stdout_truncated
    assert r.stdout_dropped == len(out) - 50_000 and r.output_tail == 0
    assert r.stderr == b"err\n" and not r.stderr_truncated and r.stderr_dropped == 0


@pytest.mark.parametrize("size", [0, 1, 60, 99, 100])
async def test_output_within_the_cap_is_whole(engine, size):
    """Up to max_output bytes (also past the head, held back in the tail): all of it."""
    info = await engine.create()
    r = await engine.exec(info.id, f"seq 1 100 | head -c {size}", max_output=100, output_tail=40)
    assert r.stdout == seq_bytes(100)[:size] and not r.stdout_truncated and r.stdout_dropped == 0


async def test_one_byte_over_the_cap(engine):
    info = await engine.create()
    out = seq_bytes(100)[:101]
    r = await engine.exec(info.id, "seq 1 100 | head -c 101", max_output=100, output_tail=40)
    assert r.stdout == out[:60] + out[-40:] and r.stdout_truncated and r.stdout_dropped == 1


async def test_a_stream_shows_its_gap_between_head_and_tail(engine):
    info = await engine.create()
    out = seq_bytes(100_000)
    events = [ev async for ev in engine.exec_stream(
        info.id, "seq 1 100000", max_output=1_000, output_tail=100)]
    gaps = [i for i, ev in enumerate(events) if ev.dropped]
    assert len(gaps) == 1 and events[gaps[0]].kind == "stdout" and events[gaps[0]].data == b""
    assert events[gaps[0]].dropped == len(out) - 1_000
    head = b"".join(ev.data for ev in events[: gaps[0]])
    tail = b"".join(ev.data for ev in events[gaps[0] + 1 : -1])
    assert (head, tail) == (out[:900], out[-100:])
    assert events[-1].kind == "exit" and events[-1].result.stdout_dropped == len(out) - 1_000


async def test_a_timed_out_command_keeps_its_tail(engine):
    """The agent kills the command at its timeout, then sends the tail: where it hung."""
    info = await engine.create()
    # 8 s: the seq and the echo are surely done by then on a loaded host (1 s was not)
    r = await engine.exec(info.id, "seq 1 100000; echo 'stuck in step 7'; exec sleep 600",
                          timeout=8, max_output=1_000)
    assert r.timed_out and r.stdout.endswith(b"100000\nstuck in step 7\n")
    assert r.stdout_dropped == len(seq_bytes(100_000)) + 16 - 1_000


async def test_commands_run_concurrently(engine):
    info = await engine.create()
    # each command waits until all four have started: only possible if they overlap
    cmd = (
        "touch /tmp/started.$N; for i in $(seq 200); do "
        "[ $(ls /tmp/started.* | wc -l) -ge 4 ] && exit 0; sleep 0.02; done; exit 1"
    )
    results = await asyncio.gather(
        *(engine.exec(info.id, cmd, env={"N": str(i)}) for i in range(4))
    )
    assert [r.returncode for r in results] == [0, 0, 0, 0]


async def test_orphans_are_reaped(engine):
    info = await engine.create()
    for _ in range(5):
        await engine.exec(info.id, "(sleep 0.1 &) ; true")
    # until every orphan sleep ended and was collected: none left, not even a zombie (a
    # fixed 0.4 s wait can fail under load: a sleep not yet ended)
    left = "cat /proc/[0-9]*/status | grep -cE '^(Name:.sleep$|State:.Z)' || true"
    deadline = time.monotonic() + 60
    while (r := await engine.exec(info.id, left)).stdout.strip() != b"0":
        assert time.monotonic() < deadline, f"orphans not reaped: {r.stdout!r}"
        await asyncio.sleep(0.1)


async def test_fork_bomb_is_capped_by_pids(engine):
    info = await engine.create(pids=40)
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(n)\n"
    )
    r = await engine.exec(info.id, ["python3", "-c", bomb], timeout=20)
    forked = int(r.stdout)
    assert 0 < forked < 40
    assert len(engine.cgroup(info.id).pids()) <= 40
    try:
        await engine.exec(info.id, "true", timeout=5)  # may fail while full; must not hang
    except CorralError:
        pass


async def test_disk_fill_stops_at_disk_mb(engine):
    info = await engine.create(disk_mb=16)
    r = await engine.exec(info.id, "dd if=/dev/zero of=/workspace/big bs=1M count=64 2>&1; ls -l /workspace/big")
    assert r.returncode != 0 or b"No space left" in r.stdout
    assert b"No space left on device" in r.stdout
    size = int(r.stdout.split(b"\n")[-2].split()[4])
    assert size <= 16 << 20
    with pytest.raises(FileError) as exc:
        await engine.write_file(info.id, "/workspace/more", b"x" * (4 << 20))
    assert "disk" in str(exc.value)
    await engine.remove(info.id, "/workspace/big")
    await engine.write_file(info.id, "/workspace/small", b"ok")  # space is back


async def test_cpu_spinner_gets_only_its_quota(engine):
    info = await engine.create(cpus=0.25)
    cg = engine.cgroup(info.id)
    r = await engine.exec(
        info.id,
        ["python3", "-c", "import time\nt=time.monotonic()\nwhile time.monotonic()-t<1.5: pass"],
    )
    used = cg.cpu_seconds()
    # 1.5 s of wall at a quarter CPU is ~0.375 s; allow slack for start-up.
    assert r.returncode == 0 and used < 0.75, used


def _wheel(name: str) -> bytes:
    buf = io.BytesIO()
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return buf.getvalue()


async def test_state_persists_between_calls(engine):
    info = await engine.create()
    await engine.write_file(info.id, "/workspace/probe-1.0-py3-none-any.whl", _wheel("probe"))
    r = await engine.exec(info.id, "pip install --no-index --quiet /workspace/probe-1.0-py3-none-any.whl")
    assert r.returncode == 0, r.stderr
    r = await engine.exec(info.id, ["python3", "-c", "import probe; print(probe.VALUE)"])
    assert r.stdout == b"42\n"
    await engine.exec(info.id, "mkdir -p /workspace/d && echo kept > /workspace/d/f")
    r = await engine.exec(info.id, "cat d/f", cwd="/workspace")
    assert r.stdout == b"kept\n"


async def test_file_operations(engine):
    info = await engine.create()
    sid = info.id
    await engine.write_file(sid, "/app/deep/dir/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    r = await engine.exec(sid, ["/app/deep/dir/run.sh"])
    assert r.stdout == b"ran\n"
    st = await engine.stat(sid, "/app/deep/dir/run.sh")
    assert st.mode == 0o755 and st.size == 19 and not st.is_dir
    big = bytes(range(256)) * 12_000  # ~3 MiB: several chunks each way
    await engine.write_file(sid, "rel/big.bin", big)  # relative to the workdir
    assert await engine.read_file(sid, "/workspace/rel/big.bin") == big
    with pytest.raises(FileTooLarge):
        await engine.read_file(sid, "/workspace/rel/big.bin", max_bytes=1000)
    await engine.mkdir(sid, "/app/empty")
    names = [e.name for e in await engine.list_dir(sid, "/app")]
    assert names == ["deep", "empty"]
    assert (await engine.stat(sid, "/app/empty")).is_dir
    with pytest.raises(FileNotFound) as exc:
        await engine.read_file(sid, "/app/missing")
    assert isinstance(exc.value, FileNotFoundError)
    with pytest.raises(FileError):
        await engine.remove(sid, "/app/deep")  # not empty
    await engine.remove(sid, "/app/deep", recursive=True)
    with pytest.raises(FileNotFound):
        await engine.stat(sid, "/app/deep")
    with pytest.raises(FileError):
        await engine.write_file(sid, "/usr/bin/evil", b"x")
    with pytest.raises(FileError):
        await engine.read_file(sid, "/app")  # a directory


async def test_a_command_run_to_completion_gets_no_started_frame(engine):
    """The agent sends STARTED only to a command whose start someone waits for (a
    stream's ``on_start``); one run to completion (``exec``) asks for none: its first
    output or its exit says it started, one frame and one wake-up of the engine fewer."""
    from corral.runtime.agentconn import limit_fields
    from corral.runtime.protocol import Msg

    info = await engine.create()
    live = engine._running(info.id)
    for quiet, first in ((True, Msg.EXIT), (False, Msg.STARTED)):
        fields = engine.command_fields(live, ["true"], None, None, None,
                                       limit_fields(10, 1024, 0))
        stream = live.channel.open_exec(fields, max_output=1024, quiet_start=quiet)
        try:
            assert (await asyncio.wait_for(stream.next(), 60)).msg == first
        finally:
            stream.close()
    started: list[bool] = []
    async for _ in engine.exec_stream(info.id, ["true"], on_start=lambda: started.append(True)):
        pass
    assert started == [True]
    await engine.delete(info.id)


async def test_a_command_started_at_once_is_killed_if_nobody_awaits_it(engine):
    """``start_exec`` sends the command before it returns (the exec route starts it in
    its handler and awaits its end in a task): awaited, it is ``exec``; closed
    unawaited (the handler cancelled before that task ran), the command is killed, its
    sandbox is neither busy nor blamed, and its output hold is given back."""
    from corral.runtime.ownership import UNSET

    info = await engine.create()
    live = engine._running(info.id)
    r = await engine.start_exec(info.id, "echo hi")
    assert (r.returncode, r.stdout) == (0, b"hi\n")
    tenant = engine.owners.of(UNSET)
    free = engine.output_budget.free_for(tenant)
    started = engine.start_exec(info.id, "exec sleep 60", timeout=120)
    assert live.busy == 1 and engine.output_budget.free_for(tenant) < free
    for _ in range(600):  # it runs with nobody awaiting it
        if (await engine.exec(info.id, COUNT_SLEEPS)).stdout.strip() == b"1":
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the command never started")
    started.close()
    assert live.busy == 0 and engine.output_budget.free_for(tenant) == free
    for _ in range(600):  # killed, and its exit read: its deadline has nothing to end
        if not live.channel.streams and (
                await engine.exec(info.id, COUNT_SLEEPS)).stdout.strip() == b"0":
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the command was not killed")
    with pytest.raises(RuntimeError):
        await started  # closed: never a result
    assert engine.get(info.id).state.value == "running"
    await engine.delete(info.id)
