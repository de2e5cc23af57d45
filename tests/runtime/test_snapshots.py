"""Snapshots: set an environment up once, start many identical copies of it."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from corral.errors import (
    CapacityExceeded,
    InternalError,
    InvalidArgument,
    InvalidState,
    SnapshotNotFound,
)
from corral.runtime import layers, treecopy
from corral.schema import SandboxState
from tests.conftest import requires_root
from tests.runtime.test_engine_agent import _wheel

pytestmark = [requires_root, pytest.mark.root]

RESTORES = 100
WHEEL = "/tmp/probe-1.0-py3-none-any.whl"


async def sh(engine, sid, cmd: str) -> str:
    r = await engine.exec(sid, cmd)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


async def exists(engine, sid, path: str) -> bool:
    r = await engine.exec(sid, ["test", "-e", path])
    return r.returncode == 0


def merged_root(engine, sid) -> Path:
    """The sandbox's overlay root, from the host: host root may delete image files
    through it (the sandbox user may not), which overlayfs records as whiteouts."""
    return engine.upper_dir(sid).parent.parent / "root"


def layer_dirs(engine) -> set[str]:
    return {p.name for p in engine.layout.layers_dir.iterdir()}


async def two_generations(engine, first_name: str, second_name: str):
    """A snapshot with /workspace/one, and one of a copy of it that adds /workspace/two."""
    base = await engine.create()
    await sh(engine, base.id, "echo one > /workspace/one")
    first = await engine.snapshot(base.id, name=first_name)
    child = await engine.create(snapshot=first.id)
    await sh(engine, child.id, "echo two > /workspace/two")
    second = await engine.snapshot(child.id, name=second_name)
    return first, second, child


async def test_restored_copies_have_the_setup_and_keep_their_writes_apart(engine):
    base = await engine.create(env={"SETUP": "done"}, workdir="/app", tags=["base"])
    await engine.write_file(base.id, WHEEL, _wheel("probe"))
    await sh(engine, base.id, f"pip install --no-index --quiet {WHEEL}")
    await engine.write_file(base.id, "/app/data/cfg.json", '{"level": 3}')
    snap = await engine.snapshot(base.id, name="env")
    assert (snap.name, snap.image, snap.source_sandbox) == ("env", "python", base.id)
    assert len(snap.layers) == 1 and snap.size_bytes > 0
    assert engine.get_snapshot("env") == engine.get_snapshot(snap.id) == snap
    await sh(engine, base.id, "echo later > /app/data/later")  # after the snapshot

    copies = await asyncio.gather(
        *(engine.create(snapshot="env", memory_mb=256) for _ in range(RESTORES))
    )
    spec = copies[0].spec
    # restores inherit the source's spec, but for tags and what was given
    assert (spec.snapshot, spec.env, spec.workdir, spec.memory_mb, spec.tags) == (
        snap.id, {"SETUP": "done"}, "/app", 256, [])

    async def check(i: int, sid: str) -> str:
        out = await sh(engine, sid, f"""python3 -c 'import probe; print(probe.VALUE)'
            cat data/cfg.json; echo; echo $SETUP; test ! -e data/later && echo no-later
            echo {i} > data/mine; sleep 0.2; ls data""")
        return out

    outs = await asyncio.gather(*(check(i, c.id) for i, c in enumerate(copies)))
    for out in outs:
        assert out == '42\n{"level": 3}\ndone\nno-later\ncfg.json\nmine\n'
    reads = await asyncio.gather(*(engine.read_file(c.id, "/app/data/mine") for c in copies))
    assert reads == [f"{i}\n".encode() for i in range(RESTORES)]
    assert await engine.read_file(base.id, "/app/data/later") == b"later\n"
    assert not await exists(engine, base.id, "/app/data/mine")


async def test_a_snapshot_of_a_restored_sandbox_chains_onto_its_parent(engine):
    first, second, child = await two_generations(engine, "first", "second")
    assert len(second.layers) == 2 and second.layers[1] == first.layers[0]
    assert second.source_sandbox == child.id
    grandchild = await engine.create(snapshot="second")
    assert await sh(engine, grandchild.id, "cat /workspace/one /workspace/two") == "one\ntwo\n"
    assert not await exists(engine, (await engine.create(snapshot="first")).id, "/workspace/two")


async def test_deletions_stay_deleted_after_restore_and_after_squash(engine):
    base = await engine.create()
    root = merged_root(engine, base.id)
    assert await exists(engine, base.id, "/etc/issue")
    assert await exists(engine, base.id, "/etc/skel/.bashrc")
    (root / "etc/issue").unlink()  # an image file: becomes a whiteout
    shutil.rmtree(root / "etc/skel")  # an image directory, made anew: an opaque one
    (root / "etc/skel").mkdir()
    (root / "etc/skel/new").write_text("new\n")
    await sh(engine, base.id, "mkdir -p /workspace/dir && touch /workspace/keep /workspace/gone /workspace/dir/a /workspace/dir/b")
    s1 = await engine.snapshot(base.id)

    child = await engine.create(snapshot=s1.id)
    root = merged_root(engine, child.id)
    (root / "etc/issue.net").unlink()  # an image file deleted in a higher layer
    (root / "etc/skel/child").write_text("child\n")  # merges with the opaque directory below
    await sh(engine, child.id, "rm /workspace/gone && rm -r /workspace/dir && mkdir /workspace/dir && touch /workspace/dir/c")
    s2 = await engine.snapshot(child.id)
    assert len(s2.layers) == 2

    engine.snapshots.max_depth = 2  # the next snapshot squashes its chain of 3
    grandchild = await engine.create(snapshot=s2.id)
    await sh(engine, grandchild.id, "touch /workspace/third")
    s3 = await engine.snapshot(grandchild.id)
    assert len(s3.layers) == 1 and s3.layers[0] not in s1.layers + s2.layers
    whiteout = os.lstat(engine.snapshots.store.path(s3.layers[0]) / "etc/issue")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0  # kept by the squash

    expected = "dir/c\nkeep\nthird\n"
    for snap in (s2, s3):
        sid = (await engine.create(snapshot=snap.id)).id
        assert not await exists(engine, sid, "/etc/issue"), snap.layers
        assert not await exists(engine, sid, "/etc/issue.net"), snap.layers
        assert await exists(engine, sid, "/etc/hostname")
        assert await sh(engine, sid, "ls -A /etc/skel") == "child\nnew\n"
        listing = await sh(engine, sid, "cd /workspace && find . -type f | sed 's|^./||' | sort")
        assert listing == (expected if snap is s3 else expected.replace("third\n", ""))


async def test_gc_frees_unreferenced_layers_and_never_a_referenced_one(engine):
    a, b, child = await two_generations(engine, "a", "b")
    await engine.delete(child.id)
    assert layer_dirs(engine) == set(b.layers)

    assert await engine.delete_snapshot("a") is True
    assert await engine.delete_snapshot("a") is False
    assert await engine.gc_layers() == []  # a's layer is still b's bottom layer
    assert layer_dirs(engine) == set(b.layers)
    sid = (await engine.create(snapshot="b")).id
    assert await sh(engine, sid, "cat /workspace/one /workspace/two") == "one\ntwo\n"
    await engine.delete(sid)

    assert await engine.delete_snapshot(b.id) is True
    assert layer_dirs(engine) == set()  # collected as soon as unreferenced
    assert engine.list_snapshots() == []
    with pytest.raises(SnapshotNotFound):
        engine.get_snapshot(a.id)


async def test_deleting_a_snapshot_in_use_waits_for_its_last_user(engine):
    base = await engine.create()
    await sh(engine, base.id, "mkdir -p /workspace/lib && seq 1000 > /workspace/lib/numbers")
    snap = await engine.snapshot(base.id, name="in-use")
    users = [await engine.create(snapshot="in-use") for _ in range(2)]
    assert await engine.delete_snapshot("in-use") is True
    with pytest.raises(SnapshotNotFound) as exc:
        await engine.create(snapshot="in-use")
    assert exc.value.code == "snapshot_not_found"
    assert engine.list_snapshots() == []
    assert layer_dirs(engine) == set(snap.layers)
    for u in users:  # files from the deleted snapshot's layer still read, writes still work
        assert await sh(engine, u.id, "tail -1 /workspace/lib/numbers; echo x >> /workspace/lib/numbers; wc -l < /workspace/lib/numbers") == "1000\n1001\n"

    # a snapshot of a sandbox whose snapshot is deleted still chains onto it
    later = await engine.snapshot(users[0].id, name="later")
    assert later.layers[1:] == snap.layers
    await engine.delete(users[0].id)
    await engine.delete(users[1].id)
    assert layer_dirs(engine) == set(later.layers)  # the old layer lives on in "later"
    sid = (await engine.create(snapshot="later")).id
    assert await sh(engine, sid, "wc -l < /workspace/lib/numbers") == "1001\n"
    await engine.delete(sid)
    await engine.delete_snapshot("later")
    assert layer_dirs(engine) == set()
    assert (await engine.snapshot(base.id, name="in-use")).name == "in-use"  # free again


async def test_a_failed_commit_leaves_no_layer_and_the_sandbox_running(engine, monkeypatch):
    base = await engine.create()
    await sh(engine, base.id, "mkdir /workspace/d && for i in $(seq 20); do echo $i > /workspace/d/$i; done")
    good = await engine.snapshot(base.id, name="good")
    before = layer_dirs(engine)
    copy = treecopy.copy_node
    calls = 0

    def failing(*args):
        nonlocal calls
        calls += 1
        if calls == 10:
            raise OSError(errno.ENOSPC, "No space left on device", args[3])
        copy(*args)

    def denied(*args):
        raise PermissionError(errno.EACCES, "Permission denied", args[3])

    monkeypatch.setattr(treecopy, "copy_node", failing)
    with pytest.raises(CapacityExceeded, match="no space left"):
        await engine.snapshot(base.id, name="bad")
    monkeypatch.setattr(treecopy, "copy_node", denied)
    with pytest.raises(InternalError, match=base.id):
        await engine.snapshot(base.id, name="bad")
    assert layer_dirs(engine) == before  # no layer, no temporary directory
    assert [s.name for s in engine.list_snapshots()] == ["good"]
    assert engine.get(base.id).state == SandboxState.RUNNING
    assert not engine.cgroup(base.id).frozen()
    assert await sh(engine, base.id, "cat /workspace/d/20") == "20\n"
    monkeypatch.undo()
    sid = (await engine.create(snapshot=good.id)).id
    assert await sh(engine, sid, "ls /workspace/d | wc -l") == "20\n"
    assert (await engine.snapshot(base.id, name="bad")).name == "bad"


CRASHER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from corral.runtime import treecopy
    from corral.runtime.engine import Engine

    async def main():
        eng = await Engine.open(sys.argv[1])
        sb = await eng.create()
        await eng.exec(sb.id, "echo old > /workspace/f")
        snap = await eng.snapshot(sb.id, name="old")
        await eng.exec(sb.id, "for i in $(seq 50); do echo $i > /workspace/n$i; done")
        copy = treecopy.copy_node
        def slow(*args):
            copy(*args)
            print("copying", flush=True)
            time.sleep(3600)
        treecopy.copy_node = slow
        await eng.snapshot(sb.id, name="new")
    asyncio.run(main())
    """
)


