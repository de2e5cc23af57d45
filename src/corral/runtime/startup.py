"""What an engine does before it opens its state directory: makes sure there is room
to start, and sweeps what image builds killed mid-way left in the image store.

A state directory or cache on a full filesystem is refused with
:class:`~corral.errors.StorageFull` naming the path and what is free there, before
anything is written: a daemon that cannot write its registry could neither record the
sandboxes of its dead predecessor as failed nor create new ones, so it does not start
"degraded" (every request would fail) but exits with a message that says what to free.

A build killed with its engine (``kill -9``, power loss) can leave a staged layer of up
to a build sandbox's disk limit under the image store; an import, half an image. The
next start removes them, unless a build of another engine on the host is running
right now (then the next image operation does; see :func:`ImageStore.sweep_debris`).
A CRIU killed mid-way can leave its ``/run/criu.kdat.tmp``: removed too
(:func:`criu.drop_kdat_tmp`, which each CRIU run is followed by anyway).

Whatever its parent handed down, the engine's process is made fit first
(:func:`settle_process`): its soft ``RLIMIT_NOFILE`` raised to its hard limit (a daemon
holds several descriptors a sandbox: its channels, its log pipe, a warm slot's; the
soft limit it inherits is often 1024, Debian's default for a service or a login, or
lower, a CI runner's), so are its soft limits on file size (a 1 MiB ``RLIMIT_FSIZE``
made the registry fail with "disk I/O error"), CPU time and memory (:data:`RAISED`),
and ``SIGCHLD`` back to its default if it came ignored: the
kernel then reaps every child at once, and each exit status is lost (``subprocess``
reports 0 for a failed CRIU, ``ip`` or ``mkfs``; asyncio, 255); and the system's
``sbin`` directories on its ``PATH`` (after what is there): a service's or ``su``'s
``PATH`` may lack them, and ``nft`` lives there ("nft is not installed", it said).
"""

from __future__ import annotations

import os
import resource
import signal
import stat
import threading
from pathlib import Path

from corral.runtime import criu, storage
from corral.runtime.images import ImageStore
from corral.runtime.paths import Layout, default_cache_dir, default_state_dir

OPEN_FILES_CAP = 1 << 20  # the soft limit raised to the hard one, at most this
# soft limits a parent may have lowered that the daemon needs: its descriptors, the size
# of what it writes (RLIMIT_FSIZE: SQLite's "disk I/O error" at 1 MiB), its CPU time
# (SIGXCPU would kill it), its memory
RAISED = (resource.RLIMIT_NOFILE, resource.RLIMIT_FSIZE, resource.RLIMIT_CPU,
          resource.RLIMIT_DATA, resource.RLIMIT_AS)
SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")  # root's tools (nft, losetup, ...)


def settle_process() -> None:
    """Undo what a parent may have handed down that the engine cannot work with (see
    the module docstring): low soft limits, ``SIGCHLD`` ignored, a ``PATH``
    without the ``sbin`` directories."""
    raise_soft_limits()
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    missing = [d for d in SBIN_DIRS if d not in path and os.path.isdir(d)]
    if missing:
        os.environ["PATH"] = os.pathsep.join([p for p in path if p] + missing)
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        else:  # (Python sets handlers from its main thread only; libc's from any)
            import ctypes

            ctypes.CDLL(None).signal(int(signal.SIGCHLD), None)  # None: SIG_DFL (0)


def raise_soft_limits() -> None:
    """Raise this process's soft limits in :data:`RAISED` to its hard ones (the
    descriptor limit to at most :data:`OPEN_FILES_CAP`) where they are lower."""
    infinity = resource.RLIM_INFINITY  # (-1 in Python: never compared as a number)
    for res in RAISED:
        soft, hard = resource.getrlimit(res)
        want = hard
        if res == resource.RLIMIT_NOFILE and (hard == infinity or hard > OPEN_FILES_CAP):
            want = OPEN_FILES_CAP
        if soft != infinity and (want == infinity or soft < want):
            resource.setrlimit(res, (want, hard))


def unreachable_ancestor(path: Path) -> str | None:
    """Why the sandboxes' users (every one an "other" to the host's directories) cannot
    pass through to ``path``: its first ancestor without the others' execute bit, with
    its mode; None if they can. bwrap, as a sandbox's uid, reaches its root by path."""
    for d in reversed(path.parents):
        try:
            mode = d.stat().st_mode
        except OSError:
            return None  # (not there yet: made 0711 by Layout.create)
        if not mode & stat.S_IXOTH:
            return f"{d} (mode {stat.S_IMODE(mode):04o})"
    return None


def open_layout(state_dir: Path | str | None, cache_dir: Path | str | None) -> Layout:
    """The engine's directories, made if missing, once there is room to start in them."""
    state = Path(state_dir or default_state_dir()).absolute()
    cache = Path(cache_dir or default_cache_dir()).absolute()
    storage.check_room(state, state)
    storage.check_room(cache, state)
    try:
        made = Layout.create(state, cache)
    except OSError as exc:  # filled up between the check and now
        if (full := storage.full_error(exc, state)) is not None:
            raise full from exc
        raise
    ImageStore(made.images_dir).sweep_debris()
    if os.geteuid() == 0:
        criu.drop_kdat_tmp()
    return made
