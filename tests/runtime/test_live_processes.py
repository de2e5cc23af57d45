"""A live fork's copies keep the interactive processes they were checkpointed with
(corral.runtime.live_processes, docs/live.md "Processes in a copy"): the same ids,
each copy's own process behind them, their pipes attached to the copy's agent, output
nobody had read carried over. A process that writes all the time (its agent writes to
the control socket CRIU gave it before it reads its new one) is kept too."""

from __future__ import annotations

import asyncio
import os

import pytest

from corral.runtime import checkpoint, criu
from corral.runtime.paths import default_cache_dir

ECHO = ["python3", "-u", "-c", "import sys\nn = 0\nfor line in sys.stdin:\n"
        "    n += 1\n    print(n, line.strip(), flush=True)"]
NOISY = ["python3", "-u", "-c", "import sys, threading, time\n"
         "def spam():\n    while True:\n"
         "        sys.stderr.write('x' * 200); sys.stderr.flush(); time.sleep(0.0005)\n"
         "threading.Thread(target=spam, daemon=True).start()\n"
         "for line in sys.stdin:\n    print('got', line.strip(), flush=True)"]


@pytest.fixture
def criu_cached():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


async def test_copies_keep_their_processes_under_the_same_ids(engine, criu_cached):
    sb = await engine.create(network="none", checkpointable=True)
    echo = await engine.spawn(sb.id, ECHO)
    done = await engine.spawn(sb.id, ["true"])
    await done.wait(30)
    await echo.write(b"a\nunread\n")
    assert await echo.readline() == b"1 a\n"
    for _ in range(3000):  # "2 unread" reached the engine, nobody read it
        if echo.unread_bytes:
            break
        await asyncio.sleep(0.02)
    copies = await engine.fork(sb.id, 2, live=True)
    try:
        for i, c in enumerate(copies):
            mine = engine.get_process(c.id, echo.id)
            assert mine is not echo and mine.sandbox_id == c.id and mine.pid == echo.pid
            assert [p.id for p in engine.list_processes(c.id)] == [echo.id]  # not "true"
            assert await mine.readline() == b"2 unread\n"  # carried over
            await mine.write(f"b{i}\n".encode())
            assert await asyncio.wait_for(mine.readline(), 30) == f"3 b{i}\n".encode()
            await mine.close_stdin()
            assert (await mine.wait(30)).returncode == 0
        assert await echo.readline() == b"2 unread\n"  # the parent's, untouched
        await echo.write(b"c\n")
        assert await echo.readline() == b"3 c\n"
        r = await engine.exec(copies[0].id, ["echo", "new"])  # new requests: fresh ids
        assert r.stdout == b"new\n"
        # CRIU's kernel probes were kept for the next restores, out of the sandbox's reach
        kdat = checkpoint.kdat_cache(engine.layout.state_dir, criu.find(default_cache_dir()))
        assert kdat.stat().st_size > 0 and kdat.stat().st_mode & 0o077 == 0
        r = await engine.exec(copies[0].id, ["sh", "-c", "ls /run/criu.kdat; ls -d /run/*"])
        assert b"criu.kdat" not in r.stdout, r
    finally:
        for c in (*copies, sb):
            await engine.delete(c.id)


async def test_a_process_writing_all_the_time_is_kept(engine, criu_cached):
    sb = await engine.create(network="none", checkpointable=True)
    noisy = await engine.spawn(sb.id, NOISY)
    try:
        for _ in range(3):
            copies = await engine.fork(sb.id, 2, live=True)
            for c in copies:
                mine = engine.get_process(c.id, noisy.id)
                await mine.write(b"hi\n")
                assert await asyncio.wait_for(mine.readline(), 30) == b"got hi\n"
                await engine.delete(c.id)
    finally:
        await engine.delete(sb.id)


async def test_a_hibernated_sandbox_resumes_with_its_processes(engine, criu_cached):
    sb = await engine.create(network="none", checkpointable=True)
    echo = await engine.spawn(sb.id, ECHO)
    try:
        await echo.write(b"a\n")
        assert await echo.readline() == b"1 a\n"
        await engine.hibernate(sb.id)
        await engine.resume(sb.id)
        again = engine.get_process(sb.id, echo.id)  # the same id, its memory (n) kept
        await again.write(b"b\n")
        assert await asyncio.wait_for(again.readline(), 30) == b"2 b\n"
    finally:
        await engine.delete(sb.id)