async def test_a_crash_during_commit_keeps_the_old_state(state_dir):
    from corral.runtime.engine import Engine

    crasher = subprocess.Popen(
        [sys.executable, "-c", CRASHER, str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert crasher.stdout.readline() == "copying\n", "the crasher did not start its commit"
        os.kill(crasher.pid, signal.SIGKILL)
        crasher.wait()
        layers_dir = state_dir / "layers"
        assert any(p.name.startswith(".tmp-") for p in layers_dir.iterdir())
        (layers_dir / "0123456789abcdef").mkdir()  # as if renamed into place, no row yet
        engine = await Engine.open(state_dir)
        try:
            assert [s.name for s in engine.list_snapshots()] == ["old"]
            assert layer_dirs(engine) == set(engine.get_snapshot("old").layers)
            sid = (await engine.create(snapshot="old")).id
            assert await sh(engine, sid, "cat /workspace/f; ls /workspace") == "old\nf\n"
        finally:
            await engine.close()
    finally:
        if crasher.poll() is None:
            crasher.kill()
            crasher.wait()


async def test_snapshots_survive_a_restart_and_are_verified(state_dir):
    from corral.runtime.engine import Engine

    async with await Engine.open(state_dir) as engine:
        base = await engine.create()
        await sh(engine, base.id, "echo kept > /workspace/kept && echo other > /workspace/other")
        kept = await engine.snapshot(base.id, name="kept")
        user = await engine.create(snapshot="kept")  # alive at the restart
        await sh(engine, user.id, "echo other2 > /workspace/other")
        other = await engine.snapshot(user.id, name="other")
        await engine.delete_snapshot("kept")  # deferred: "user" still runs on it
    async with await Engine.open(state_dir) as engine:
        # "user" ended with its engine, so "kept" is gone for good; "other" keeps its layer
        assert [s.name for s in engine.list_snapshots()] == ["other"]
        assert layer_dirs(engine) == set(other.layers) >= set(kept.layers)
        sid = (await engine.create(snapshot="other")).id
        assert await sh(engine, sid, "cat /workspace/kept /workspace/other") == "kept\nother2\n"
        await engine.verify_snapshot("other")

        data = engine.snapshots.store.path(other.layers[0]) / "workspace/other"
        data.write_text("tampered\n")
        with pytest.raises(InvalidState, match="checksum"):
            await engine.verify_snapshot("other")
        with pytest.raises(InvalidState, match="checksum"):
            await engine.create(snapshot="other")
    async with await Engine.open(state_dir) as engine:
        with pytest.raises(InvalidState, match=other.layers[0]):  # checked before first use
            await engine.create(snapshot="other")
        data.write_text("other2\n")
        os.utime(data, ns=(0, 0))
        with pytest.raises(InvalidState):  # the mtime is part of the checksum too
            await engine.verify_snapshot("other")


async def test_fork_makes_n_copies_that_outlive_nothing(engine):
    src = await engine.create(env={"ROLE": "src"}, tags=["job=7"])
    await sh(engine, src.id, "echo state > /workspace/state")
    forks = await engine.fork(src.id, 3)
    assert len({f.id for f in forks}) == 3
    for f in forks:
        assert f.spec.tags == ["job=7"] and f.spec.env == {"ROLE": "src"}
        assert await sh(engine, f.id, "cat /workspace/state; echo $ROLE") == "state\nsrc\n"
    assert engine.list_snapshots() == []  # fork's snapshot is not kept
    assert layer_dirs(engine)
    await asyncio.gather(*(engine.delete(f.id) for f in forks))
    assert layer_dirs(engine) == set()
    with pytest.raises(InvalidArgument):
        await engine.fork(src.id, 0)


async def test_paused_sandboxes_snapshot_and_stay_paused(engine):
    sb = await engine.create()
    await sh(engine, sb.id, "echo p > /workspace/p")
    await engine.pause(sb.id)
    snap = await engine.snapshot(sb.id)
    assert engine.get(sb.id).state == SandboxState.PAUSED and engine.cgroup(sb.id).frozen()
    sid = (await engine.create(snapshot=snap.id)).id
    assert await sh(engine, sid, "cat /workspace/p") == "p\n"


async def test_bad_names_and_references(engine):
    sb = await engine.create()
    for bad in ("", "has space", "snap-123", "-x", "x" * 65):
        with pytest.raises(InvalidArgument):
            await engine.snapshot(sb.id, name=bad)
    await engine.snapshot(sb.id, name="taken")
    with pytest.raises(InvalidState, match="already exists"):
        await engine.snapshot(sb.id, name="taken")
    for ref in ("nope", "snap-000000000000"):
        with pytest.raises(SnapshotNotFound):
            engine.get_snapshot(ref)
        with pytest.raises(SnapshotNotFound):
            await engine.create(snapshot=ref)
    with pytest.raises(InvalidArgument, match="image"):
        await engine.create(snapshot="taken", image="other")
    await engine.stop(sb.id)
    with pytest.raises(InvalidState):
        await engine.snapshot(sb.id)
    assert [s.name for s in engine.list_snapshots()] == ["taken"]


def test_layer_copy_keeps_what_overlayfs_needs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (devices, trusted.* xattrs, chown)")
    src = tmp_path / "upper"
    (src / "d").mkdir(parents=True)
    (src / "d/f").write_bytes(b"x" * 100_000)
    os.link(src / "d/f", src / "d/hard")
    os.symlink("f", src / "d/link")
    os.mknod(src / "d/whiteout", stat.S_IFCHR, os.makedev(0, 0))
    os.setxattr(src / "d", layers.OPAQUE, b"y")
    os.setxattr(src / "d", "trusted.overlay.origin", b"\0handle")
    os.chown(src / "d/f", 1_000_000, 1_000_000)
    os.chmod(src / "d/f", 0o4750)
    os.utime(src / "d/f", ns=(1, 2))
    os.mkdir(src / ".corral")
    store = layers.LayerStore(tmp_path / "layers")
    store.open([])
    tmp = store.stage(src, skip=[".corral"])
    out = tmp / layers.TREE
    st = os.stat(out / "d/f")
    assert (st.st_uid, stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (1_000_000, 0o4750, 2)
    assert st.st_ino == os.stat(out / "d/hard").st_ino
    assert os.readlink(out / "d/link") == "f"
    assert os.lstat(out / "d/whiteout").st_rdev == 0
    assert os.listxattr(out / "d") == [layers.OPAQUE]  # the overlay's bookkeeping dropped
    assert not (out / ".corral").exists()
    sealed = store.seal(tmp)
    layer, new = store.install(sealed)
    assert new and store.verify(layer.id, layer.digest)
    again, new = store.install(store.seal(store.stage(src, skip=[".corral"])))
    assert again == layer and not new  # content-addressed: stored once
    assert store.open([layer.id]) == [] and store.open([]) == [layer.id]


def _entry(path: Path, **kind) -> None:
    """Make one entry of a hand-made layer: a file (text), dir, whiteout or symlink."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if "text" in kind:
        path.write_text(kind["text"])
    elif "link" in kind:
        os.symlink(kind["link"], path)
    elif kind.get("whiteout"):
        os.mknod(path, stat.S_IFCHR, os.makedev(0, 0))
    else:
        path.mkdir(exist_ok=True)
    if kind.get("opaque"):
        os.setxattr(path, layers.OPAQUE, b"y")
    if "xattr" in kind:
        os.setxattr(path, "user.test", kind["xattr"], follow_symlinks=False)


def _view(root: Path) -> dict[str, tuple]:
    """What a mounted overlay shows: every path's type, mode, size, content, user xattrs."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else (
                os.readlink(p) if stat.S_ISLNK(st.st_mode) else None)
            xattrs = {} if stat.S_ISLNK(st.st_mode) else {
                k: os.getxattr(p, k) for k in os.listxattr(p) if k.startswith("user.")}
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), data, xattrs)
    return out


