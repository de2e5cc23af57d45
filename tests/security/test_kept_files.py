"""A stopped sandbox's kept files are read by the daemon, as root, on the host: the
sandbox wrote that tree to make the host read something else. Symlinks (absolute,
relative, chains, loops), FIFOs, devices, whiteouts: each stays inside the tree."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from corral.errors import FileError, FileNotFound, FileTooLarge
from corral.runtime.events import Events
from corral.runtime.kept_files import KeptFiles
from corral.runtime.layers import TREE
from tests.conftest import have_root_runtime

SECRET = b"host secret\n"


@pytest.fixture
def kept(tmp_path):
    (tmp_path / "host-secret").write_bytes(SECRET)
    store = KeptFiles(tmp_path / "stopped", snapshots=None, events=Events())  # type: ignore[arg-type]
    tree = tmp_path / "stopped" / "sb-x" / TREE
    (tree / "workspace").mkdir(parents=True)
    (tree / "workspace" / "ok.txt").write_bytes(b"mine\n")
    return store, tree, tmp_path


def test_symlinks_resolve_inside_the_tree_never_on_the_host(kept):
    store, tree, host = kept
    ws = tree / "workspace"
    os.symlink(str(host / "host-secret"), ws / "abs")  # the host path: means the tree's
    os.symlink("../" * 40 + str(host / "host-secret").lstrip("/"), ws / "climb")
    os.symlink("/workspace/ok.txt", ws / "inside")
    os.symlink("chain1", ws / "chain0")
    os.symlink("inside", ws / "chain1")
    os.symlink("loop", ws / "loop")
    os.symlink(str(host), ws / "hostdir")
    for path in ("/workspace/abs", "/workspace/climb", "/workspace/hostdir/host-secret"):
        with pytest.raises(FileNotFound):
            store.read("sb-x", path, 1 << 20)
    assert store.read("sb-x", "/workspace/inside", 1 << 20) == b"mine\n"
    assert store.read("sb-x", "/workspace/chain0", 1 << 20) == b"mine\n"
    with pytest.raises(FileError):
        store.read("sb-x", "/workspace/loop", 1 << 20)
    with pytest.raises(FileNotFound):
        store.list_dir("sb-x", "/workspace/hostdir")
    assert store.stat("sb-x", "/workspace/abs").is_symlink  # stat does not follow
    names = [e.name for e in store.list_dir("sb-x", "/workspace")]
    assert "ok.txt" in names and "abs" in names


def test_fifos_devices_and_whiteouts_are_never_opened_for_reading(kept):
    store, tree, _ = kept
    os.mkfifo(tree / "workspace" / "fifo")
    done = threading.Event()

    def read_fifo() -> None:
        with pytest.raises(FileError):
            store.read("sb-x", "/workspace/fifo", 1 << 20)
        done.set()

    t = threading.Thread(target=read_fifo, daemon=True)
    t.start()
    t.join(30)
    assert done.is_set(), "reading a FIFO blocked"
    if os.geteuid() == 0:
        os.mknod(tree / "workspace" / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))
        with pytest.raises(FileNotFound):
            store.read("sb-x", "/workspace/gone", 1 << 20)
        assert "gone" not in [e.name for e in store.list_dir("sb-x", "/workspace")]
    with pytest.raises(FileError):
        store.read("sb-x", "/workspace", 1 << 20)  # a directory


def test_a_file_over_the_limit_is_refused_unread(kept):
    store, tree, _ = kept
    with open(tree / "workspace" / "sparse", "wb") as f:
        f.truncate(1 << 40)  # a terabyte of holes
    with pytest.raises(FileTooLarge):
        store.read("sb-x", "/workspace/sparse", 1 << 20)


async def test_a_stopped_sandbox_symlink_to_the_host_reads_nothing_of_it(engine):
    if not have_root_runtime():
        pytest.skip("needs root")
    secret = engine.layout.state_dir / "registry.db"  # the host file most worth reading
    sid = (await engine.create()).id
    try:
        await engine.exec(sid, ["sh", "-c",
                                f"ln -s {secret} /workspace/a; ln -s ../../../../../..{secret} "
                                "/workspace/b; echo kept > /workspace/c"])
        await engine.stop(sid)
        assert engine.kept.has(sid)
        assert await engine.read_file(sid, "/workspace/c") == b"kept\n"
        for name in ("a", "b"):
            with pytest.raises(FileNotFound):
                await engine.read_file(sid, f"/workspace/{name}")
    finally:
        await engine.delete(sid)


def test_kept_files_never_take_the_disk_below_its_reserve(tmp_path):
    """Each stopped sandbox may have filled its disk_mb: a stream of them must not fill
    the host's disk. On a small filesystem nothing is kept; on a roomy one a small
    sandbox is, a huge one (its disk_mb past the free space) is not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        store = KeptFiles(small / "stopped", snapshots=None, events=Events())  # type: ignore[arg-type]
        assert not store.has_room(1 << 20)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    roomy = KeptFiles(tmp_path / "stopped", snapshots=None, events=Events())  # type: ignore[arg-type]
    vfs = os.statvfs(tmp_path)
    free, size = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    if free < size * 0.2 or free < (2 << 30):
        pytest.skip("the test's disk is too full to show a kept copy allowed")
    assert roomy.has_room(1 << 20)
    assert not roomy.has_room(free)
