"""The engine's warden: nothing outlives its engine, not even a frozen sandbox.

A sandbox's processes notice their engine's death by themselves (the agent exits when
its control socket closes; bwrap has ``--die-with-parent``), but a *frozen* one
(paused, or frozen mid-snapshot) cannot act on anything until it is thawed: on
cgroup v1 even a SIGKILL waits for the thaw. So every engine starts one warden: a
small process outside every sandbox cgroup (and in a session of its own), started as
``python -I -S warden.py DIR...`` with no import of corral. It blocks reading a pipe
whose only write end the engine holds; the kernel closes that end however the engine
dies (``kill -9`` included), and at EOF the warden SIGKILLs every process of every
group under the engine's cgroup parent (``DIR``, one per hierarchy), thaws them, waits
until they are empty and removes them, and then the parent. On a clean
:meth:`Warden.stop` the engine writes one byte first and the warden leaves without
touching anything.

The warden also holds the engine's lock (the same open file, inherited), so a new
engine on the same state directory cannot start, and have its fresh sandboxes swept,
until the old engine's warden is done; :func:`acquire_lock` waits for that. It holds
the engine's block of sandbox uids the same way (:mod:`corral.runtime.uids`): no other
engine takes those uids while a sandbox that ran as one of them may still be alive.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:  # no import at run time: this file also runs alone, as the warden
    from corral.runtime.cgroups import CgroupDriver

LOCK_WAIT_S = 30.0  # how long a new engine waits for a dead engine's warden
CLEAN_S = 20.0  # how long the warden keeps killing before it gives up (D state)
STOP_WAIT_S = 5.0


def _alive(pid: str) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, ValueError, IndexError):
        return False


def acquire_lock(state_dir: Path) -> IO[str]:
    """Lock ``state_dir`` for this engine (the lock file holds its pid).

    If the engine that held it died, its warden holds it until it has cleaned up: wait
    for that (bounded). If that engine still runs, :class:`InvalidState` at once.
    """
    from corral.errors import InvalidState

    lock_file = open(state_dir / "engine.lock", "a+")
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            lock_file.seek(0)
            owner = lock_file.read().strip() or "?"
            if _alive(owner) or time.monotonic() > deadline:
                lock_file.close()
                raise InvalidState(
                    f"another corral engine (pid {owner}) is using {state_dir}; "
                    "stop it or choose another state directory (CORRAL_STATE_DIR)"
                ) from None
            time.sleep(0.02)
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(str(os.getpid()))
    lock_file.flush()
    return lock_file


class Warden:
    """The engine's side: start one per engine, :meth:`stop` it on a clean close."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: int) -> None:
        self.proc = proc
        self._pipe = pipe

    @classmethod
    def start(cls, lock_file: IO[str], cgroups: CgroupDriver, cgroup_parent: str,
              locks: tuple[int, ...] = ()) -> "Warden":
        """Start the warden of the engine that holds ``lock_file`` and the descriptors
        ``locks`` (other flocks it must keep until its sandboxes are gone)."""
        dirs = [str(d) for d in cgroups._dirs(cgroup_parent).values()]
        r, w = os.pipe()  # both ends close-on-exec: no other child inherits w
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, *dirs],
                stdin=r, stdout=subprocess.DEVNULL, pass_fds=(lock_file.fileno(), *locks),
                start_new_session=True, env={}, cwd="/",
            )
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        return cls(proc, w)

    def stop(self) -> None:
        """The engine closes cleanly: the warden exits and touches nothing."""
        if self._pipe < 0:
            return
        try:
            os.write(self._pipe, b"q")
        except OSError:
            pass
        os.close(self._pipe)
        self._pipe = -1
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------- the warden process


def _subdirs(d: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _write(path: Path, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)  # no O_CREAT: absent means not this hierarchy
    except OSError:
        return
    try:
        os.write(fd, value.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _pids(d: Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _sweep(group: list[Path]) -> bool:
    """Kill, thaw, and once empty remove one sandbox's group; True when it is gone."""
    busy = False
    for d in group:
        _write(d / "cgroup.kill", "1")  # cgroup v2 (5.14+): kills frozen tasks too
        for pid in _pids(d):  # frozen (v1): they cannot fork, so this list is complete
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for d in group:
        _write(d / "freezer.state", "THAWED")  # v1: a frozen task dies only once thawed
        _write(d / "cgroup.freeze", "0")
    for d in group:
        if _pids(d):
            busy = True
    if busy:
        return False
    for d in group:
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            busy = True  # EBUSY just after the last task died: the kernel lets go later
    return not busy


def _clean(dirs: list[Path]) -> None:
    names = sorted({n for d in dirs for n in _subdirs(d)})
    pending = [[d / n for d in dirs if (d / n).is_dir()] for n in names]
    deadline = time.monotonic() + CLEAN_S
    while pending and time.monotonic() < deadline:
        pending = [g for g in pending if not _sweep(g)]
        if pending:
            time.sleep(0.01)
    for g in pending:
        print(f"corral warden: could not empty cgroup {g[0]}", file=sys.stderr)
    for d in dirs:  # the engine's own group too: its state dir may never be opened again
        try:
            d.rmdir()
        except OSError:
            pass  # not empty (see above), or gone


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the engine's end of the pipe counts
    while True:
        try:
            data = os.read(0, 1)
            break
        except InterruptedError:
            continue
        except OSError:
            data = b""
            break
    if not data:  # EOF: the engine died without stopping us
        _clean([Path(a) for a in argv[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
