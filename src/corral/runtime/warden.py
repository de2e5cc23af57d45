"""The engine's warden: no sandbox outlives both its engine and the restore grace.

Every engine starts one warden: a small process outside every sandbox cgroup (and in
a session of its own), started as ``python -I -S warden.py ...`` with no import of
corral. Its stdin is a ``SOCK_SEQPACKET`` socket whose other end only the engine
holds; the kernel closes that end however the engine dies (``kill -9`` included).

While the engine runs, it hands the warden, for each sandbox, the host end of the
agent's *reattach socket* and a copy of its log pipe (``A`` + id, with the
descriptors: :meth:`Warden.keep`), and takes them back when the sandbox ends (``D``).
A sandbox's agent exits when its reattach socket closes, so while the warden holds
it the sandbox survives its engine (live restore, :mod:`corral.runtime.restore`).

When the engine goes away without a clean stop (it died, or closed with
``handover``), the warden keeps custody for ``--grace`` seconds: it listens on
``<state_dir>/handover.sock`` (root only) and hands the next engine on that state
directory the engine's lock, its uid block's lock and every sandbox's descriptors
(:func:`corral.runtime.restore.take_over`), then exits touching nothing. If no
engine comes in time (or ``--grace`` is 0), it SIGKILLs every process of every group
under the engine's cgroup parent (``DIR``, one per hierarchy), thaws them (a *frozen*
process, paused or mid-snapshot, cannot act on anything until thawed: on cgroup v1
even a SIGKILL waits for the thaw), waits until they are empty and removes them, and
then the parent; closing the reattach sockets ends any agent left. On a clean
:meth:`Warden.stop` the engine sends ``q`` first and the warden leaves without
touching anything.

The warden also holds the engine's lock (the same open file, inherited), so a new
engine on the same state directory cannot start, and have its fresh sandboxes swept,
until the old engine's warden has either handed over or cleaned up;
:func:`acquire_lock` waits for that. It holds the engine's block of sandbox uids the
same way (:mod:`corral.runtime.uids`): no other engine takes those uids while a
sandbox that ran as one of them may still be alive.
"""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable

if TYPE_CHECKING:  # no import at run time: this file also runs alone, as the warden
    from corral.runtime.cgroups import CgroupDriver

LOCK_WAIT_S = 30.0  # how long a new engine waits for a dead engine's warden
SELF_WAIT_S = 2.0  # ... and for the warden of an engine of its own process
CLEAN_S = 20.0  # how long the warden keeps killing before it gives up (D state)
STOP_WAIT_S = 5.0
MAX_MESSAGE = 4096  # bytes of one message from the engine (a drop of many ids is split)


def _alive(pid: str) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, ValueError, IndexError):
        return False


def acquire_lock(state_dir: Path,
                 take_over: Callable[[], IO[str] | None] | None = None) -> IO[str]:
    """Lock ``state_dir`` for this engine (the lock file holds its pid).

    If the engine that held it died, its warden holds it until it has either handed it
    over or cleaned up: wait for that (bounded), calling ``take_over`` meanwhile (the
    lock file it returns, handed over by that warden, is the lock: see
    :func:`corral.runtime.restore.take_over`). If that engine still runs,
    :class:`InvalidState` at once.
    """
    from corral.errors import InvalidState

    lock_file: IO[str] = open(state_dir / "engine.lock", "a+")
    started = time.monotonic()
    deadline = started + LOCK_WAIT_S
    while True:
        if take_over is not None and (taken := take_over()) is not None:
            lock_file.close()
            lock_file = taken
            break
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            lock_file.seek(0)
            owner = lock_file.read().strip() or "?"
            now = time.monotonic()
            # Our own pid: an engine of this process is open, or closed with a handover
            # and its warden is about to offer it (a moment: SELF_WAIT_S).
            mine = owner == str(os.getpid())
            if (_alive(owner) and (not mine or now > started + SELF_WAIT_S)) or now > deadline:
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

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self._sock: socket.socket | None = sock
        self._drops: list[bytes] = []  # ids dropped this turn of the loop (:meth:`drop`)

    @classmethod
    def start(cls, lock_file: IO[str], cgroups: CgroupDriver, cgroup_parent: str,
              locks: tuple[int, ...] = (), *, state_dir: Path | None = None,
              grace: float = 0.0) -> "Warden":
        """Start the warden of the engine that holds ``lock_file`` and the descriptors
        ``locks`` (its uid block's lock first, then its cgroups' key lock:
        :mod:`corral.runtime.cgroup_sweep`; flocks it must keep until its sandboxes are
        gone, and hands over with them). With ``state_dir`` and ``grace`` > 0 it keeps the
        sandboxes for ``grace`` seconds after the engine went away, for the next one."""
        dirs = [str(d) for d in cgroups._dirs(cgroup_parent).values()]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-I", "-S", __file__, "--lock", str(lock_file.fileno()),
                "--uids", str(locks[0] if locks else -1),
                "--key", str(locks[1] if len(locks) > 1 else -1), "--grace", repr(float(grace)),
                "--state", str(state_dir or ""), "--", *dirs]
        try:
            proc = subprocess.Popen(
                argv, stdin=theirs.fileno(), stdout=subprocess.DEVNULL,
                pass_fds=(lock_file.fileno(), *locks), start_new_session=True, env={}, cwd="/",
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours)

    def keep(self, sandbox_id: str, fds: list[int]) -> None:
        """Hold ``fds`` (a sandbox's reattach socket and log pipe) until :meth:`drop`."""
        self._send(b"A" + sandbox_id.encode(), fds)

    def drop(self, sandbox_id: str) -> None:
        """The sandbox ended: close what the warden held for it. The engine has shut its
        agent's reattach socket down already (``Engine._forget``), so this only frees the
        warden's copies: the drops of one turn of the event loop go in one message (a
        mass teardown woke the warden once per sandbox, ~0.6 ms of the loop's time each)."""
        self._drops.append(sandbox_id.encode())
        if len(self._drops) > 1:
            return  # a flush is scheduled
        import asyncio  # (the warden process itself never needs it: its start-up stays short)

        try:
            asyncio.get_running_loop().call_soon(self._flush)
        except RuntimeError:  # no loop (a synchronous caller): now
            self._flush()

    def _flush(self) -> None:
        ids, self._drops = self._drops, []
        while ids:
            n, size = 0, 1
            while n < len(ids) and size + len(ids[n]) + 1 <= MAX_MESSAGE:
                size += len(ids[n]) + 1
                n += 1
            n = max(n, 1)
            self._send(b"D" + b"\0".join(ids[:n]), [])
            ids = ids[n:]

    def _send(self, msg: bytes, fds: list[int]) -> None:
        if self._sock is None:
            return
        try:
            socket.send_fds(self._sock, [msg], fds)
        except OSError:
            pass  # the warden died: then the sandboxes end with it (their agents exit)

    def stop(self, *, handover: bool = False) -> None:
        """The engine closes: cleanly (the warden exits and touches nothing), or with
        ``handover`` (the warden keeps the sandboxes for the next engine)."""
        if self._sock is None:
            return
        self._flush()  # (a handover must not pass on a dropped sandbox's descriptors)
        sock, self._sock = self._sock, None
        if not handover:
            try:
                sock.send(b"q")
            except OSError:
                pass
        sock.close()
        if handover:
            return  # it runs on, alone, until the next engine takes over or the grace ends
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


