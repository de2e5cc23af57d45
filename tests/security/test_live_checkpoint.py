"""Attacks on live checkpoints (issue 29; corral.runtime.checkpoint, docs/live.md).

A checkpointable sandbox and a copy restored from its checkpoint are as confined as any
sandbox (the root-step attacks fail in both, every process checked from the host); a
checkpoint whose images were forged (a user namespace mapping host root, no seccomp
filter, a mount key of its own) restores as the new slot's uid or not at all, and
leaves nothing running.

CRIU runs as root on the host against a sandbox's processes, so a sandbox must not be
able to steer it: hostile symlinks in its writable layer, descriptors open on paths that
look like the host's (``/etc/shadow``, the daemon's state directory), ``/proc/self/fd``
loops, a mount point name CRIU's option syntax would misread. Whatever the dump does,
nothing outside its own root-only images directory changes, the images of one tenant
are apart from another's, and the sandbox goes on untouched."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from corral.errors import (
    CorralError,
    InvalidState,
    SandboxNotFound,
    SnapshotNotFound,
    Unsupported,
)
from corral.runtime import checkpoint, criu, live_images
from corral.runtime.paths import default_cache_dir
from corral.schema import SandboxState
from tests.conftest import requires_root
from tests.security.conftest import assert_honest, run_json
from tests.security.test_root_build import ATTACKS

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

HOSTILE = r"""
set -e
cd /tmp
ln -sf /etc/shadow shadow-link
ln -sf {state} state-link
ln -sf /proc/self/fd/3 loop
mkdir -p {state_parent}
echo fake > {state_parent}/fake
sleep 3600 3<shadow-link 4<{state_parent}/fake 5<>/tmp/loop-target 6</proc/self/mountinfo \
    >/dev/null 2>&1 &
