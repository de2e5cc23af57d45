"""Host identities of sandboxes: each its own uid/gid, never shared, reused only late.

Every sandbox runs as a host uid (and gid of the same number) of its own, and its root
(uid 0 of its user namespace, docs/users.md) as the next one (:func:`root_uid`): a
sandbox holds an even uid and the odd one after it. So two
sandboxes never share a host identity: a process of one cannot signal, ptrace or
read the files of another even if it escaped its namespaces, and per-user kernel
counters (``RLIMIT_NPROC``, user-namespace and inotify counts) are per sandbox.

Layers on disk do not know about these uids: what sandboxes write is stored owned by
:data:`CANONICAL_UID`, so a snapshot taken in one sandbox is writable when restored in
another. The launcher gives each sandbox *idmapped* clones of its lower layers in
which the canonical uid and the sandbox's swap places (``agent/launch.c``); a commit
translates back (:func:`canonical_owner`, used by :mod:`corral.runtime.treecopy`).

Allocation is machine-wide, as several engines (state directories) may share a host::

    <runtime dir>/uids/block-NNN.lock    flock'd by the engine that uses block NNN

An engine locks one free block of :data:`BLOCK_SIZE` uids when it opens and hands
them out in memory. Its warden inherits the lock (:mod:`corral.runtime.warden`): if the
engine dies, the block stays taken until the warden has killed every sandbox of it.
Within the block, a uid goes back to the end of the free queue only when its sandbox
has gone (its cgroup removed, or found empty and recycled: no process left; its mounts
die with them); one that could not be cleaned up stays out of use for the engine's
lifetime. And a block is checked when locked: a uid some process still runs as (a
sandbox that outlived both its engine and its warden, both killed) is held back too.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections import deque
from pathlib import Path

from corral.errors import CapacityExceeded

SANDBOX_UID = 1000  # the user inside every sandbox (uid and gid)
SANDBOX_HOME = "/home/sandbox"
CANONICAL_UID = 1_000_000  # owner of sandbox files in layers; never a sandbox's own
RANGE_START = 1 << 20  # first sandbox uid (above the canonical one)
BLOCK_SIZE = 16384  # uids per engine: two per sandbox or warm slot (its user, its root)
BLOCKS = 64  # engines per host
_ACL_XATTRS = ("system.posix_acl_access", "system.posix_acl_default")
_ACL_USER, _ACL_GROUP = 0x02, 0x08  # ACL_USER, ACL_GROUP tags: entries naming an id


def is_sandbox_uid(uid: int) -> bool:
    """Whether ``uid`` is one corral hands to sandboxes (or the canonical owner)."""
    return uid == CANONICAL_UID or RANGE_START <= uid < RANGE_START + BLOCKS * BLOCK_SIZE


def root_uid(uid: int) -> int:
    """The host uid of the root of the sandbox whose user runs as host ``uid``."""
    return uid + 1


def canonical_owner(uid: int) -> dict[int, int]:
    """How ids of a sandbox running as ``uid`` are stored in a layer: its user's files
    as the canonical owner's, its root's as root's (like the image's own)."""
    return {uid: CANONICAL_UID, root_uid(uid): 0}


def translate_acl(name: str, value: bytes, ids: dict[int, int]) -> bytes:
    """A POSIX ACL xattr with the ids it names translated (other xattrs unchanged)."""
    if name not in _ACL_XATTRS or not ids or len(value) < 4 or (len(value) - 4) % 8:
        return value
    out = bytearray(value)
    for off in range(4, len(value), 8):
        tag, _perm, ident = struct.unpack_from("<HHI", value, off)
        if tag in (_ACL_USER, _ACL_GROUP) and ident in ids:
            struct.pack_into("<I", out, off + 4, ids[ident])
    return bytes(out)


def uids_in_use(low: int, high: int) -> set[int]:
    """The real uids in ``[low, high)`` that a process on the host runs as (zombies,
    which are dead and only wait to be collected, excepted)."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue  # gone meanwhile
        state = uid = None
        for line in status.splitlines():
            if line.startswith(b"State:"):
                state = line.split()[1:2]
            elif line.startswith(b"Uid:"):
                uid = int(line.split()[1])
                break
        if uid is not None and low <= uid < high and state not in ([b"Z"], [b"X"]):
            found.add(uid)
    return found


class UidBlock:
    """The block of uids one engine holds; :meth:`acquire` and :meth:`release` them."""

    def __init__(self, fd: int, index: int, size: int = BLOCK_SIZE // 2) -> None:
        self.fd = fd  # the lock: pass it to the warden
        self.index = index
        self.first = first = RANGE_START + index * BLOCK_SIZE
        # ``size`` sandboxes: even uids only, each sandbox's root the odd one after
        self._free = deque(range(first, first + 2 * min(size, BLOCK_SIZE // 2), 2))
        self._used: set[int] = set()
        self._mutex = threading.Lock()  # releases come from teardown threads

    @classmethod
    def lock(cls, lock_dir: Path) -> "UidBlock":
        """Lock the first free block of the host (:class:`CapacityExceeded` if none)."""
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for index in range(BLOCKS):
            fd = os.open(lock_dir / f"block-{index:03d}.lock",
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                raise
            block = cls(fd, index)
            block.hold_back(uids_in_use(block.first, block.first + BLOCK_SIZE))
            return block
        raise CapacityExceeded(
            f"all {BLOCKS} blocks of sandbox uids under {lock_dir} are held by running "
            "corral engines (or by the wardens of engines that died, until they have "
            "cleaned up): stop an engine first")

    @classmethod
    def adopt(cls, fd: int) -> "UidBlock":
        """The block whose lock ``fd`` is (handed over by a dead engine's warden:
        :mod:`corral.runtime.restore`); the uids its sandboxes still run as are held
        back until :meth:`take` claims them for the sandboxes adopted."""
        name = os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1]
        index = int(name.removeprefix("block-").removesuffix(".lock"))
        block = cls(fd, index)
        block.hold_back(uids_in_use(block.first, block.first + BLOCK_SIZE))
        return block

    def take(self, uid: int) -> None:
        """An adopted sandbox runs as ``uid``: in use, released when it ends."""
        with self._mutex:
            if self.first <= uid < self.first + BLOCK_SIZE:
                self._free = deque(u for u in self._free if u != uid)
                self._used.add(uid)

    def acquire(self) -> int:
        """A uid no live sandbox uses, the one released longest ago."""
        with self._mutex:
            if not self._free:
                raise CapacityExceeded(
                    f"all {BLOCK_SIZE // 2} sandbox uids of this engine are in use (or held back "
                    "from sandboxes that could not be cleaned up): delete sandboxes")
            uid = self._free.popleft()
            self._used.add(uid)
            return uid

    def hold_back(self, taken: set[int]) -> None:
        """Never hand out the uids in ``taken`` (something of theirs is still alive)."""
        pairs = {u & ~1 for u in taken}  # a sandbox's root counts as the sandbox
        with self._mutex:
            self._free = deque(u for u in self._free if u not in pairs)

    def release(self, uid: int) -> None:
        """``uid``'s sandbox is gone (no process, no mount): it may be used again."""
        with self._mutex:
            if uid in self._used:
                self._used.discard(uid)
                self._free.append(uid)

    def close(self) -> None:
        """Let go of the block (the warden, if it still runs, keeps it locked)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
