"""Faults lose nothing, and nothing outlives its engine (issue 12, part 5)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _group_state(dirs: list[str]) -> dict:
    """What is left of a cgroup: its processes and whether any hierarchy is frozen."""
    pids, frozen = set(), False
    for d in map(Path, dirs):
        try:
            pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        except OSError:  # gone (ENOENT), or being removed as it was read (ENODEV)
            continue
        for f, value in (("freezer.state", "FROZEN"), ("cgroup.freeze", "1")):
            try:
                frozen |= (d / f).read_text().strip() == value
            except OSError:
                pass
    return {"pids": sorted(pids), "frozen": frozen}


PAUSED_OWNER = textwrap.dedent(
    """
    import asyncio, json, sys
    from corral.runtime.engine import Engine
    async def main():
        eng = await Engine.open(sys.argv[1])
        info = await eng.create(memory_mb=64)
        await eng.exec(info.id, "sleep 1000 >/dev/null 2>&1 &")
        await eng.pause(info.id)
        cg = eng.cgroup(info.id)
        print(json.dumps({"id": info.id, "dirs": [str(d) for d in cg._dirs.values()],
                          "pids": cg.pids()}), flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
    """
)


async def test_a_paused_sandbox_dies_with_its_engine_without_a_restart(state_dir):
    """kill -9 of the engine: a frozen sandbox is thawed and killed, its cgroup emptied,
    by nobody but what the dead engine left behind (no new engine is started)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", PAUSED_OWNER, str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = owner.stdout.readline()
        assert line, "the owner process did not create its sandbox"
        made = json.loads(line)
        assert made["pids"], "the paused sandbox has no processes"
        before = _group_state(made["dirs"])
        assert before["frozen"] and set(made["pids"]) <= set(before["pids"])
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 60  # only against a hang
        while time.monotonic() < deadline:
            now = _group_state(made["dirs"])
            alive = [p for p in made["pids"] if _running(p)]
            if not alive and not now["pids"] and not now["frozen"]:
                break
            time.sleep(0.1)
        assert not [p for p in made["pids"] if _running(p)], "the frozen sandbox outlived its engine"
        assert _group_state(made["dirs"]) == {"pids": [], "frozen": False}
        parents = {Path(d).parent for d in made["dirs"]}  # the dead engine's own groups
        while any(p.exists() for p in parents) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in parents if p.exists()], "the dead engine's cgroup is left"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        from corral.runtime.engine import Engine  # cleans up whatever is left

        engine = await Engine.open(state_dir)
        await engine.close()


def _procs_named(sandbox_pids: list[int], name: bytes) -> list[int]:
    found = []
    for pid in sandbox_pids:
        try:
            if Path(f"/proc/{pid}/comm").read_bytes().strip() == name and _running(pid):
                found.append(pid)
        except OSError:
            pass
    return found


async def test_a_paused_sandboxs_exec_times_out_at_its_deadline(engine):
    """A pause does not stop a command's timeout: the exec returns ``timed_out`` while
    the sandbox is still paused; the command is killed when it resumes, and the
    sandbox is not blamed."""
    import asyncio

    from corral.schema import SandboxState

    info = await engine.create()
    # 5 s: the echo comes, and the pause below, before it on a loaded host (1 s could not)
    events = engine.exec_stream(info.id, "echo started; exec sleep 600", timeout=5)
    assert (await asyncio.wait_for(events.__anext__(), 30)).data == b"started\n"
    cg = engine.cgroup(info.id)
    deadline = time.monotonic() + 30  # only against a hang: until the shell has exec'd
    while not _procs_named(cg.pids(), b"sleep") and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await engine.pause(info.id)

    async def rest() -> list:
        return [ev async for ev in events]

    result = (await asyncio.wait_for(rest(), 60))[-1].result  # 60 s: only against a hang
    assert result.timed_out and result.returncode == -signal.SIGKILL
    assert engine.get(info.id).state == SandboxState.PAUSED, "the sandbox stays paused"
    assert _procs_named(cg.pids(), b"sleep"), "frozen: the command dies on the resume"
    await engine.resume(info.id)
    deadline = time.monotonic() + 30  # only against a hang
    while _procs_named(cg.pids(), b"sleep") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _procs_named(cg.pids(), b"sleep"), "the timed-out command outlived the resume"
    assert engine.get(info.id).state == SandboxState.RUNNING, engine.get(info.id).reason
    assert (await engine.exec(info.id, "echo still here", timeout=10)).stdout == b"still here\n"