"""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for p in path.rglob("*"):
        st = p.lstat()
        out[str(p)] = (st.st_mode, st.st_size)
    return out


async def test_a_hostile_sandbox_cannot_steer_the_dump(engine):
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    state = engine.layout.state_dir
    sb = await engine.create(network="none")
    r = await engine.exec(sb.id, ["sh", "-c", HOSTILE.format(
        state=state, state_parent=state / "checkpoints" / "_admin")])
    assert r.returncode == 0, r.stderr
    shadow = _digest(Path("/etc/shadow"))
    before = {k: v for k, v in _tree(state).items() if "/checkpoints" not in k}
    live = engine._get_live(sb.id)
    try:
        images = await checkpoint.dump(cache_dir=engine.layout.cache_dir, state_dir=state,
                                       sandbox_id=sb.id, tenant=None,
                                       launcher_pid=live.proc.pid)
    except Unsupported as exc:
        assert exc.details["cause"], exc.message
        images = None
    assert _digest(Path("/etc/shadow")) == shadow
    after = {k: v for k, v in _tree(state).items() if "/checkpoints" not in k}
    assert after.keys() == before.keys()  # nothing made or removed outside the images
    checkpoints = state / "checkpoints"
    assert not (checkpoints / "_admin" / "fake").exists()  # the sandbox's own fake stays in it
    for p in checkpoints.rglob("*"):
        st = p.lstat()
        assert not stat.S_ISLNK(st.st_mode), p  # no link of the sandbox's came along
        assert st.st_uid == 0, p
        if stat.S_ISDIR(st.st_mode):
            assert stat.S_IMODE(st.st_mode) == 0o700, p
    if images is not None:
        assert images.path.parent == checkpoints / "_admin"
    await assert_honest(engine, sb.id)


def test_images_are_root_only_and_per_tenant(tmp_path):
    a = checkpoint.images_root(tmp_path, "alpha")
    b = checkpoint.images_root(tmp_path, "beta")
    admin = checkpoint.images_root(tmp_path, None)
    assert len({a, b, admin}) == 3 and a.parent == b.parent == admin.parent
    for d in (a, b, admin, a.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.geteuid()
    os.chmod(a, 0o755)  # loosened by someone: tightened again on next use
    assert stat.S_IMODE(checkpoint.images_root(tmp_path, "alpha").stat().st_mode) == 0o700


def test_a_planted_symlink_for_a_tenant_is_refused(tmp_path):
    checkpoint.images_root(tmp_path, None)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "checkpoints" / "gamma").symlink_to(target)
    with pytest.raises(InvalidState):
        checkpoint.images_root(tmp_path, "gamma")


def test_mount_points_crius_syntax_would_misread_are_refused(tmp_path, monkeypatch):
    info = tmp_path / "mountinfo"
    info.write_text("636 552 0:145 / / rw - overlay corral-root rw\n"
                    "637 636 0:151 / /x]:evil rw - tmpfs t rw\n")
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text",
                        lambda self, *a, **k: real(info) if str(self) == "/proc/1/mountinfo"
                        else real(self, *a, **k))
    with pytest.raises(Unsupported):
        checkpoint.external_mounts(1)


def _confined(engine, sid: str) -> set[int]:
    """The host uids of a sandbox's processes, each checked to have no capability,
    no_new_privs and a seccomp filter (its outer launcher left out)."""
    live = engine._get_live(sid)
    pids = [p for p in live.cgroup.pids() if p != live.proc.pid]
    assert pids
    live_images.check_restored(pids, outer=live.proc.pid, uid=live.uid,
                               nofile=live.spec.open_files)
    return {int(Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0]) for p in pids}


def _need_criu():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


async def test_a_checkpointable_sandbox_and_its_restored_copy_are_confined(engine, tmp_path):
    _need_criu()
    secret = tmp_path / "host-secret"
    secret.write_text("s3cret")
    code = f"import os; os.environ['SECRET']={str(secret)!r}\n" + ATTACKS
    sb = await engine.create(network="none", checkpointable=True)
    snap = await engine.checkpoint(sb.id)
    copy = await engine.create(snapshot=snap.id)
    try:
        for sid in (sb.id, copy.id):
            got = await run_json(engine, sid, code)
            assert got["uid"] == 1000 and int(got["caps"], 16) == 0, got
            assert got["host_secret"] is False
            for attack in ("mount", "init_module", "finit_module", "core_pattern", "sysrq",
                           "mknod", "unshare_user", "hostname", "raw_socket"):
                assert got[attack] in (1, 2, 13, 22, 30, 38), (sid, attack, got)
            assert _confined(engine, sid) == {engine._get_live(sid).uid}
            await assert_honest(engine, sid)
        assert engine._get_live(copy.id).uid != engine._get_live(sb.id).uid
    finally:
        await engine.delete(copy.id)
        await engine.delete(sb.id)
        await engine.delete_snapshot(snap.id)


def _forge_userns(images: Path) -> None:
    for f in images.glob("userns-*.img"):
        f.write_bytes(live_images.userns_image(0))  # its root as the host's


def _drop_seccomp(images: Path) -> None:
    (images / "seccomp.img").unlink()


def _own_mount_key(images: Path) -> None:
    for f in images.glob("mountpoints-*.img"):
        data = f.read_bytes()
        assert b"dev.shm" in data
        f.write_bytes(data.replace(b"dev.shm", b"dev.shX"))


@pytest.mark.parametrize("forge", [_forge_userns, _drop_seccomp, _own_mount_key])
async def test_a_forged_checkpoint_restores_confined_or_not_at_all(engine, forge):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True)
    snap = await engine.checkpoint(sb.id)
    forge(engine.checkpoint_images(snap.id))
    running = {i.id for i in engine.list() if i.state == SandboxState.RUNNING}
    try:
        try:
            copy = await engine.create(snapshot=snap.id)
        except CorralError as exc:  # refused: nothing of it is left
            assert exc.code, exc.message
            now = {i.id for i in engine.list() if i.state == SandboxState.RUNNING}
            assert now == running
        else:
            try:  # restored: as the new slot's own uid, confined like any sandbox
                uids = _confined(engine, copy.id)
                assert uids == {engine._get_live(copy.id).uid} and 0 not in uids
            finally:
                await engine.delete(copy.id)
        assert (await engine.exec(sb.id, ["echo", "alive"])).stdout.strip() == b"alive"
    finally:
        await engine.delete(sb.id)
        await engine.delete_snapshot(snap.id)


class _Restoring:
    """An engine whose ``create`` gives a copy restored from a checkpoint of a
    checkpointable sandbox: the isolation suite, run against restored copies."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def create(self, *args, **kw):
        sb = await self._engine.create(*args, checkpointable=True, network="none", **kw)
        snap = await self._engine.checkpoint(sb.id)
        await self._engine.delete(sb.id)
        try:
            return await self._engine.create(snapshot=snap.id)
        finally:
            await self._engine.delete_snapshot(snap.id)


