"""Bring a copy of a tree up to date with it, copying only what changed since the copy.

The second half of a commit made while the sandbox ran (:mod:`corral.runtime.precopy`):
:func:`~corral.runtime.treecopy.copy_tree` copied the writable layer with each entry's
:func:`~corral.runtime.treecopy.signature` recorded before it was read; once the
sandbox is frozen, :func:`sync_delta` walks the layer again and, in the copy:

- copies again each entry that is new, whose signature changed, or that is a hard link
  (its other names may have been copied at other moments: all are copied again);
- makes a directory that is new, replaced or moved (and copies all it holds), and
  removes what the layer no longer has;
- sets a directory's attributes again (extended ones removed first) when it or an
  entry in it changed.

Same walks, same rules as the copy itself (:mod:`corral.runtime.treecopy`: iterative,
descriptor-relative, never following a symlink, sparse-aware, charged to the budget).
"""

from __future__ import annotations

import os
import stat

from corral.runtime.streamhash import Hasher
from corral.runtime.treecopy import (
    _O_DIR,
    ENTER,
    NODE,
    Budget,
    CopyState,
    Walk,
    _Fds,
    copy_meta,
    copy_node,
    fd_path,
    remove_tree,
    signature,
)

Record = dict[bytes, tuple[int, ...]]


def sync_delta(src: str | os.PathLike[str], dst: str | os.PathLike[str], record: Record, *,
               skip: frozenset[str] = frozenset(), budget: Budget | None = None,
               ids: dict[int, int] | None = None, hasher: Hasher | None = None,
               suspect_since_ns: int | None = None) -> int:
    """Make ``dst`` (copied from ``src`` with ``record``) equal to ``src`` now; returns
    how many entries were copied or removed. ``hasher``: the copy's, told of each file
    removed. ``suspect_since_ns``: entries whose recorded ctime is this late are copied
    again however they look (a kernel whose timestamps are coarse may not have changed
    the ctime of a file written in the same tick)."""
    out = _Fds(os.open(dst, _O_DIR))
    ctx = CopyState(budget, link_base=out.fds[0], ids=ids)
    walk = Walk(src, skip=skip)
    seen: list[set[str]] = []  # per open directory: the names it has now
    dirty: list[bool] = []  # per open directory: its attributes or entries changed
    fresh: list[bool] = [False]  # per open directory: made by this pass (copy it all)
    n = 0

    def changed(old: tuple[int, ...] | None, st: os.stat_result) -> bool:
        if old is None or old != signature(st):
            return True
        return suspect_since_ns is not None and old[-1] >= suspect_since_ns

    try:
        for kind, parent, name, st, fd in walk:
            if kind == ENTER:
                old = record.get(walk.key())
                new = False
                if parent != -1:
                    seen[-1].add(name)
                    # a directory moved here keeps its entries' signatures: all are copied
                    new = fresh[-1] or old is None or old[0] != st.st_ino or not stat.S_ISDIR(
                        old[1])
                    if new:
                        _remove(out.top, name, hasher, budget)
                        os.mkdir(name, 0o700, dir_fd=out.top)
                        dirty[-1] = True
                        n += 1
                    out.push(os.open(name, _O_DIR, dir_fd=out.top))
                    fresh.append(new)
                seen.append(set())
                dirty.append(new or changed(old, st))
            elif kind == NODE:
                seen[-1].add(name)
                if fresh[-1] or st.st_nlink > 1 or changed(record.get(walk.key(name)), st):
                    _remove(out.top, name, hasher, budget)
                    copy_node(parent, name, out.top, name, st, ctx,
                              walk.place(name) if st.st_nlink > 1 else "")
                    dirty[-1] = True
                    n += 1
            else:  # LEAVE
                names = seen.pop()
                if dirty.pop():
                    for gone in set(os.listdir(out.top)) - names:
                        _remove(out.top, gone, hasher, budget)
                        n += 1
                    for attr in os.listxattr(out.top):  # those removed since must go too
                        os.removexattr(out.top, attr)
                    copy_meta(fd, out.top, st, ids)
                    if dirty:
                        dirty[-1] = True  # its parent's mtime moved with it
                if parent != -1:
                    out.pop()
                    fresh.pop()
    finally:
        out.close()
    return n


def _remove(dir_fd: int, name: str, hasher: Hasher | None, budget: Budget | None) -> None:
    """Remove ``name`` from the copy (if there), uncharging it and forgetting its hash."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        if hasher is not None:
            hasher.forget(st)
        if budget is not None and st.st_nlink == 1:
            budget.bytes = max(0, budget.bytes - st.st_blocks * 512)
    remove_tree(fd_path(dir_fd, name))
