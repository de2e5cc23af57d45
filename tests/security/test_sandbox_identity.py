"""Defence in depth (issue 12): every sandbox runs as a host uid of its own, reused only
once nothing of its sandbox is left, and its mount table names no host path. Layers
stay shareable: what one sandbox wrote is writable in the next, whatever its uid."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from corral.errors import CapacityExceeded
from corral.runtime import uids
from corral.runtime.cgroups import CgroupError
from corral.runtime.image_build import build_image
from corral.runtime.paths import uid_lock_dir
from tests.conftest import requires_root
from tests.security.conftest import agent_host_pid

pytestmark = [requires_root, pytest.mark.timeout(600)]


def host_uid(engine, sid: str) -> tuple[int, int]:
    """The real uid and gid of a sandbox's agent, read from the host."""
    status = Path(f"/proc/{agent_host_pid(engine, sid)}/status").read_text().splitlines()
    ids = {line.split(":")[0]: line.split()[1:] for line in status if line[:4] in ("Uid:", "Gid:")}
    assert len(set(ids["Uid"])) == 1 and len(set(ids["Gid"])) == 1, ids  # real = effective = saved
    return int(ids["Uid"][0]), int(ids["Gid"][0])


async def sh(engine, sid: str, cmd: str) -> str:
    r = await engine.exec(sid, cmd, timeout=60)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


