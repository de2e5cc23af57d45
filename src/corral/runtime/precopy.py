"""Snapshot commits that keep a running sandbox frozen only for what changed meanwhile.

A commit used to freeze the sandbox for the whole copy of its writable layer (about
250 ms for a 50 MB file on a busy host: issue 30). Now :func:`stage_running`:

1. **precopies** the layer while the sandbox runs, each entry's
   :func:`~corral.runtime.treecopy.signature` recorded *before* it is read;
2. **freezes** it, copies again only what is new or changed since its signature was
   taken, removes what is gone (:func:`corral.runtime.treedelta.sync_delta`), and
   **thaws** it. The staged tree is then the layer exactly as it was frozen: the
   rest of the commit (hashing, sealing, the quota) goes on as before, on that copy.

The copy is the daemon's own, on its own disk: nothing the sandbox does after the
thaw (writing through a descriptor it opened before, through a mapping, from a
sandbox restored from the snapshot) can reach it, and its digest is computed from it.

Why not copy-on-write (measured on the reference host: kernel 6.18, ext4 state
directory, the writable layer on a tmpfs): neither tmpfs nor ext4 has reflinks; and
overlayfs cannot swap its upper directory under running processes: a remount with a
new ``upperdir`` returns 0 and keeps the old one, and a new overlay over the root does
not move processes whose root, working directory, descriptors and mappings pin the old
mount; its upper, moved aside as "the snapshot", would then go on receiving the
writes made through a descriptor opened before the commit.

What a signature cannot see: writes through a *shared writable mapping* of a tmpfs
file change neither its mtime nor its ctime once a page is mapped (measured). So when,
frozen, any process of the sandbox maps a regular file shared and writable, the delta
is not trusted and the layer is copied again whole, frozen, as before; and when one
maps such a file as the commit begins, the layer is copied frozen at once (a mapping
there then, written through and removed before the freeze, would be seen by neither
look). A mapping made *and* removed while the precopy ran (its length: the copy's, tens
of ms for 50 MB) cannot be seen: such a file may hold bytes of any moment of the
precopy.
``CORRAL_SNAPSHOT_PRECOPY=0`` makes every commit a frozen copy.

Timestamps: a kernel >= 6.13 gives a file written just after its ctime was read a
new, fine-grained ctime (multigrain timestamps); on older kernels entries changed in
the last :data:`COARSE_NS` before the precopy are copied again frozen.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from corral.errors import CorralError, StorageFull
from corral.runtime.cgroups import Cgroup
from corral.runtime.layers import LayerStore
from corral.runtime.treecopy import Budget
from corral.runtime.treedelta import Record

ENV = "CORRAL_SNAPSHOT_PRECOPY"  # "0": every commit copies the whole layer frozen
COARSE_NS = 50_000_000  # older than a coarse timestamp's tick, with margin
WHOLE = -1  # Staged.recopied when the whole layer was copied frozen
# a write throttled under disk pressure is frozen only once it wakes: a commit waits
# for it (the sandbox stops meanwhile) rather than fail
FREEZE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Staged:
    """A staged copy, how long its sandbox stayed frozen, and how many entries were
    copied or removed frozen (:data:`WHOLE`: the layer was copied whole, frozen)."""

    tmp: Path
    frozen_s: float
    recopied: int


def enabled() -> bool:
    """Whether commits precopy (``CORRAL_SNAPSHOT_PRECOPY``, default on)."""
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def fine_ctime() -> bool:
    """Whether this kernel has multigrain timestamps (Linux >= 6.13)."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 13)


def stage_running(store: LayerStore, upper: Path, cgroup: Cgroup, *, skip: Iterable[str],
                  budget: Budget, ids: dict[int, int] | None, writeback: bool = True) -> Staged:
    """Stage the writable layer ``upper`` of a running sandbox (its processes in
    ``cgroup``), frozen only for the delta (the module docstring). Blocks.
    ``writeback``: :meth:`LayerStore.stage`'s."""
    skip = tuple(skip)
    # a mapping there now may be written through, unseen, and gone by the freeze
    if not enabled() or writable_shared_maps(cgroup.pids()):
        return _whole(store, upper, cgroup, skip=skip, budget=budget, ids=ids,
                      writeback=writeback)
    record: Record = {}
    since = None if fine_ctime() else time.time_ns() - COARSE_NS
    try:
        tmp = store.stage(upper, skip=skip, budget=budget, ids=ids, record=record,
                          writeback=writeback)
    except StorageFull:
        raise
    except (OSError, CorralError) as exc:  # it changed under the copy: copy it frozen
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise
        _reset(budget)
        return _whole(store, upper, cgroup, skip=skip, budget=budget, ids=ids,
                      writeback=writeback)
    start = time.perf_counter()
    try:
        cgroup.freeze(FREEZE_TIMEOUT_S)
        if writable_shared_maps(cgroup.pids()):
            store.discard(tmp)
            _reset(budget)
            tmp = store.stage(upper, skip=skip, budget=budget, ids=ids, writeback=writeback)
            recopied = WHOLE
        else:
            recopied = store.restage(tmp, upper, record, skip=skip, budget=budget, ids=ids,
                                     suspect_since_ns=since)
    except BaseException:
        store.discard(tmp)
        raise
    finally:
        cgroup.thaw()
    return Staged(tmp, time.perf_counter() - start, recopied)


def _whole(store: LayerStore, upper: Path, cgroup: Cgroup, *, skip: tuple[str, ...],
           budget: Budget, ids: dict[int, int] | None, writeback: bool) -> Staged:
    start = time.perf_counter()
    try:
        cgroup.freeze(FREEZE_TIMEOUT_S)
        tmp = store.stage(upper, skip=skip, budget=budget, ids=ids, writeback=writeback)
    finally:
        cgroup.thaw()
    return Staged(tmp, time.perf_counter() - start, WHOLE)


def _reset(budget: Budget) -> None:
    budget.bytes = budget.inodes = 0


def writable_shared_maps(pids: Iterable[int]) -> bool:
    """Whether any of ``pids`` maps a regular file shared and writable (what a
    signature cannot follow). Read while they are frozen; a process gone is skipped;
    one whose mappings this daemon may not read (without root) counts as mapping one."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                lines = f.read().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            return True
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[1][1:2] != b"w" or fields[1][3:4] != b"s":
                continue
            try:  # the mapped file itself, whatever path the sandbox knows it by
                st = os.stat(f"/proc/{pid}/map_files/{fields[0].decode()}")
            except (FileNotFoundError, ProcessLookupError):
                continue
            except PermissionError:  # map_files needs CAP_SYS_ADMIN: cannot tell
                return True
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 0:
                return True
    return False