HANDOVER_SOCKET = "handover.sock"  # (corral.runtime.restore reads the same name)
HANDOVER_ACK_S = 30.0  # how long a connected engine may take to receive everything


def _options(argv: list[str]) -> tuple[dict[str, str], list[Path]]:
    opts: dict[str, str] = {}
    i = 1
    while i + 1 < len(argv) and argv[i] != "--":
        opts[argv[i]] = argv[i + 1]
        i += 2
    return opts, [Path(a) for a in argv[i + 1:]]


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[4:8], sys.byteorder)


def _hand_over(state_dir: Path, grace: float, locks: list[int],
               held: dict[str, list[int]]) -> bool:
    """Offer the locks and the sandboxes' descriptors to the next engine for ``grace``
    seconds; whether one took them (and acknowledged)."""
    path = state_dir / HANDOVER_SOCKET
    try:
        path.unlink()
    except OSError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)  # root's alone from the start
    try:
        srv.bind(str(path))
    except OSError as exc:
        print(f"corral warden: cannot listen on {path}: {exc}", file=sys.stderr)
        srv.close()
        return False
    finally:
        os.umask(old)
    inode = path.lstat().st_ino
    srv.listen(4)
    deadline = time.monotonic() + grace
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            srv.settimeout(left)
            try:
                conn, _ = srv.accept()
            except (socket.timeout, TimeoutError):
                return False
            except OSError:
                time.sleep(0.05)
                continue
            with conn:
                try:
                    if _peer_uid(conn) != 0:
                        continue  # only root takes over (the state dir is root's anyway)
                    conn.settimeout(HANDOVER_ACK_S)
                    socket.send_fds(conn, [b"L"], locks)
                    for sid, fds in held.items():
                        socket.send_fds(conn, [b"S" + sid.encode()], fds)
                    conn.send(b"E")
                    if conn.recv(16) == b"K":
                        return True
                except OSError:
                    continue  # that engine died while taking over: wait for the next
    finally:
        srv.close()
        try:
            if path.lstat().st_ino == inode:
                path.unlink()
        except OSError:
            pass


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # only the engine's end of the socket counts
    # two descriptors a sandbox: past the usual soft limit of 1024
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    opts, dirs = _options(argv)
    engine = socket.socket(fileno=0)
    held: dict[str, list[int]] = {}  # sandbox id -> [reattach socket, log pipe]
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(engine, MAX_MESSAGE, 8)
        except InterruptedError:
            continue
        except OSError:
            msg, fds = b"", []
        if not msg:  # EOF: the engine died, or closed for a handover
            break
        kind, sid = msg[:1], msg[1:].decode(errors="replace")
        if kind == b"A":
            for fd in held.pop(sid, []):
                os.close(fd)
            held[sid] = list(fds)
            continue
        for fd in fds:
            os.close(fd)
        if kind == b"D":  # one or more ids, NUL-separated
            for one in sid.split("\0"):
                for fd in held.pop(one, []):
                    os.close(fd)
        elif kind == b"q":  # a clean stop: its sandboxes are gone already
            return 0
    grace = float(opts.get("--grace", "0") or 0)
    locks = [int(opts[k]) for k in ("--lock", "--uids", "--key")
             if int(opts.get(k, "-1")) >= 0]
    if grace > 0 and opts.get("--state") and held and locks:
        if _hand_over(Path(opts["--state"]), grace, locks, held):
            return 0
    _clean(dirs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