def test_squash_shows_what_overlayfs_shows_for_the_whole_chain(tmp_path):
    """Every way two layers can meet over an image, folded and compared with overlayfs
    mounting the same layers unsquashed."""
    if os.geteuid() != 0:
        pytest.skip("needs root (overlay mounts, trusted.* xattrs)")
    from corral.runtime import syscalls

    image, l1, l2, l3 = (tmp_path / n for n in ("image", "l1", "l2", "l3"))
    for rel, kind in {
        "a/x": dict(text="image"), "a/y": dict(text="image"), "b": dict(text="file"),
        "c/z": dict(text="image"), "d/w": dict(text="image"), "e/old": dict(text="image"),
        "f/q": dict(text="image"), "g/h": dict(text="image"), "top": dict(text="image"),
    }.items():
        _entry(image / rel, **kind)
    for root, entries in {
        l1: {"a/x": dict(whiteout=True), "c": dict(opaque=True), "c/new": dict(text="l1"),
             "e": dict(whiteout=True), "f/r": dict(text="l1"), "g": dict(text="a file now"),
             "k/1": dict(text="l1"), "k/2": dict(text="l1"), "top": dict(whiteout=True)},
        l2: {"a/x": dict(text="back"), "b/1": dict(text="dir over image file"),
             "c/more": dict(text="l2"), "d": dict(whiteout=True),
             "e/1": dict(text="dir over a whiteout"), "f": dict(xattr=b"l2"),
             "f/q": dict(whiteout=True), "g": dict(whiteout=True), "k/3": dict(text="l2"),
             "k/1": dict(whiteout=True), "sl": dict(link="a/x")},
        l3: {"k": dict(opaque=True), "k/4": dict(text="l3"), "c/z": dict(text="l3 again"),
             "top": dict(text="l3")},
    }.items():
        root.mkdir()
        for rel, kind in entries.items():
            _entry(root / rel, **kind)
    _entry(l1 / "h/2", text="linked")
    os.link(l1 / "h/2", l1 / "h/2-link")

    store = layers.LayerStore(tmp_path / "layers")
    store.open([])
    squashed = store.stage_squashed([l3, l2, l1]) / layers.TREE
    views = []
    for lowers in ([l3, l2, l1, image], [squashed, image]):
        mnt = tmp_path / f"mnt{len(views)}"
        mnt.mkdir()
        syscalls.mount("overlay", str(mnt), "overlay", 0, "lowerdir=" + ":".join(map(str, lowers)))
        try:
            views.append(_view(mnt))
        finally:
            syscalls.umount(str(mnt))
    chain, folded = views
    assert "a/x" in chain and "top" in chain and "e/old" not in chain and "c/z" in chain
    assert "d" not in chain and "g" not in chain and "b/1" in chain and "k/1" not in chain
    assert folded == chain
