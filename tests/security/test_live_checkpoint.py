"""Attacks on live checkpoints (issue 29; corral.runtime.checkpoint, docs/live.md).

CRIU runs as root on the host against a sandbox's processes, so a sandbox must not be
able to steer it: hostile symlinks in its writable layer, descriptors open on paths that
look like the host's (``/etc/shadow``, the daemon's state directory), ``/proc/self/fd``
loops, a mount point name CRIU's option syntax would misread. Whatever the dump does,
nothing outside its own root-only images directory changes, the images of one tenant
are apart from another's, and the sandbox goes on untouched."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from corral.errors import InvalidState, Unsupported
from corral.runtime import checkpoint, criu
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root
from tests.security.conftest import assert_honest

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
