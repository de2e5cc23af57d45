"""The state directory is root's alone: the registry holds every sandbox's env (its
secrets masked, the rest in clear), ``secrets/`` the secrets of live sandboxes in clear
for the next engine (:mod:`.secret_store`), the layers hold snapshots' files.

:func:`secure_state_dir` runs at daemon start and fixes what an older daemon (or a
hand-made copy) left more open: every regular file at the top (``registry.db`` and its
``-wal``/``-shm``, ``engine.lock``) becomes 0600, every directory 0700 — except the
state directory itself and ``sandboxes/``, which stay 0711 (traversable, never
listable): bwrap, run as each sandbox's host uid, must reach its own root by path.

It never descends into ``sandboxes/`` or ``layers/``: what lies there are sandboxes'
own files with the modes their code gave them (a snapshot's layer is a restored
sandbox's lower layer), and a host walk of sandbox-made trees is what the threat
model forbids. ``layers/`` itself is 0700, so no local user reaches into it.

A regular file with more than one link is left alone: its mode is its inode's, shared
with a name outside the state directory (a test's private cache hard-links the shared
default image; 0600 there made every sandbox's ``python3`` unexecutable).

It never touches another engine's state either: a directory that holds one (an
``engine.lock`` in it or up to :data:`FOREIGN_DEPTH` levels below, like the nodes of
a local cluster under ``/var/lib/corral/cluster/<node>/state``) is left exactly as it
is. Made 0700, its sandboxes' roots would be out of their own uids' reach.

No process-wide umask: it is inherited by bwrap, the agent and every command a
sandbox runs (files made there must keep the usual 0644), and by the image builds in
the cache directory; each state file is instead created with its mode (the registry
with 0600, see :class:`~corral.runtime.registry.Registry`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["FILE_MODE", "DIR_MODE", "TRAVERSE_MODE", "secure_state_dir"]

FILE_MODE = 0o600
DIR_MODE = 0o700
TRAVERSE_MODE = 0o711  # bwrap, as a sandbox's uid, passes through to its own root
_TRAVERSED = ("sandboxes",)
_NOT_ENTERED = ("sandboxes", "layers")  # sandboxes' own files: never walked
LOCK_NAME = "engine.lock"  # every engine's state directory has one (corral.runtime.warden)
FOREIGN_DEPTH = 3  # how deep below a top-level entry another engine's state is looked for


def secure_state_dir(state_dir: Path) -> list[str]:
    """Make ``state_dir`` root-only (see the module docstring); the paths changed."""
    changed: list[str] = []
    _set_mode(state_dir, TRAVERSE_MODE, changed)
    for entry in os.scandir(state_dir):
        if entry.name not in _NOT_ENTERED and _holds_an_engine(Path(entry.path)):
            continue  # another engine's state: not ours to change
        _secure(Path(entry.path), entry.name in _TRAVERSED, entry.name in _NOT_ENTERED, changed)
    return changed


def _holds_an_engine(path: Path) -> bool:
    """Whether ``path`` is, or holds within :data:`FOREIGN_DEPTH` levels, the state
    directory of an engine (its ``engine.lock``). Symlinks are not followed."""
    level = [path]
    for _ in range(FOREIGN_DEPTH):
        below: list[Path] = []
        for d in level:
            try:
                entries = list(os.scandir(d))
            except (NotADirectoryError, FileNotFoundError):
                continue
            for entry in entries:
                if entry.name == LOCK_NAME and entry.is_file(follow_symlinks=False):
                    return True
                if entry.is_dir(follow_symlinks=False) and entry.name not in _NOT_ENTERED:
                    below.append(Path(entry.path))
        level = below
    return False


def _secure(path: Path, traversed: bool, not_entered: bool, changed: list[str]) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return  # never followed: its target is not ours to change
    if stat.S_ISREG(st.st_mode):
        if st.st_nlink == 1:
            _set_mode(path, FILE_MODE, changed, st)
    elif stat.S_ISDIR(st.st_mode):
        _set_mode(path, TRAVERSE_MODE if traversed else DIR_MODE, changed, st)
        if not not_entered:
            stack = [path]  # iterative: state subdirectories are shallow, but bounded anyway
            seen = 0
            while stack and seen < 100_000:
                for entry in os.scandir(stack.pop()):
                    seen += 1
                    sub = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(sub.st_mode):
                        _set_mode(Path(entry.path), DIR_MODE, changed, sub)
                        stack.append(Path(entry.path))
                    elif stat.S_ISREG(sub.st_mode) and sub.st_nlink == 1:
                        _set_mode(Path(entry.path), FILE_MODE, changed, sub)


def _set_mode(path: Path, mode: int, changed: list[str], st: os.stat_result | None = None) -> None:
    st = st or path.lstat()
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode, follow_symlinks=False)
        changed.append(str(path))