def _launchers(engine) -> list[int]:
    """Launcher processes (``corral-agent launch``) in this engine's cgroups."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            groups = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        if argv[:2] == [str(engine.agent_path).encode(), b"launch"] and (
            engine.cgroup_parent in groups
        ):
            found.append(int(pid))
    return found


def _fill(directory: Path) -> None:
    """Use up every block, then every inode, of the filesystem under ``directory``."""
    try:
        with open(directory / "filler", "wb") as f:
            for _ in range(1 << 16):  # bounded: the tmpfs is a few MiB
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass
    for n in range(1 << 16):
        try:
            (directory / f"inode{n}").touch()
        except OSError:
            break


async def test_a_full_state_dir_is_a_typed_error_and_leaks_nothing():
    """A full disk under the state directory: create, pause and delete raise
    ``StorageFull`` naming it; a failed create leaves no launcher, cgroup or directory;
    a failed delete still frees the sandbox; after space is freed all works again."""
    from corral.errors import StorageFull
    from corral.runtime.engine import Engine
    from corral.schema import SandboxState

    base = Path(tempfile.mkdtemp(prefix="corral-test-full-"))
    os.chmod(base, 0o711)  # bwrap, as the sandbox's host uid, traverses it
    state = base / "state"
    state.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=256,mode=0711", "corral-test", str(state)],
        check=True,
    )
    try:
        engine = await Engine.open(state, warm_slots=0)  # any slot left is a leak
        try:
            info = await engine.create(memory_mb=64)
            _fill(state)
            with pytest.raises(StorageFull) as err:
                await engine.create(memory_mb=64)
            assert str(state) in err.value.message and err.value.status == 507
            own = engine.cgroup(info.id).path.rsplit("/", 1)[1]
            assert engine.cgroups.children(engine.cgroup_parent) == [own], "no slot cgroup left"
            assert _launchers(engine) == [], "no launcher left"
            assert sorted(p.name for p in engine.layout.sandboxes_dir.iterdir()) == [info.id]

            with pytest.raises(StorageFull):
                await engine.pause(info.id)
            assert engine.get(info.id).state == SandboxState.RUNNING
            assert not engine.cgroup(info.id).frozen()
            assert (await engine.exec(info.id, "echo ok", timeout=10)).stdout == b"ok\n"

            with pytest.raises(StorageFull):
                await engine.delete(info.id)
            assert engine.cgroups.children(engine.cgroup_parent) == [], "a failed delete frees"
            assert list(engine.layout.sandboxes_dir.iterdir()) == []

            for p in state.iterdir():  # free the space: everything works again
                if p.name == "filler" or p.name.startswith("inode"):
                    p.unlink()
            assert await engine.delete(info.id)
            again = await engine.create(memory_mb=64)
            assert (await engine.exec(again.id, "echo ok", timeout=10)).stdout == b"ok\n"
            await engine.delete(again.id)
            assert engine.cgroups.children(engine.cgroup_parent) == []
        finally:
            await engine.close()
    finally:
        subprocess.run(["umount", str(state)], check=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def full_state_dir():
    """A state directory on a 4 MiB tmpfs; fill it with ``_fill``."""
    base = Path(tempfile.mkdtemp(prefix="corral-test-full-"))
    os.chmod(base, 0o711)
    state = base / "state"
    state.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=256,mode=0711", "corral-test", str(state)],
        check=True,
    )
    try:
        yield state
    finally:
        subprocess.run(["umount", str(state)], check=True)
        shutil.rmtree(base, ignore_errors=True)


async def test_an_engine_does_not_start_on_a_full_state_dir(full_state_dir):
    """Fresh or used before: ``StorageFull`` naming the state directory and what is
    free there, nothing written; once space is freed it starts."""
    from corral.errors import StorageFull
    from corral.runtime.engine import Engine

    state = full_state_dir
    for used in (False, True):
        if used:
            for p in state.iterdir():
                if p.name == "filler" or p.name.startswith("inode"):
                    p.unlink()
            await (await Engine.open(state, warm_slots=0)).close()
        _fill(state)
        before = sorted(os.listdir(state))
        with pytest.raises(StorageFull) as err:
            await Engine.open(state, warm_slots=0)
        assert str(state) in err.value.message and "MiB" in err.value.message
        assert err.value.details["path"] == str(state) and err.value.status == 507
        assert sorted(os.listdir(state)) == before, "a refused start writes nothing"


@pytest.mark.parametrize("command", [
    ["-m", "corral.server"],  # what the SDK's embedded daemon runs
    ["-c", "import sys; from corral.cli.main import main; sys.exit(main())", "serve"],
])
def test_the_daemon_says_what_is_full_and_exits(command, full_state_dir, tmp_path):
    """``corral serve`` (or ``python -m corral.server``) on a full state directory: exit
    status 1 and one line naming the path and the free space, no traceback."""
    _fill(full_state_dir)
    done = subprocess.run(
        [sys.executable, *command, "--socket", str(tmp_path / "s.sock"),
         "--state-dir", str(full_state_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "cannot start: the filesystem holding" in line and str(full_state_dir) in line
    assert "MiB and" in line and "inodes free there" in line, line


async def test_a_build_killed_mid_layer_leaves_nothing_after_a_restart(state_dir):
    """What a build or import killed with its engine left in the image store (a staged
    layer, a half-written cache entry, half an image) is gone once an engine starts."""
    from corral.runtime import image_cache
    from corral.runtime.engine import Engine

    cache = state_dir / "cache"  # private: the host-wide one may have builds running
    images = cache / "images"
    dead = subprocess.Popen(["true"])
    dead.wait()
    debris = [
        images / ".layers" / ".tmp-0123456789ab" / "tree",
        images / ".layers" / ".trash-0123456789ab",
        images / f".tmp-img-{dead.pid}-0a0b0c0d" / "rootfs",
        images / image_cache.CACHE / f".{'a' * 64}.{dead.pid}.abcdef",
    ]
    for d in debris[:3]:
        d.mkdir(parents=True)
    (debris[0] / "blob").write_bytes(os.urandom(1 << 20))
    debris[3].parent.mkdir(parents=True)
    debris[3].write_text("{")
    kept = images / image_cache.CACHE / f"{'b' * 64}.json"
    kept.write_text("{}")
    engine = await Engine.open(state_dir / "state", cache, warm_slots=0)
    try:
        left = [str(d) for d in debris if d.exists()]
        assert left == [], f"left after the start: {left}"
        assert kept.exists(), "a real cache entry is not debris"
    finally:
        await engine.close()
