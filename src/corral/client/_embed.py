"""The embedded daemon: ``import corral`` works on one host with nothing started first.

When no ``CORRAL_URL`` is set and nothing answers on the default socket, the SDK
starts ``python -m corral.server --socket SOCK --idle-exit 300`` in the background,
detached from the caller (its own session), and waits until it answers. Every
process on the host then shares that one daemon; it exits by itself once idle.

Files next to the socket (for the default ``/run/corral/corral.sock``)::

    /run/corral/corral.lock   flock held while one process starts the daemon, so that
                              concurrent processes start exactly one
    /run/corral/corral.log    the daemon's output (appended; one header line a start)
    /run/corral/corral.pid    the pid of the daemon started last

Environment variables (read only here):

- ``CORRAL_EMBED_IDLE_EXIT``: seconds without sandboxes or requests after which the
  embedded daemon exits (default 300).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from corral._socket_dir import unsafe_socket_dir
from corral.errors import DaemonUnavailable

IDLE_EXIT = 300.0
START_TIMEOUT = 60.0
"""Seconds the embedded daemon may take to answer (it opens the engine first)."""
_POLL = 0.05
_LOG_TAIL = 3000


# What ``corral serve`` imports beyond the SDK: the [daemon] extra.
_DAEMON_MODULES = ("starlette", "uvicorn", "httptools", "jinja2", "prometheus_client",
                   "websockets")


def daemon_missing() -> str | None:
    """Why this Python cannot run a daemon (``None`` if it can): the daemon needs
    Python 3.11+ and the ``daemon`` extra, which an SDK-only install leaves out."""
    if sys.version_info < (3, 11):
        return (f"the corral daemon needs Python 3.11 or newer (this is "
                f"{sys.version_info[0]}.{sys.version_info[1]}; the SDK runs on 3.10+)")
    missing = [m for m in _DAEMON_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the corral daemon's dependencies are not installed here (missing: "
                f"{', '.join(missing)}): pip install 'corral[daemon]'")
    return None


def connect_error(socket_path: str | Path, timeout: float = 1.0) -> OSError | None:
    """Why connecting to the Unix socket fails, or ``None`` if something accepts."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(socket_path))
        return None
    except OSError as exc:
        return exc
    finally:
        s.close()


def answers(socket_path: str | Path) -> bool:
    """True if something accepts connections on the Unix socket."""
    return connect_error(socket_path) is None


def sidecar(socket_path: str | Path, suffix: str) -> Path:
    """The lock, log or pid file next to a socket: ``corral.sock`` → ``corral.log``."""
    return Path(socket_path).with_suffix(suffix)


def ensure_daemon(socket_path: str, *, start_timeout: float = START_TIMEOUT) -> None:
    """Make sure a daemon answers on ``socket_path``, starting one if none does.

    Blocking; safe to call from many threads and processes at once: an flock on
    ``corral.lock`` lets one of them start the daemon while the others wait for it.
    """
    error = connect_error(socket_path)
    if error is None:
        return
    if isinstance(error, PermissionError):
        raise DaemonUnavailable(
            f"a corral daemon's socket {socket_path} exists but this process may not use it "
            "(it is root-only): run as root, or reach the daemon over TCP with "
            "CORRAL_URL=http://HOST:PORT and CORRAL_TOKEN",
            details={"socket": socket_path},
        )
    if os.geteuid() != 0:
        raise DaemonUnavailable(
            f"no corral daemon answers on {socket_path}, and this process cannot start one: "
            "the sandbox engine needs root. Run as root, start a daemon with "
            "`sudo corral serve`, or set CORRAL_URL to a running one",
            details={"socket": socket_path},
        )
    why = daemon_missing()
    if why is not None:
        raise DaemonUnavailable(
            f"no corral daemon answers on {socket_path}, and this process cannot start "
            f"one: {why}; or set CORRAL_URL to a running daemon",
            details={"socket": socket_path},
        )
    sock = Path(socket_path)
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as the daemon makes it
    if (why := unsafe_socket_dir(sock)) is not None:  # its lock and log files: not there
        raise DaemonUnavailable(
            f"will not start a daemon on {socket_path}: {why}, so other users could "
            "replace its socket or files; set CORRAL_SOCKET to a path in a directory "
            "only root or you can write (the default /run/corral/corral.sock)",
            details={"socket": socket_path},
        )
    with open(sidecar(sock, ".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if answers(sock):  # another process started it while we waited for the lock
            return
        proc = _spawn(sock)
        _wait_until_answers(sock, proc, start_timeout)


def _idle_exit() -> str:
    value = os.environ.get("CORRAL_EMBED_IDLE_EXIT") or f"{IDLE_EXIT:g}"
    try:
        float(value)
    except ValueError:
        raise DaemonUnavailable(
            f"CORRAL_EMBED_IDLE_EXIT must be a number of seconds, got {value!r}"
        ) from None
    return value


def _spawn(sock: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "corral.server", "--socket", str(sock),
            "--idle-exit", _idle_exit()]
    log_path = sidecar(sock, ".log")
    with open(log_path, "ab") as log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(
            f"--- {stamp} corral SDK (pid {os.getpid()}) starts the embedded daemon: "
            f"{' '.join(argv)}\n".encode()
        )
        log.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # no signal meant for the caller's group reaches it
            cwd="/",  # do not pin the caller's working directory
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            close_fds=True,
        )
    sidecar(sock, ".pid").write_text(f"{proc.pid}\n")
    # The daemon outlives this call (and maybe this process): reap it when it exits
    # so that it never lingers as a zombie of a long-running training job.
    threading.Thread(target=proc.wait, name="corral-embed-reaper", daemon=True).start()
    return proc


def _wait_until_answers(sock: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answers(sock):
            return
        if proc.poll() is not None:
            raise DaemonUnavailable(
                f"the embedded corral daemon exited with status {proc.returncode} while "
                f"starting; the end of {sidecar(sock, '.log')}:\n{_tail(sock)}",
                details={"socket": str(sock), "returncode": proc.returncode},
            )
        time.sleep(_POLL)
    proc.terminate()  # a daemon that never answered must not hold the socket later
    raise DaemonUnavailable(
        f"the embedded corral daemon did not answer on {sock} within {timeout:.0f}s; "
        f"the end of {sidecar(sock, '.log')}:\n{_tail(sock)}",
        details={"socket": str(sock)},
    )


def _tail(sock: Path) -> str:
    try:
        with open(sidecar(sock, ".log"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read the log: {exc})"