@pytest.mark.parametrize("name", [
    "test_host_paths_and_env_are_invisible", "test_image_is_read_only_but_own_dirs_are_writable",
    "test_neighbours_files_and_processes_are_invisible", "test_network_is_loopback_only",
    "test_dangerous_syscalls_are_denied", "test_symlinks_and_dotdot_cannot_reach_the_host",
])
async def test_the_isolation_suite_holds_in_restored_copies(engine, state_dir, name):
    _need_criu()
    from tests.runtime import test_engine_isolation as suite

    test = getattr(suite, name)
    restoring = _Restoring(engine)
    if "state_dir" in test.__code__.co_varnames[:test.__code__.co_argcount]:
        await test(restoring, state_dir)
    else:
        await test(restoring)


async def test_another_tenant_reaches_no_live_snapshot_and_no_hibernated_sandbox(engine):
    """bob cannot restore alice's live snapshot, hibernate, resume or wake her sandbox:
    each answers as an unknown id does, and her sandbox stays hibernated."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    alice, bob = {"owner": "alice"}, {"owner": "bob"}
    snap = await engine.checkpoint(sb.id, name="alice-live", **alice)
    try:
        for ref in (snap.id, "alice-live"):
            with pytest.raises(SnapshotNotFound):
                await engine.create(snapshot=ref, tenant="bob", **bob)
        with pytest.raises(SandboxNotFound):
            await engine.hibernate(sb.id, **bob)
        await engine.hibernate(sb.id, **alice)
        await engine.wake(sb.id, **bob)  # nothing: not bob's
        with pytest.raises(SandboxNotFound):
            await engine.resume(sb.id, **bob)
        assert [s.id for s in engine.list_snapshots(**bob)] == []
        assert engine._get_live(sb.id).hibernated is not None  # still hibernated
        await engine.wake(sb.id, **alice)
        assert (await engine.exec(sb.id, ["echo", "mine"], **alice)).stdout.strip() == b"mine"
    finally:
        await engine.delete(sb.id)
        await engine.delete_snapshot(snap.id)


async def test_a_hibernated_sandbox_with_edited_images_resumes_confined_or_stays_hibernated(
        engine):
    """Its images edited on disk while it sleeps (no seccomp image): the resume fails
    typed, nothing of it runs, it stays hibernated and can be deleted with its images."""
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True)
    await engine.hibernate(sb.id)
    images = engine.checkpoint_images(engine._get_live(sb.id).hibernated)
    _drop_seccomp(images)
    running = {i.id for i in engine.list() if i.state == SandboxState.RUNNING}
    with pytest.raises(CorralError):
        await engine.resume(sb.id)
    assert {i.id for i in engine.list() if i.state == SandboxState.RUNNING} == running
    info = engine.get(sb.id)
    assert info.state == SandboxState.PAUSED and engine._get_live(sb.id).hibernated
    assert await engine.delete(sb.id)
    for _ in range(3000):
        if not images.exists():
            break
        await asyncio.sleep(0.02)
    assert not images.exists()


def test_staged_images_are_links_only_the_restoring_slot_can_read(tmp_path):
    """A restore reads the checkpoint's own files through hard links (no copy): the new
    slot's root may read them until the restore ends, no other uid ever."""
    uid, other = 3_000_000, 3_000_100  # two sandboxes' host uids (never used by a slot)
    images = tmp_path / "snap"
    images.mkdir(mode=0o700)
    for name, data in (("pages-1.img", b"secret" * 1000), ("userns-1.img", b"forged"),
                       (live_images.META, b"{}")):
        (images / name).write_bytes(data)
        os.chmod(images / name, 0o600)
    dest = tmp_path / "sb" / "images"
    dest.parent.mkdir()
    live_images.stage(images, dest, uid=uid)
    page = dest / "pages-1.img"
    assert page.stat().st_ino == (images / "pages-1.img").stat().st_ino  # a link

    def read_as(who: int, path: Path) -> bool:  # from its directory, as CRIU opens them
        return subprocess.run(["setpriv", f"--reuid={who}", f"--regid={who}", "--clear-groups",
                               "cat", path.name], cwd=path.parent,
                              capture_output=True).returncode == 0

    assert read_as(live_images.root_uid(uid), page)
    assert not read_as(uid, page) and not read_as(other, page)
    assert not read_as(live_images.root_uid(other), page)
    assert not read_as(live_images.root_uid(uid), images / "pages-1.img")  # 0700 dir
    assert (dest / "userns-1.img").read_bytes() == live_images.userns_image(uid)  # anew
    assert not (dest / live_images.META).exists()
    live_images.unstage(images, uid=uid)
    assert not read_as(live_images.root_uid(uid), page)  # access taken back
    assert stat.S_IMODE((images / "pages-1.img").stat().st_mode) & 0o077 in (0, 0o040)
