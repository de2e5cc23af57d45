"""Secrets over a restart of the engine (runtime/secret_store.py): a sandbox taken over
by the next engine (adopted, or hibernated and resumed) gives its new commands the
real values, which the registry never held. So they are kept elsewhere on disk, and
that place must be no weaker than the registry:

- the value is in no registry file, and every file holding it in clear is root's,
  0600, in a 0700 directory: a host user that is not root (``nobody``, or any
  sandbox's uid) finds it in no file under the state directory;
- another tenant gets nothing of the sandbox after the restart (every verb answers as
  for an unknown id; a listing leaves it out), and its owner sees it masked;
- deleted (or ended), it leaves the value nowhere on disk.
"""

from __future__ import annotations

import os
import secrets as random
import stat
import subprocess
from pathlib import Path

import pytest

from corral.errors import SandboxNotFound
from corral.runtime.engine import Engine
from tests.conftest import requires_root
from tests.security.test_live_checkpoint import _need_criu

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

ALICE, BOB = {"owner": "alice"}, {"owner": "bob"}
NOBODY = 65534
MASK = "**********"


def _holding(root: Path, value: bytes) -> list[Path]:
    """The files under ``root`` (symlinks not followed) whose bytes hold ``value``."""
    found = []
    for top, _dirs, files in os.walk(root):
        for name in files:
            path = Path(top) / name
            try:
                if stat.S_ISREG(path.lstat().st_mode) and value in path.read_bytes():
                    found.append(path)
            except OSError:
                continue
    return found


def _nobody_finds(root: Path, value: str) -> str:
    """What ``grep`` run as ``nobody`` finds of ``value`` under ``root``."""
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "grep", "-rlF", "--", value, str(root)],
                       capture_output=True, text=True, timeout=120)
    return r.stdout


def _only_root_holds(state: Path, value: str, allowed: tuple[str, ...] = ("secrets",)) -> None:
    holders = _holding(state, value.encode())
    assert holders, "the next engine needs them somewhere"
    for path in holders:
        rel = path.relative_to(state)
        assert rel.parts[0] in allowed, rel  # never the registry (nor its -wal)
        st, parent = path.lstat(), path.parent.lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode) & 0o077) == (0, 0), (rel, oct(st.st_mode))
        assert stat.S_IMODE(parent.st_mode) & 0o077 == 0, (rel, oct(parent.st_mode))
    assert _nobody_finds(state, value) == ""


async def _bob_gets_nothing(engine: Engine, sid: str) -> None:
    with pytest.raises(SandboxNotFound):
        engine.get(sid, **BOB)
    with pytest.raises(SandboxNotFound):
        await engine.exec(sid, ["printenv", "API_KEY"], **BOB)
    assert sid not in [i.id for i in engine.list(**BOB)]
    info = engine.get(sid, **ALICE)  # its owner: masked, as before the restart
    assert info.spec.secrets["API_KEY"].get_secret_value() == MASK


async def test_an_adopted_sandboxs_secrets_are_root_only_and_go_with_it(state_dir):
    value = "s3cret-" + random.token_hex(12)
    first = await Engine.open(state_dir, restore_grace=60, warm_slots=0)
    try:
        sb = await first.create(network="none", tenant="alice", secrets={"API_KEY": value})
        plain = await first.create(network="none", tenant="alice")  # no secrets: no file
    finally:
        await first.close(handover=True)  # what SIGTERM does to a daemon
    second = await Engine.open(state_dir, restore_grace=60, warm_slots=0)
    try:
        r = await second.exec(sb.id, ["printenv", "API_KEY"], **ALICE)
        assert r.stdout == f"{value}\n".encode()
        await _bob_gets_nothing(second, sb.id)
        assert not second.secret_store.get(plain.id)
        _only_root_holds(state_dir, value)
        assert await second.delete(sb.id, **ALICE)
        assert _holding(state_dir, value.encode()) == []
        assert os.listdir(second.secret_store.root) == []
    finally:
        await second.close()


async def test_a_hibernated_sandboxs_secrets_survive_a_restart_and_go_with_it(state_dir):
    _need_criu()
    value = "s3cret-" + random.token_hex(12)
    first = await Engine.open(state_dir)
    try:
        sb = await first.create(network="none", tenant="alice", checkpointable=True,
                                secrets={"API_KEY": value})
        await first.hibernate(sb.id, **ALICE)
    finally:
        await first.close(stop_sandboxes=False)  # a crash: its row and checkpoint stay
    second = await Engine.open(state_dir)
    try:
        await _bob_gets_nothing(second, sb.id)
        # its checkpoint holds its memory (its environment too): root-only, like the store
        _only_root_holds(state_dir, value, allowed=("secrets", "checkpoints"))
        await second.resume(sb.id, **ALICE)
        r = await second.exec(sb.id, ["printenv", "API_KEY"], **ALICE)
        assert r.stdout == f"{value}\n".encode()
        await second.hibernate(sb.id, **ALICE)  # and deleted while hibernated
        assert await second.delete(sb.id, **ALICE)
        await second.close()  # (its checkpoint goes in a task of the engine's)
        assert _holding(state_dir, value.encode()) == []
    finally:
        await second.close()
