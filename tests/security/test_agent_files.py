"""File operations cannot block, crash or turn the agent against itself.

Sandbox code plants things where the trainer reads or writes a file: a FIFO, a socket,
a device, a symlink into /proc, a lease, a tree deeper than any stack. Each was a real
attack on the agent as it was: it blocked in open() on the FIFO (and, single-threaded,
answered nothing more and enforced no timeout), waited 45 s on the lease, crashed on
the 60000-deep tree, and would have read its own memory map through the symlink.
Now each gets a typed error (``FileError``, ``details["errno"]``) or just works, and
the next command still gets its honest result. The controls show each trap is real:
a command that opens it the way the agent used to is stuck or reads the target.
"""

from __future__ import annotations

import asyncio
import errno

import pytest

from corral.errors import FileError
from tests.conftest import requires_root
from tests.security.conftest import agent_host_pid, assert_honest

pytestmark = [requires_root, pytest.mark.root]

HANG = 30  # seconds: only so that a regression fails instead of hanging the suite


async def refused(coro, what: str) -> FileError:
    with pytest.raises(FileError) as info:
        await asyncio.wait_for(coro, HANG)
    assert what in str(info.value), str(info.value)
    return info.value


async def test_fifo_where_a_file_is_read_or_written(sandbox):
    engine, sid = sandbox
    r = await engine.exec(sid, "mkdir -p /app && mkfifo /app/result.txt /app/in.txt")
    assert r.returncode == 0, r.stderr
    # control: opening the FIFO the plain way blocks (killed by the timeout here)
    r = await engine.exec(sid, ["cat", "/app/result.txt"], timeout=1)
    assert r.timed_out

    err = await refused(engine.read_file(sid, "/app/result.txt"), "it is a FIFO")
    assert err.details["errno"] == errno.EOPNOTSUPP
    await refused(engine.write_file(sid, "/app/in.txt", "hidden tests"), "it is a FIFO")
    # with a reader waiting on it, the write is still refused and nothing arrives
    reader = await engine.spawn(sid, "cat /app/in.txt > /tmp/got; echo done")
    await asyncio.sleep(0.2)  # let cat reach open(); the write is refused either way
    await refused(engine.write_file(sid, "/app/in.txt", "hidden tests"), "it is a FIFO")
    reader.signal("SIGKILL")
    await asyncio.wait_for(reader.wait(), HANG)
    r = await engine.exec(sid, "cat /tmp/got 2>/dev/null; true")
    assert b"hidden" not in r.stdout

    # a directory holding a FIFO still lists, and the FIFO stats
    names = {f.name for f in await engine.list_dir(sid, "/app")}
    assert {"result.txt", "in.txt"} <= names
    assert (await engine.stat(sid, "/app/result.txt")).size == 0
    await assert_honest(engine, sid)


async def test_sockets_and_devices_are_refused(sandbox):
    engine, sid = sandbox
    r = await engine.exec(
        sid, ["python3", "-c", "import socket; socket.socket(socket.AF_UNIX).bind('/tmp/sock')"]
    )
    assert r.returncode == 0, r.stderr
    await refused(engine.read_file(sid, "/tmp/sock"), "it is a socket")
    await refused(engine.write_file(sid, "/tmp/sock", "x"), "it is a socket")
    # /dev/zero would hand out data for ever; /dev/null would swallow a write silently
    await refused(engine.read_file(sid, "/dev/zero"), "it is a character device")
    await refused(engine.write_file(sid, "/dev/null", "x"), "it is a character device")
    await assert_honest(engine, sid)


async def test_symlinks_into_proc_do_not_reach_the_agent(sandbox):
    engine, sid = sandbox
    r = await engine.exec(sid, (
        "mkdir -p /app && ln -s /proc/1/mem /app/mem && ln -s /proc/self/maps /app/maps"
        " && ln -s /proc/1/environ /app/env && ln -s /proc/1/oom_score_adj /app/oom"
        " && ln -s /proc/self/fd/0 /app/fd0 && ln -s /proc/1/status /app/status"
    ))
    assert r.returncode == 0, r.stderr
    # control: through the symlink, whoever opens it reads its own memory map
    r = await engine.exec(sid, ["head", "-c", "200", "/app/maps"])
    assert r.returncode == 0 and b"-" in r.stdout and b"/" in r.stdout
    # The agent's own /proc/1/mem and environ belong to root now (it is not dumpable):
    # even the agent cannot open them. What it can open, it refuses to read.
    for path in ("/app/mem", "/app/env"):
        err = await refused(engine.read_file(sid, path), "")
        assert err.details["errno"] in (errno.EACCES, errno.EOPNOTSUPP)
    for path in ("/app/maps", "/app/status"):
        err = await refused(engine.read_file(sid, path), "kernel filesystem")
        assert err.details["errno"] == errno.EOPNOTSUPP
    oom = open(f"/proc/{agent_host_pid(engine, sid)}/oom_score_adj").read()
    err = await refused(engine.write_file(sid, "/app/oom", "1000"), "")
    assert err.details["errno"] in (errno.EACCES, errno.EOPNOTSUPP)
    assert open(f"/proc/{agent_host_pid(engine, sid)}/oom_score_adj").read() == oom
    # a /proc file the agent could write (a command's) is refused all the same
    sleeper = await engine.spawn(sid, ["sleep", "60"])
    await engine.exec(sid, f"ln -s /proc/{sleeper.pid}/oom_score_adj /app/sib")
    await refused(engine.write_file(sid, "/app/sib", "900"), "kernel filesystem")
    r = await engine.exec(sid, ["cat", "/app/sib"])
    assert r.stdout.strip() == b"1000"  # a command's own value, unchanged
    sleeper.signal("SIGKILL")
    # /proc/self/fd/0 would be the agent's own stdin
    err = await refused(engine.read_file(sid, "/app/fd0"), "")
    assert err.details["errno"] in (errno.EACCES, errno.EOPNOTSUPP)
    await assert_honest(engine, sid)


