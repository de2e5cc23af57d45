"""No host file is handed to a sandbox: the agent's stderr (its log) is a pipe the
engine drains with a cap, and what start failures and death reasons quote comes from it.

Before, the launcher opened ``slots/<slot>.log`` in the state directory and passed it
as bwrap's stderr: the agent held a host file. ``pidfd_getfd(pidfd_open(1), 2)``
returned it to sandbox code, which could then write past its own ``disk_mb`` into the
host's state directory (the file was unlinked, not gone: its blocks stayed in use).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest

from corral.errors import SandboxStartError
from corral.runtime.logtail import KEEP_BYTES, LogTail
from corral.schema import SandboxState
from tests.conftest import requires_root
from tests.security.conftest import agent_host_pid, assert_honest, run_json
from tests.syscall_probe import PRELUDE, numbers

# Every way to the agent's stdout/stderr; then 50 MB through whatever opened.
FLOOD = PRELUDE + r"""
import os
got, errors = [], set()
for n in (0, 1, 2):
    try:
        got.append(os.open(f"/proc/1/fd/{n}", os.O_WRONLY | os.O_NONBLOCK))
    except OSError as e:
        errors.add(e.errno)
pidfd = os.pidfd_open(1)
for n in range(64):
    fd = syscall("pidfd_getfd", L(pidfd), L(n), L(0))
    if fd >= 0:
        got.append(fd)
    else:
        errors.add(-fd)
chunk = b"x" * (1 << 20)
written = 0
for fd in got:
    for _ in range(50):
        try:
            written += os.write(fd, chunk)
        except OSError:
            break
print(json.dumps({"opened": len(got), "written": written, "errors": sorted(errors)}))
"""


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _fd_targets(pid: int) -> dict[int, str]:
    out = {}
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(n)] = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            pass
    return out


@requires_root
@pytest.mark.root
async def test_no_host_file_reaches_the_sandbox(sandbox):
    engine, sid = sandbox
    agent = agent_host_pid(engine, sid)
    bwrap = engine._live[sid].proc.pid
    for pid in (agent, bwrap):
        fds = _fd_targets(pid)
        assert fds, pid
        files = {n: t for n, t in fds.items() if not t.startswith(("pipe:", "socket:", "anon_inode:"))}
        if pid == agent:  # its own oom_score_adj, in the sandbox's /proc (docs/sandbox.md:
            # the agent sets each command's value around its fork), not a host file
            files = {n: t for n, t in files.items() if t != "/proc/1/oom_score_adj"}
        assert files == {}, f"pid {pid} holds host files: {files}"
        assert all(fds[n].startswith("pipe:") for n in (0, 1, 2)), fds
    assert list(engine.layout.slots_dir.iterdir()) == []

    before = _tree_bytes(engine.layout.state_dir)
    res = await run_json(engine, sid, FLOOD, numbers())
    assert res["opened"] == 0 and res["written"] == 0, res
    assert set(res["errors"]) <= {13, 1}, res  # EACCES (/proc/1/fd), EPERM (pidfd_getfd)
    assert _tree_bytes(engine.layout.state_dir) - before < (1 << 20)
    await assert_honest(engine, sid)


async def test_log_tail_keeps_the_end_and_never_blocks_the_writer():
    r, w = os.pipe()
    tail = LogTail(r)
    tail.start()
    total = 4 << 20  # far more than a pipe holds: the writer blocks unless we drain
    payload = b"".join(b"line %07d\n" % i for i in range(total // 13)) + b"the end"

    def write() -> None:
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view) :]
        os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    for _ in range(6000):  # until EOF closes the tail (bounded: 60 s)
        if tail.fd < 0:
            break
        await asyncio.sleep(0.01)
    writer.join(10)
    assert not writer.is_alive() and tail.fd < 0
    text = tail.text()
    assert text.endswith("the end")
    assert tail.dropped == len(payload) - KEEP_BYTES
    assert text.startswith(f"[{tail.dropped} earlier bytes dropped]")
    assert len(text) < KEEP_BYTES + 100
    tail.close()  # idempotent


async def test_log_tail_closes_from_another_thread():
    r, w = os.pipe()
    tail = LogTail(r)
    tail.start()
    os.write(w, b"bwrap: something went wrong\n")
    await asyncio.to_thread(tail.close)  # as Slot.discard does
    for _ in range(3000):
        if tail.fd < 0:
            break
        await asyncio.sleep(0.01)
    assert tail.fd < 0
    os.close(w)


@requires_root
@pytest.mark.root
async def test_death_reason_quotes_the_drained_log(sandbox):
    engine, sid = sandbox
    bwrap = engine._live[sid].proc.pid
    marker = "corral-test: the last words of a dying agent"
    # The log's writers are the launcher, bwrap and the agent; root on the host stands
    # in for them here, through the outer bwrap's stderr.
    with open(f"/proc/{bwrap}/fd/2", "w") as log:
        log.write(marker + "\n")
    os.kill(agent_host_pid(engine, sid), signal.SIGKILL)
    for _ in range(600):  # bounded: 60 s
        if engine.get(sid).state.terminal:
            break
        await asyncio.sleep(0.1)
    info = engine.get(sid)
    assert info.state == SandboxState.FAILED
    assert marker in (info.reason or ""), info.reason


@requires_root
@pytest.mark.root
async def test_start_failure_quotes_the_drained_log(engine):
    with pytest.raises(SandboxStartError) as err:
        await engine.create(ro_binds=[("/nonexistent/corral-test-source", "/.corral/x/file")])
    assert "/nonexistent/corral-test-source" in str(err.value), str(err.value)
    assert list(engine.layout.slots_dir.iterdir()) == []