def processes_of(uid: int) -> list[int]:
    """The processes whose real uid is host ``uid`` (not zombies: dead, only waiting for
    their parent, which for orphans is pid 1, to collect their exit status)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = {line.split(":")[0]: line.split()[1:] for line in status if ":" in line}
        if int(fields["Uid"][0]) == uid and fields["State"][0] not in ("Z", "X"):
            found.append(int(pid))
    return found


async def test_two_live_sandboxes_have_different_host_uids(engine):
    a, b = await engine.create(), await engine.create()
    ua, ub = host_uid(engine, a.id), host_uid(engine, b.id)
    assert ua[0] != ub[0] and ua[1] != ub[1]
    for uid, gid in (ua, ub):
        assert uid == gid and uid != uids.CANONICAL_UID and uids.is_sandbox_uid(uid)
    # What each writes is its own on the host too (its writable layer), yet uid 1000 inside.
    for info, (uid, _) in ((a, ua), (b, ub)):
        await engine.write_file(info.id, "/home/sandbox/mine.txt", b"x")
        st = os.stat(engine.upper_dir(info.id) / "home/sandbox/mine.txt")
        assert (st.st_uid, st.st_gid) == (uid, uid)
        assert await sh(engine, info.id, "stat -c %u:%g /home/sandbox/mine.txt; id -u") == "1000:1000\n1000\n"
    # Not even the one signal a shared uid would allow: a's processes cannot reach b's.
    assert processes_of(ua[0]) and not set(processes_of(ua[0])) & set(processes_of(ub[0]))


def test_a_block_hands_out_a_uid_again_only_after_its_release():
    block = uids.UidBlock(-1, 0, size=3)
    first = [block.acquire() for _ in range(3)]
    assert len(set(first)) == 3
    with pytest.raises(CapacityExceeded):
        block.acquire()  # never a uid still in use
    block.release(first[1])
    assert block.acquire() == first[1]
    block.release(first[0])
    block.release(first[0])  # twice: still one
    block.release(12345)  # not ours: ignored
    assert block.acquire() == first[0]
    with pytest.raises(CapacityExceeded):
        block.acquire()


def test_a_block_holds_back_the_uids_processes_still_run_as(tmp_path):
    # What a sandbox that outlived its engine and its warden (both killed) looks like.
    # Near the block's top: other engines on this host (block 0 of their own lock dir)
    # hand out its low uids first, and a uid they use is rightly held back too.
    uid = uids.RANGE_START + uids.BLOCK_SIZE - 3
    survivor = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}",
                                 "--clear-groups", "sleep", "600"])
    block = None
    try:
        for _ in range(6000):  # bounded: until it has dropped to the uid
            if processes_of(uid):
                break
            time.sleep(0.01)
        block = uids.UidBlock.lock(tmp_path / "uids")  # a lock dir of its own: block 0
        assert block.first == uids.RANGE_START
        handed = []
        with pytest.raises(CapacityExceeded):
            for _ in range(uids.BLOCK_SIZE // 2 + 1):
                handed.append(block.acquire())
        # uid is the root of the sandbox whose user is uid - 1 (runtime.uids.root_uid):
        # that pair is held back; the pairs on either side are handed out
        assert uid not in handed and uid - 1 not in handed
        for neighbour in (uid - 3, uid + 1):  # handed, unless a process runs as it
            assert neighbour in handed or processes_of(neighbour) or processes_of(neighbour + 1)
    finally:
        survivor.kill()
        survivor.wait()
        if block is not None:
            block.close()


async def test_a_uid_is_not_reused_while_its_sandbox_could_not_be_cleaned_up(state_dir, monkeypatch):
    from corral.runtime.engine import Engine

    engine = await Engine.open(state_dir, warm_slots=0)
    try:
        stuck, clean = await engine.create(), await engine.create()
        stuck_uid, clean_uid = host_uid(engine, stuck.id)[0], host_uid(engine, clean.id)[0]

        def cannot_remove(*a, **kw):
            raise CgroupError("a process would not die (simulated)")

        # Something of the sandbox is left: its cgroup could not be removed.
        monkeypatch.setattr(engine.cgroup(stuck.id), "remove", cannot_remove)
        await engine.delete(stuck.id)
        await engine.delete(clean.id)
        handed = []
        try:  # every uid the block would still hand out
            for _ in range(uids.BLOCK_SIZE // 2 + 1):
                handed.append(engine.uids.acquire())
        except CapacityExceeded:
            pass
        assert len(handed) < uids.BLOCK_SIZE + 1
        assert clean_uid in handed and stuck_uid not in handed
        for uid in handed:
            engine.uids.release(uid)
        monkeypatch.undo()
    finally:
        await engine.close()


async def test_engines_on_one_host_never_share_uids(engine):
    from corral.runtime.engine import Engine

    other_dir = tempfile.mkdtemp(prefix="corral-test-state-")  # reachable by sandbox uids
    other = await Engine.open(other_dir, warm_slots=0)
    try:
        assert other.uids.index != engine.uids.index
        a, b = await engine.create(), await other.create()
        assert host_uid(engine, a.id)[0] != host_uid(other, b.id)[0]
    finally:
        await other.close()
        shutil.rmtree(other_dir, ignore_errors=True)


_DYING_ENGINE = """
import asyncio, json, sys
from corral.runtime.engine import Engine
async def main():
    engine = await Engine.open(sys.argv[1], warm_slots=0)
    info = await engine.create()
    await engine.pause(info.id)  # frozen: only the warden's thaw lets it die
    print(json.dumps({"block": engine.uids.index, "uid": engine._live[info.id].uid}), flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_a_dead_engines_uids_stay_taken_until_its_sandboxes_are_gone(state_dir):
    owner = subprocess.Popen([sys.executable, "-c", _DYING_ENGINE, str(state_dir)],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        assert line, "the engine did not start"
        made = json.loads(line)
        assert processes_of(made["uid"])  # its sandbox runs, paused
        lock = uid_lock_dir() / f"block-{made['block']:03d}.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its engine holds it
            os.kill(owner.pid, signal.SIGKILL)
            owner.wait()
            for _ in range(6000):  # bounded: the warden kills within seconds
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.01)
            else:
                pytest.fail("the dead engine's block was never released")
            # Free again only now that nothing runs as its sandbox's uid.
            assert processes_of(made["uid"]) == []
        finally:
            os.close(fd)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


async def test_the_mount_table_inside_names_no_host_path(engine):
    share = engine.layout.share_dir / f"t-{secrets.token_hex(4)}.txt"
    share.write_text("shared\n")
    try:
        info = await engine.create(ro_binds=[(str(share), "/.corral/extra/file.txt")])
        out = await sh(engine, info.id, "cat /proc/self/mountinfo /proc/1/mountinfo")
        assert "overlay" in out and "lowerdir=" in out  # the control: we read the table
        for host_path in (engine.layout.state_dir, engine.layout.cache_dir, info.id,
                          engine.images.images_dir, engine.agent_path.name, "/var/lib/corral",
                          "/var/cache/corral"):
            assert str(host_path) not in out, host_path
        # The agent and the read-only file are there all the same, and out of reach.
        assert await sh(engine, info.id, "cat /.corral/extra/file.txt") == "shared\n"
        r = await engine.exec(info.id, "echo x >> /.corral/extra/file.txt || echo denied; "
                              "echo x >> /.corral/agent || echo denied; rm -f /.corral/agent "
                              "|| echo denied")
        assert r.stdout.decode().split() == ["denied"] * 3, r
        assert (await engine.exec(info.id, "true")).returncode == 0  # the agent still serves
    finally:
        share.unlink()


async def test_a_snapshot_restores_writable_in_a_sandbox_with_another_uid(engine):
    a = await engine.create()
    await sh(engine, a.id, "mkdir -p ~/d /workspace/w && echo one > ~/d/f && echo w > /workspace/w/g"
                           " && chmod 600 ~/d/f")
    snap = await engine.snapshot(a.id)
    b = await engine.create(snapshot=snap.id)
    assert host_uid(engine, a.id)[0] != host_uid(engine, b.id)[0]
    # On disk the layer is canonical, not a's uid.
    layer = engine.snapshots.store.path(engine.snapshots.registry.snapshot(snap.id).layers[0])
    owners = {os.stat(layer / p).st_uid for p in ("home/sandbox", "home/sandbox/d/f", "workspace/w/g")}
    assert owners == {uids.CANONICAL_UID}
    out = await sh(engine, b.id, "echo two >> ~/d/f && cat ~/d/f && touch ~/d/new /workspace/w/h "
                                 "&& rm /workspace/w/g && stat -c %u:%g:%a ~/d/f ~/d/new ~/d")
    assert out.splitlines() == ["one", "two", "1000:1000:600", "1000:1000:644", "1000:1000:755"]
    # b's changes went into its own writable layer, as b's host uid
    st = os.stat(engine.upper_dir(b.id) / "home/sandbox/d/new")
    assert st.st_uid == host_uid(engine, b.id)[0]


async def test_an_image_build_steps_files_stay_writable_for_later_sandboxes(engine):
    name = f"t-uid-{secrets.token_hex(4)}"
    try:
        built = await build_image(engine, {"steps": [  # the name: never a cache hit
            {"run": "mkdir -p /workspace/data ~/.config && echo built > /workspace/data/f "
                    f"&& echo cfg > ~/.config/c && echo {name} > ~/.config/name"}]}, name=name)
        assert built.stats.built == 1
        layer = engine.images.images_dir / ".layers" / built.image.layer_ids[0] / "tree"
        assert os.stat(layer / "workspace/data/f").st_uid == uids.CANONICAL_UID  # on disk
        made = [await engine.create(image=name) for _ in range(2)]
        assert host_uid(engine, made[0].id)[0] != host_uid(engine, made[1].id)[0]
        for info in made:
            out = await sh(engine, info.id, "echo more >> /workspace/data/f && cat /workspace/data/f"
                                            " && echo c2 >> ~/.config/c && touch /workspace/data/n"
                                            " && stat -c %u /workspace/data/f /workspace/data/n")
            assert out.splitlines() == ["built", "more", "1000", "1000"]
            await engine.delete(info.id)
    finally:
        if engine.images.exists(name):
            engine.images.remove(name)


def test_a_commit_stores_the_sandbox_uid_as_the_canonical_one_in_acls_too(tmp_path):
    from corral.runtime.treecopy import copy_tree

    sandbox_uid = uids.RANGE_START + 7
    src = tmp_path / "upper"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_text("x")
    (src / "root-owned").write_text("r")
    for p in (src / "d", src / "d" / "f"):
        os.chown(p, sandbox_uid, sandbox_uid)
    # an access ACL: user::rw- user:<sandbox uid>:r-- group::r-- mask::r-- other::---
    entries = [(0x01, 6, 0xFFFFFFFF), (0x02, 4, sandbox_uid), (0x04, 4, 0xFFFFFFFF),
               (0x10, 4, 0xFFFFFFFF), (0x20, 0, 0xFFFFFFFF)]
    acl = (2).to_bytes(4, "little") + b"".join(
        t.to_bytes(2, "little") + p.to_bytes(2, "little") + i.to_bytes(4, "little")
        for t, p, i in entries)
    try:
        os.setxattr(src / "d" / "f", "system.posix_acl_access", acl)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs on {tmp_path}: {exc}")
    copy_tree(src, tmp_path / "layer", ids=uids.canonical_owner(sandbox_uid))
    out = tmp_path / "layer"
    for p in ("d", "d/f"):
        st = os.stat(out / p)
        assert (st.st_uid, st.st_gid) == (uids.CANONICAL_UID, uids.CANONICAL_UID), p
    assert os.stat(out / "root-owned").st_uid == 0  # other owners stay as they are
    copied = os.getxattr(out / "d" / "f", "system.posix_acl_access")
    named = [int.from_bytes(copied[o + 4:o + 8], "little") for o in range(4, len(copied), 8)
             if int.from_bytes(copied[o:o + 2], "little") == 0x02]
    assert named == [uids.CANONICAL_UID]