LEASE = r"""
import fcntl, os, signal, time
signal.signal(signal.SIGIO, signal.SIG_IGN)  # so a lease break does not kill us
with open("/app/leased.txt", "w") as f:
    f.write("original")
fd = os.open("/app/leased.txt", os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
print("leased", flush=True)
time.sleep(100)
"""


async def test_a_lease_cannot_park_a_write(sandbox):
    engine, sid = sandbox
    await engine.mkdir(sid, "/app")
    holder = await engine.spawn(sid, ["python3", "-c", LEASE])
    assert await asyncio.wait_for(holder.readline(), HANG) == b"leased\n"
    err = await refused(engine.write_file(sid, "/app/leased.txt", "hidden"), "lease")
    assert err.details["errno"] == errno.EAGAIN
    # control: a plain open for writing waits for the lease break (45 s by default)
    r = await engine.exec(sid, ["sh", "-c", "echo x > /app/leased.txt"], timeout=1)
    assert r.timed_out
    assert await engine.read_file(sid, "/app/leased.txt") == b"original"
    holder.signal("SIGKILL")
    await asyncio.wait_for(holder.wait(), HANG)
    await engine.write_file(sid, "/app/leased.txt", "hidden")  # no lease, no trouble
    assert await engine.read_file(sid, "/app/leased.txt") == b"hidden"
    await assert_honest(engine, sid)


DEEP = r"""
import os, sys
os.makedirs("/app/deep")
os.chdir("/app/deep")
for _ in range(int(sys.argv[1])):
    os.mkdir("d")
    os.chdir("d")
open("leaf", "w").write("x")
print(sys.argv[1])  # (not getcwd: past PATH_MAX glibc walks up, in O(depth**2))
"""


async def test_a_tree_deeper_than_any_stack_is_removed(sandbox):
    engine, sid = sandbox
    # 60000 levels crashed the agent's recursive nftw (a stack overflow: sandbox lost)
    r = await engine.exec(sid, ["python3", "-c", DEEP, "60000"], timeout=HANG * 4)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 60000
    await asyncio.wait_for(engine.remove(sid, "/app/deep", recursive=True), HANG * 4)
    r = await engine.exec(sid, ["test", "-e", "/app/deep"])
    assert r.returncode == 1
    await assert_honest(engine, sid)


MANY_FILES = (
    "import os, sys\nos.makedirs(sys.argv[1])\n"
    "for i in range(int(sys.argv[2])): open(f'{sys.argv[1]}/{i}', 'w').close()"
)

# Waits for the agent's remove job (a child of pid 1 running the agent's code) to
# appear and stops it: a SIGSTOPped job would otherwise hold the trainer's request.
FREEZE_JOB = r"""
import os, signal, time
end = time.monotonic() + 60
me = os.getpid()
print("watching", flush=True)
while time.monotonic() < end:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in (1, me):
            continue
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if cmd.startswith(b"/.corral/agent"):
            os.kill(int(p), signal.SIGSTOP)
            print("stopped", flush=True)
            raise SystemExit(0)
"""


async def test_a_stopped_remove_fails_fast(sandbox):
    engine, sid = sandbox
    r = await engine.exec(sid, ["python3", "-c", MANY_FILES, "/app/big", "100000"], timeout=HANG * 4)
    assert r.returncode == 0, r.stderr
    watcher = await engine.spawn(sid, ["python3", "-c", FREEZE_JOB])
    assert await asyncio.wait_for(watcher.readline(), HANG) == b"watching\n"
    remove = asyncio.create_task(engine.remove(sid, "/app/big", recursive=True))
    assert await asyncio.wait_for(watcher.readline(), HANG) == b"stopped\n"
    err = await refused(remove, "stopped the operation")
    assert err.details["errno"] == errno.EINTR
    await asyncio.wait_for(engine.remove(sid, "/app/big", recursive=True), HANG * 4)
    assert (await engine.exec(sid, ["test", "-e", "/app/big"])).returncode == 1
    await assert_honest(engine, sid)


async def test_the_agent_answers_while_a_big_remove_runs(sandbox):
    engine, sid = sandbox
    r = await engine.exec(sid, ["python3", "-c", MANY_FILES, "/app/big", "120000"], timeout=HANG * 4)  # within the default inodes
    assert r.returncode == 0, r.stderr
    remove = asyncio.create_task(engine.remove(sid, "/app/big", recursive=True))
    await asyncio.sleep(0)  # the remove request goes out first
    r = await asyncio.wait_for(engine.exec(sid, "echo alive"), HANG)
    # Done inline (as it was), the agent could answer the command only after removing
    # 120000 files; now the removal runs in a child and the command comes back first.
    assert r.stdout == b"alive\n"
    assert not remove.done()
    await asyncio.wait_for(remove, HANG * 4)
    await assert_honest(engine, sid)
