"""Start-up hardening of a state directory: its own entries root-only, and another
engine's state inside it (a local cluster's nodes) left exactly as it is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from corral.runtime.statefiles import secure_state_dir


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_own_entries_are_hardened_and_another_engines_state_is_not_touched(tmp_path):
    state = tmp_path / "state"
    (state / "sandboxes").mkdir(parents=True)
    (state / "slots").mkdir(mode=0o755)
    (state / "registry.db").write_text("")
    os.chmod(state / "registry.db", 0o644)
    # a cluster node's engine, three levels down, as `corral cluster up` makes it
    node = state / "cluster" / "node-1"
    (node / "state" / "sandboxes" / "sb-1").mkdir(parents=True)
    (node / "state" / "engine.lock").write_text("")
    (node / "daemon.log").write_text("")
    for d in (state / "cluster", node, node / "state", node / "state" / "sandboxes"):
        os.chmod(d, 0o711)
    os.chmod(node / "daemon.log", 0o644)
    theirs = {p: mode(p) for p in [state / "cluster", *(state / "cluster").rglob("*")]}
    # a plain directory of ours with no engine in it is still hardened
    (state / "odd" / "deeper").mkdir(parents=True, mode=0o755)
    (state / "odd" / "deeper" / "engine.lock.bak").write_text("")

    changed = secure_state_dir(state)
    assert {p: mode(p) for p in theirs} == theirs
    assert not any("cluster" in c for c in changed)
    assert mode(state / "registry.db") == 0o600
    assert mode(state / "slots") == mode(state / "odd") == mode(state / "odd" / "deeper") == 0o700
    assert mode(state) == mode(state / "sandboxes") == 0o711


def test_a_hard_linked_file_keeps_its_mode(tmp_path):
    """chmod through a hard link changes the other name's file too (a private cache
    that hard-links the shared default image once made its python3 0600)."""
    outside = tmp_path / "shared-python3"
    outside.write_text("#!")
    outside.chmod(0o755)
    state = tmp_path / "state"
    (state / "cache" / "bin").mkdir(parents=True)
    os.link(outside, state / "cache" / "bin" / "python3")
    (state / "registry.db").write_text("")
    (state / "registry.db").chmod(0o644)
    secure_state_dir(state)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert stat.S_IMODE((state / "registry.db").stat().st_mode) == 0o600