COUNTER = ["python3", "-u", "-c", "import time\ni = 0\nwhile True:\n"
           "    i += 1\n    print(i, flush=True)\n    time.sleep(0.0005)"]


async def test_a_copy_loses_none_of_a_writing_process_s_output(engine, criu_cached):
    """Its unread output, what its agent had sent, what the copy's agent sent before
    it took its new channel and after: the copy reads 1, 2, 3... with no gap."""
    sb = await engine.create(network="none", checkpointable=True)
    counter = await engine.spawn(sb.id, COUNTER)
    try:
        await asyncio.sleep(0.2)
        (copy,) = await engine.fork(sb.id, 1, live=True)
        mine = engine.get_process(copy.id, counter.id)
        lines = [int(await asyncio.wait_for(mine.readline(), 30)) for _ in range(600)]
        assert lines == list(range(1, 601))
        await engine.delete(copy.id)
    finally:
        await engine.delete(sb.id)


async def test_a_busy_daemons_sandbox_restores(engine, criu_cached):
    """A daemon holding over a thousand descriptors (hundreds of sandboxes) gives each
    new agent descriptors with numbers past a sandbox's open_files (the launcher keeps
    the daemon's numbers): CRIU, under that limit, could not place its own descriptors
    above them and refused the restore ("Can't chose service_fd_base: 1024 1892", seen
    in a full run)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1500)]
    try:
        sb = await engine.create(network="none", checkpointable=True, open_files=1024)
        echo = await engine.spawn(sb.id, ECHO)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    copies = await engine.fork(sb.id, 1, live=True)
    mine = engine.get_process(copies[0].id, echo.id)
    await mine.write(b"x\n")
    assert await asyncio.wait_for(mine.readline(), 30) == b"1 x\n"
    r = await engine.exec(copies[0].id, ["sh", "-c", "ulimit -n"])
    assert r.stdout == b"1024\n"  # the copy's own limit, as before the checkpoint


async def test_a_restored_sandbox_does_not_run_its_entrypoint_again(engine, criu_cached, tmp_path):
    """``run_entrypoint``'s process is restored with the others: a live copy, and a
    hibernated sandbox resumed, keep the one that ran (before: a second one started)."""
    from corral.runtime.dockerfile_build import build_dockerfile

    name = f"t-entry-{os.getpid()}-{id(tmp_path) & 0xffff:x}"
    (tmp_path / "Dockerfile").write_text(
        'FROM python\nENTRYPOINT ["/bin/sh", "-c"]\n'
        'CMD ["echo started >> /tmp/runs; exec sleep 600"]\n')
    await build_dockerfile(engine, tmp_path, name=name)
    count = "for i in $(seq 100); do test -s /tmp/runs && break; sleep 0.1; done; cat /tmp/runs"
    sb = await engine.create(image=name, run_entrypoint=True, network="none",
                             checkpointable=True)
    copy = None
    try:
        assert (await engine.exec(sb.id, ["sh", "-c", count])).stdout == b"started\n"
        (entry,) = engine.list_processes(sb.id)
        snap = await engine.checkpoint(sb.id)
        copy = await engine.create(snapshot=snap.id)
        assert engine.get(copy.id).spec.run_entrypoint  # the copy's spec still says so
        for sid in (copy.id, sb.id):
            if sid == sb.id:
                await engine.hibernate(sb.id)
                await engine.resume(sb.id)
            assert [p.id for p in engine.list_processes(sid)] == [entry.id], sid
            r = await engine.exec(sid, ["sh", "-c", "sleep 0.3; cat /tmp/runs; "
                                        "cat /proc/[0-9]*/comm | grep -cx sleep"])
            assert r.stdout == b"started\n1\n", (sid, r.stdout, r.stderr)
        await engine.delete(copy.id)
        copy = None
        await engine.delete_snapshot(snap.id)
    finally:
        if copy is not None:
            await engine.delete(copy.id)
        await engine.delete(sb.id)
        if engine.images.exists(name):
            engine.images.remove(name)
