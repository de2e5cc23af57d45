"""A live checkpoint's dump of a real sandbox (corral.runtime.checkpoint, docs/live.md).

Whatever CRIU makes of the sandbox, the sandbox keeps running untouched: a process
counting in it goes on counting, exec works, and a failed dump is an ``Unsupported``
naming its cause and leaving no images behind."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from corral.errors import InvalidArgument, InvalidState, Unsupported
from corral.runtime import checkpoint, criu
from corral.runtime.engine import Engine
from corral.runtime.layer_fetch import LayerFetcher
from corral.runtime.paths import default_cache_dir
from corral.runtime.terminal import TerminalSize
from corral.schema import SandboxSpec
from tests.conftest import requires_root

COUNTER = (
    "nohup python3 -c 'import time\nb = bytearray(8 << 20)\ni = 0\nwhile True:\n"
    "    i += 1\n    open(\"/tmp/count\", \"w\").write(str(i))\n    time.sleep(0.05)'"
    " >/dev/null 2>&1 &"
)
KNOWN = {code for _, code, _ in checkpoint.CAUSES}


@pytest.fixture
def criu_cached():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


async def count(engine, sid) -> int:
    for _ in range(100):
        r = await engine.exec(sid, ["cat", "/tmp/count"])
        if r.stdout.strip():
            return int(r.stdout)
        await asyncio.sleep(0.05)
    raise AssertionError("the counter never wrote")


async def counts_past(read, past: int, limit: float = 60.0) -> int:  # noqa: ANN001
    """Poll the counter ``read()`` until it is past ``past``: it went on counting (after a fixed
    wait, under load, the counter's process may not have run yet)."""
    for _ in range(int(limit / 0.1)):
        if (now := await read()) > past:
            return now
        await asyncio.sleep(0.1)
    raise AssertionError(f"the counter stood at {past} for {limit:g} s")


async def dump(engine, sid, tenant=None, uid=None):
    live = engine._get_live(sid)
    return await checkpoint.dump(cache_dir=engine.layout.cache_dir,
                                 state_dir=engine.layout.state_dir, sandbox_id=sid,
                                 tenant=tenant, launcher_pid=live.proc.pid, uid=uid)


async def test_a_checkpointable_sandbox_is_dumped_and_keeps_running(engine, criu_cached):
    sb = await engine.create(network="none", checkpointable=True)
    await engine.exec(sb.id, ["sh", "-c", COUNTER])
    before = await count(engine, sb.id)
    images = await dump(engine, sb.id, uid=engine._get_live(sb.id).uid)
    names = {p.name for p in images.path.iterdir()}
    assert {"inventory.img", "pstree.img", "pages-1.img"} <= names, names
    for p in (images.path, *images.path.iterdir()):
        assert p.stat().st_uid == 0 and not p.stat().st_mode & 0o077
    await counts_past(lambda: count(engine, sb.id), before)  # it went on counting
    assert (await engine.exec(sb.id, ["echo", "alive"])).stdout.strip() == b"alive"


async def test_a_dump_leaves_the_sandbox_running(engine, criu_cached):
    sb = await engine.create(network="none")
    await engine.exec(sb.id, ["sh", "-c", COUNTER])
    before = await count(engine, sb.id)
    root = checkpoint.images_root(engine.layout.state_dir, None)
    try:
        images = await dump(engine, sb.id)
    except Unsupported as exc:
        assert exc.details["cause"] in KNOWN, exc.message
        assert exc.details["criu_error"] in exc.message
        assert list(root.iterdir()) == []  # nothing of a failed dump is left
    else:
        assert stat.S_IMODE(images.path.stat().st_mode) == 0o700
        assert (images.path / "inventory.img").exists()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(root.parent.stat().st_mode) == 0o700
    await counts_past(lambda: count(engine, sb.id), before)  # it went on counting
    assert (await engine.exec(sb.id, ["echo", "alive"])).stdout.strip() == b"alive"


async def test_without_criu_it_is_unsupported_and_says_how_to_fix_it(engine, tmp_path):
    sb = await engine.create(network="none")
    with pytest.raises(Unsupported) as err:
        await checkpoint.dump(cache_dir=tmp_path, state_dir=engine.layout.state_dir,
                              sandbox_id=sb.id, tenant=None,
                              launcher_pid=engine._get_live(sb.id).proc.pid)
    assert err.value.details["cause"] == "criu_missing"
    assert (await engine.exec(sb.id, ["true"])).returncode == 0


async def test_a_checkpoint_cancelled_while_it_freezes_leaves_the_sandbox_running(engine,
                                                                                criu_cached):
    """The freeze before a dump runs in a thread that a cancel (a client that left) does
    not stop: once the cancelled checkpoint returns, the sandbox must not be frozen."""
    sb = await engine.create(network="none", checkpointable=True)
    cgroup = engine._get_live(sb.id).cgroup
    entered, cancelled, frozen = threading.Event(), threading.Event(), threading.Event()
    real = cgroup.freeze

    def held_freeze(*args, **kwargs):  # it freezes only once its caller was cancelled
        entered.set()
        cancelled.wait(60)
        try:
            real(*args, **kwargs)
        finally:
            frozen.set()

    cgroup.freeze = held_freeze
    task = asyncio.create_task(engine.checkpoint(sb.id))
    assert await asyncio.to_thread(entered.wait, 60)
    task.cancel()
    cancelled.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(frozen.wait, 60)
    assert not cgroup.frozen(), "a cancelled checkpoint left the sandbox frozen"
    assert (await engine.exec(sb.id, ["true"])).returncode == 0
    assert engine.list_snapshots() == []


# A parent that never returns from vfork(): its child pauses before any exec (what a
# freeze catches, for a moment, when dash runs a command)
VFORK_C = "#include <unistd.h>\nint main(void) { if (vfork() == 0) for (;;) pause(); return 0; }\n"


def _vfork_binary(tmp_path: Path) -> bytes:
    src = tmp_path / "vf.c"
    src.write_text(VFORK_C)
    try:
        subprocess.run(["cc", "-static", "-O2", "-o", str(tmp_path / "vf"), str(src)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no static C toolchain to build the vfork helper: {exc}")
    return (tmp_path / "vf").read_bytes()


async def test_a_sandbox_frozen_mid_vfork_is_refused_at_once_and_runs_on(engine, criu_cached,
                                                                        tmp_path):
    """A freeze that caught a process between vfork() and its child's exec cannot be
    dumped (CRIU stops the child; the parent, waiting for it in the kernel, never stops
    for CRIU): CRIU gave up after its 60 s timeout ("Timeout reached"), which made the
    Tensorlake suspend test flaky under load (one dash loop, caught so 2 times in 15).
    The dump freezes again until no process is mid-vfork; one that stays so is
    refused, typed, in about a second, and the sandbox runs on."""
    sb = await engine.create(network="none", checkpointable=True)
    await engine.write_file(sb.id, "/tmp/vf", _vfork_binary(tmp_path), mode=0o755)
    await engine.exec(sb.id, ["sh", "-c", COUNTER + "\nnohup /tmp/vf >/dev/null 2>&1 &"])
    before = await count(engine, sb.id)
    live = engine._get_live(sb.id)
    for _ in range(100):  # its child is there: the parent waits in vfork for good
        if checkpoint.mid_vfork(live.cgroup.pids()):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the helper never vforked")
    with pytest.raises(Unsupported) as err:
        await engine.checkpoint(sb.id)
    assert err.value.details["cause"] == "vfork", err.value
    assert not live.cgroup.frozen()
    await counts_past(lambda: count(engine, sb.id), before)
    assert engine.list_snapshots() == []
    # with the helper gone, the same sandbox is dumped
    await engine.exec(sb.id, ["sh", "-c", "kill -9 $(pidof vf)"])
    for _ in range(100):
        if not checkpoint.mid_vfork(live.cgroup.pids()):
            break
        await asyncio.sleep(0.05)
    snap = await engine.checkpoint(sb.id)
    assert snap.kind == "live"


# A launcher like a restored sandbox's CRIU right after a resume: a child of its own
# still running (its post-resume action script), one exited and not yet reaped, and the
# sandbox's pid 1 in a pid namespace of its own; it prints that one's pid.
CRIU_LIKE = """
import ctypes, os, sys, time
helper = os.fork()
if helper == 0:
    time.sleep(60)
    os._exit(0)
if os.fork() == 0:
    os._exit(0)  # never waited for: a zombie child
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:  # CLONE_NEWPID
    sys.exit("unshare: errno %d" % ctypes.get_errno())
init = os.fork()  # pid 1 of the new namespace
if init == 0:
    time.sleep(60)
    os._exit(0)
time.sleep(0.2)  # (the zombie has exited by then)
print(init, flush=True)
sys.stdin.read()
os.kill(helper, 9)
os.kill(init, 9)
"""


@requires_root
def test_the_sandbox_init_is_found_among_a_restoring_criu_s_own_children():
    """Right after a resume, the restored sandbox's CRIU (its launcher) also has its
    action script as a child, or that script's zombie: the second hibernate of
    test_hibernate_frees_the_slot... once failed on "launcher has 2 children" so."""
    launcher = subprocess.Popen([sys.executable, "-c", CRIU_LIKE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        init = int(launcher.stdout.readline())
        kids = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(kids) == 3, kids  # the helper, the zombie, the init
        assert checkpoint.sandbox_init(launcher.pid) == init
    finally:
        launcher.communicate("", timeout=60)


def test_causes_are_read_from_criu_s_log():
    log = ("(00.08) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self\n"
           "(00.11) Error (criu/namespaces.c:931): Unable to convert uid or gid\n"
           "(00.15) Error (criu/cr-dump.c:1975): Dumping FAILED.\n")
    code, meaning, line = checkpoint.cause_of(log)
    assert code == "userns_no_root" and line == "Unable to convert uid or gid"
    assert checkpoint.cause_of("garbage")[0] == "criu_error"
    stuck = "(60.01) Error (criu/cr-dump.c:1500): Timeout reached. Try to interrupt: 0\n"
    assert checkpoint.cause_of(stuck)[0] == "seize_timeout"


HEAP_COUNTER = (
    "nohup python3 -c 'import time\nb = bytearray(range(256)) * (200 << 10)\ni = 0\n"
    "while True:\n    i += 1\n    open(\"/tmp/count\", \"w\").write(f\"{i} {sum(b[::4096])}\")\n"
    "    time.sleep(0.05)' >/dev/null 2>&1 &"
)


async def heap_count(engine, sid) -> tuple[int, int]:
    for _ in range(200):
        out = (await engine.exec(sid, ["cat", "/tmp/count"])).stdout.split()
        if len(out) == 2:
            return int(out[0]), int(out[1])
        await asyncio.sleep(0.05)
    raise AssertionError("the counter never wrote")


async def first_of(pair) -> int:  # noqa: ANN001
    """The count of an awaited ``heap_count``."""
    return (await pair)[0]


async def _does_not_travel_silently(engine, snap_id, tmp_path):
    """On another node (a second engine) a live snapshot is refused typed, saying where
    it is, rather than imported as files and restored without its processes."""
    desc = await engine.describe_snapshot(snap_id, None)
    assert desc["kind"] == "live"
    other = await Engine.open(tmp_path / "node-b")
    try:
        with pytest.raises(Unsupported) as err:
            await LayerFetcher(other.snapshots).import_snapshot(desc, _no_layers, holder="node-a")
        assert err.value.details["cause"] == "live_elsewhere"
        assert "node-a" in err.value.message
        assert other.list_snapshots() == []
    finally:
        await other.close()


def _no_layers(digest, size):
    raise AssertionError("a live snapshot's layers were fetched")


async def test_a_checkpoint_restores_into_a_new_sandbox_that_keeps_counting(engine, criu_cached,
                                                                             tmp_path):
    sb = await engine.create(network="none", checkpointable=True, memory_mb=512)
    await engine.exec(sb.id, ["sh", "-c", HEAP_COUNTER])
    before, heap0 = await heap_count(engine, sb.id)
    snap = await engine.checkpoint(sb.id, name="live-counter")
    images = engine.checkpoint_images(snap.id)
    assert images is not None and images.stat().st_mode & 0o077 == 0
    await _does_not_travel_silently(engine, snap.id, tmp_path)
    copy = await engine.restore_checkpoint(snap.id)
    assert copy.id != sb.id
    first, heap = await heap_count(engine, copy.id)
    assert heap == heap0  # its 50 MB of heap, intact
    assert first >= before  # it counts on from where it was, not from 1
    await counts_past(lambda: first_of(heap_count(engine, copy.id)), first)
    # a sandbox like any other: exec, files, spawn; pid 1 is the restored agent
    r = await engine.exec(copy.id, ["sh", "-c", "echo hi > /tmp/f && cat /tmp/f && id -u"])
    assert r.stdout.split() == [b"hi", b"1000"], r
    await engine.write_file(copy.id, "/tmp/g", b"files")
    assert await engine.read_file(copy.id, "/tmp/g") == b"files"
    proc = await engine.spawn(copy.id, ["cat"])
    await proc.write(b"spawned\n")
    await proc.close_stdin()
    assert (await proc.wait(30)).returncode == 0
    ps = (await engine.exec(copy.id, ["sh", "-c", "cat /proc/[0-9]*/comm"])).stdout.split()
    assert ps[0] == b"agent" and b"python3" in ps, ps
    assert engine.cgroup(copy.id).path != engine.cgroup(sb.id).path
    # a chain of forks (tree search): the copy is checkpointed and restored again
    snap2 = await engine.checkpoint(copy.id, name="live-counter-2")
    grand = await engine.restore_checkpoint(snap2.id)
    n2, heap2 = await heap_count(engine, grand.id)
    assert heap2 == heap0 and n2 >= first
    await counts_past(lambda: first_of(heap_count(engine, grand.id)), n2)
    assert (await engine.exec(grand.id, ["id", "-u"])).stdout.strip() == b"1000"
    await counts_past(lambda: first_of(heap_count(engine, copy.id)), first)  # it went on
    await engine.delete(grand.id)
    assert await engine.delete_snapshot(snap2.id)
    await engine.delete(copy.id)
    assert (await engine.exec(sb.id, ["echo", "alive"])).stdout.strip() == b"alive"
    assert await engine.delete_snapshot(snap.id)
    assert not images.exists()


async def test_hibernate_frees_the_slot_and_resume_brings_the_processes_back(engine, criu_cached):
    sb = await engine.create(network="none", checkpointable=True, memory_mb=512)
    await engine.exec(sb.id, ["sh", "-c", HEAP_COUNTER])
    before, heap0 = await heap_count(engine, sb.id)
    cgroup = engine.cgroup(sb.id)
    info = await engine.hibernate(sb.id)
    assert info.state.value == "paused" and info.id == sb.id
    assert not any(d.exists() for d in cgroup._hierarchies())  # memory, cgroup, processes: gone
    assert [s.kind for s in engine.list_snapshots()] == ["live"]  # on disk, as a checkpoint
    with pytest.raises(InvalidState):  # the engine's exec does not wake it (the service does)
        await engine.exec(sb.id, ["true"])
    assert (await engine.hibernate(sb.id)).state.value == "paused"  # idempotent
    info = await engine.resume(sb.id)
    assert info.id == sb.id and info.state.value == "running"
    n, heap = await heap_count(engine, sb.id)
    assert heap == heap0 and n >= before  # it counts on, its heap intact
    assert engine.list_snapshots() == []  # the checkpoint went once it ran
    # a second round, then an end while hibernated takes its checkpoint with it
    await engine.hibernate(sb.id)
    await engine.wake(sb.id)
    assert (await heap_count(engine, sb.id))[0] >= n
    await engine.hibernate(sb.id)
    assert await engine.delete(sb.id)
    for _ in range(3000):  # (bounded generously: a loaded host is slow, not stuck)
        if not engine.list_snapshots():
            break
        await asyncio.sleep(0.02)
    assert engine.list_snapshots() == []
    assert list(checkpoint.images_root(engine.layout.state_dir, None).iterdir()) == []
    # a sandbox that is not checkpointable is refused, typed, and runs on
    plain = await engine.create(network="none")
    with pytest.raises(InvalidState) as err:
        await engine.hibernate(plain.id)
    assert err.value.details["cause"] == "not_checkpointable"
    assert (await engine.exec(plain.id, ["true"])).returncode == 0


SERVER = ("nohup python3 -c 'import socket\ns = socket.socket()\n"
          "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind((\"127.0.0.1\", 8123))\n"
          "s.listen()\nn = 0\nwhile True:\n    c, _ = s.accept()\n    n += 1\n"
          "    c.sendall(str(n).encode())\n    c.close()' >/dev/null 2>&1 &")
CLIENT = ("python3 -c 'import socket, time\nfor _ in range(600):\n    try:\n"
          "        c = socket.create_connection((\"127.0.0.1\", 8123)); break\n"
          "    except OSError: time.sleep(0.05)\nprint(c.recv(9).decode())'")


async def test_a_listening_server_and_a_pty_process_go_on_in_the_copy(engine, criu_cached):
    """A server listening on loopback keeps its socket and its state (its count of
    connections), and a process on a pseudo-terminal is there, in the restored copy."""
    sb = await engine.create(network="none", checkpointable=True)
    await engine.exec(sb.id, ["sh", "-c", SERVER])
    assert (await engine.exec(sb.id, ["sh", "-c", CLIENT])).stdout == b"1\n"
    await engine.spawn(sb.id, ["sh", "-c", "read x; echo $x"], terminal=TerminalSize(24, 80))
    snap = await engine.checkpoint(sb.id)
    copy = await engine.restore_checkpoint(snap.id)
    assert (await engine.exec(copy.id, ["sh", "-c", CLIENT])).stdout == b"2\n"
    assert (await engine.exec(sb.id, ["sh", "-c", CLIENT])).stdout == b"2\n"  # apart
    ps = (await engine.exec(copy.id, ["sh", "-c", "cat /proc/[0-9]*/cmdline"])).stdout
    assert b"read x" in ps
    tty = await engine.exec(copy.id, ["sh", "-c", "ls /proc/[0-9]*/fd -l | grep -c /dev/pts/"])
    assert int(tty.stdout) >= 1, tty
    await engine.delete(copy.id)
    await engine.delete_snapshot(snap.id)


async def _until(check, what: str, limit: float = 60.0):  # noqa: ANN001, ANN202 - a test helper
    """Poll ``check`` until it returns something truthy (bounded only against a hang)."""
    for _ in range(int(limit / 0.1)):
        if got := check():
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {limit:g} s: {what}")


async def test_a_hibernated_lifetime_stands_still_and_resumes_with_what_was_left(
        engine, criu_cached):
    """Hibernated time does not count: the reaper leaves a hibernated sandbox alone
    past its deadline, and it resumes with what was left of its lifetime (not a new
    one), which then ends it as a timeout. Its creation time and uid are kept apart."""
    lifetime = 5.0  # the hibernation must come before it ends (3 s did not always, loaded)
    sb = await engine.create(network="none", checkpointable=True, timeout=lifetime)
    created = engine.get(sb.id).created_at
    info = await engine.hibernate(sb.id)
    left = info.spec.timeout
    assert 0 < left < lifetime  # what was left of it when it hibernated
    assert engine._get_live(sb.id).uid == -1  # given back once, not again at its end
    await asyncio.sleep(lifetime)  # past the deadline it had: hibernated, it stays
    assert engine.get(sb.id).state.value == "paused"
    info = await engine.resume(sb.id)
    assert info.state.value == "running" and info.spec.timeout == left
    assert info.created_at == created == engine.get(sb.id).created_at
    ended = await _until(lambda: (i := engine.get(sb.id)).state.terminal and i,
                         "what was left of its lifetime ends it")
    assert ended.state.value == "stopped" and ended.reason.startswith("timeout"), ended.reason


async def test_on_timeout_hibernate_hibernates_at_the_timeout_and_wakes_with_a_new_lifetime(
        engine, criu_cached):
    """``on_timeout="hibernate"``: the timeout hibernates the sandbox (processes kept);
    resumed, it counts on with a lifetime as long as the one that ran out."""
    sb = await engine.create(network="none", checkpointable=True, timeout=600,
                             on_timeout="hibernate")
    await engine.exec(sb.id, ["sh", "-c", COUNTER])
    before = await count(engine, sb.id)
    # 3 s from now, once it counts (a 3 s lifetime from the create could run out before
    # the counter started, under load)
    lifetime = (await engine.set_timeout(sb.id, 3.0)).spec.timeout
    info = await _until(lambda: (i := engine.get(sb.id)).reason == "hibernated" and i,
                        "its timeout hibernates it")
    assert info.state.value == "paused" and engine._get_live(sb.id).hibernated
    await engine.wake(sb.id)
    assert engine.get(sb.id).spec.timeout == lifetime  # a new lifetime, as long
    await engine.set_timeout(sb.id, 600)  # (not hibernated again while it is checked)
    assert await count(engine, sb.id) >= before
    await engine.delete(sb.id)


@pytest.mark.parametrize("kw", [{}, {"checkpointable": True, "network": "host"},
                                {"checkpointable": True, "volumes": {"/data": "v"}},
                                {"checkpointable": True, "gpus": 1}])
def test_on_timeout_hibernate_needs_what_criu_can_dump(kw):
    """Refused at create, typed and naming the field, not when the timeout comes."""
    with pytest.raises(InvalidArgument) as err:
        SandboxSpec.parse(on_timeout="hibernate", **kw)
    assert "on_timeout" in err.value.message
    assert SandboxSpec.parse(on_timeout="hibernate", checkpointable=True).checkpointable
