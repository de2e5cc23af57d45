"""``corral daemon status|stop|restart``: the daemon on a Unix socket, found without
starting one.

The daemon is the process at the other end of the socket (``SO_PEERCRED``), whether
``corral serve`` or the one the SDK started itself (the embedded daemon, which also
writes ``corral.pid`` and ``corral.log`` next to its socket). ``stop`` sends it
SIGINT: it stops its sandboxes and exits. ``restart`` hands the sandboxes over (live
restore, docs/restart.md): under systemd it runs ``systemctl restart UNIT``; otherwise
it sends SIGTERM, waits for the exit, and starts the same command line again (with the
same environment and working directory: after an upgrade, the new code), which adopts
the running sandboxes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import corral
from corral.cli._output import Context, UsageError
from corral.client._config import Endpoint
from corral.client._embed import answers, sidecar

STOP_POLLS = 600  # x 0.1 s: how long stop waits for the daemon to exit
LIVE_STATES = ("pending", "running", "paused", "stopping")


def add_commands(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("daemon", help="the daemon on the local socket (status, stop, restart)")
    verbs = p.add_subparsers(dest="daemon_command", required=True, metavar="VERB")
    p = verbs.add_parser("status", parents=conn,
                         help="whether a daemon answers, its pid, version and sandboxes")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(handler=status)
    p = verbs.add_parser(
        "stop", parents=conn, help="stop the daemon (and so its sandboxes)",
        description="Sends SIGTERM to the daemon on the socket and waits until it has "
        "exited. A daemon with live sandboxes is stopped only with -y: they stop with it.",
    )
    p.add_argument("-y", "--yes", action="store_true", help="stop it even with live sandboxes")
    p.set_defaults(handler=stop)
    p = verbs.add_parser(
        "restart", parents=conn, help="restart the daemon; its sandboxes keep running",
        description="Hands the running sandboxes over to a new daemon (live restore): "
        "SIGTERM to the daemon, then the same command line started again (or `systemctl "
        "restart UNIT` for a daemon systemd runs). Use it after an upgrade.",
    )
    p.set_defaults(handler=restart)


def _socket(ctx: Context) -> str:
    endpoint = Endpoint.resolve(ctx.url)
    if endpoint.uds is None:
        raise UsageError(
            f"{endpoint.url} is a TCP daemon: see and stop it on its own host "
            "(this command needs its Unix socket, e.g. --url unix:///run/corral/corral.sock)"
        )
    return endpoint.uds


def peer_pid(sock_path: str) -> int | None:
    """The pid of the process listening on the Unix socket (``None`` if none)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(sock_path)
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except OSError:
        return None
    finally:
        s.close()


def describe(sock_path: str) -> str:
    """One line naming the daemon on the socket and how to stop it (for other errors)."""
    pid = peer_pid(sock_path)
    who = f"pid {pid}" if pid else "pid unknown"
    return (f"a corral daemon ({who}) answers on {sock_path}: stop it with "
            f"`corral daemon stop --url unix://{sock_path}` (its sandboxes stop with it)")


def _embedded(sock_path: str, pid: int | None) -> bool:
    try:
        return pid is not None and int(sidecar(sock_path, ".pid").read_text()) == pid
    except (OSError, ValueError):
        return False


def status(args: argparse.Namespace, ctx: Context) -> int:
    sock = _socket(ctx)
    out = ctx.output
    if not answers(sock):  # asked before any request, which could start a daemon
        if args.json:
            out.json({"socket": sock, "running": False})
        else:
            out.line(f"no daemon answers on {sock}")
        return 1
    pid = peer_pid(sock)
    info = ctx.client.info()
    data = {
        "socket": sock, "running": True, "pid": pid, "version": info["version"],
        "embedded": _embedded(sock, pid), "counts": info["counts"],
        "log": str(sidecar(sock, ".log")) if _embedded(sock, pid) else None,
    }
    if args.json:
        out.json(data)
        return 0
    kind = "embedded (started by the SDK, exits when idle)" if data["embedded"] else "corral serve"
    counts = ", ".join(f"{state} {n}" for state, n in info["counts"].items() if n) or "none"
    out.line(f"daemon    pid {pid}, version {info['version']}, {kind}")
    out.line(f"socket    {sock}")
    out.line(f"sandboxes {counts}")
    if data["log"]:
        out.line(f"log       {data['log']}")
    return 0


def stop(args: argparse.Namespace, ctx: Context) -> int:
    sock = _socket(ctx)
    out = ctx.output
    pid = peer_pid(sock) if answers(sock) else None
    if pid is None:
        out.line(f"no daemon answers on {sock}: nothing to stop")
        return 0
    live = sum(n for state, n in ctx.client.info()["counts"].items() if state in LIVE_STATES)
    if live and not args.yes:
        out.error(f"the daemon (pid {pid}) has {live} live sandboxes, which would stop with "
                  "it: pass -y to stop it anyway")
        return 1
    ctx.close()  # our connections must not keep it waiting
    try:
        os.kill(pid, signal.SIGINT)  # (SIGTERM would hand its sandboxes to a next daemon)
    except ProcessLookupError:
        pass
    except PermissionError:
        raise corral.Unauthorized(f"may not signal the daemon (pid {pid}): run as its user "
                                  "(root)") from None
    for _ in range(STOP_POLLS):
        if not _alive(pid) and not answers(sock):
            out.line(f"stopped the daemon (pid {pid}) on {sock}")
            return 0
        time.sleep(0.1)
    out.error(f"the daemon (pid {pid}) is still running {STOP_POLLS / 10:.0f} s after SIGINT; "
              f"see its log, or kill -9 {pid}")
    return 1


def restart(args: argparse.Namespace, ctx: Context) -> int:
    sock = _socket(ctx)
    out = ctx.output
    pid = peer_pid(sock) if answers(sock) else None
    if pid is None:
        out.error(f"no daemon answers on {sock}: start one with `corral serve`")
        return 1
    before = _live(ctx)
    ctx.close()
    unit = systemd_unit(pid)
    if unit is not None:
        subprocess.run(["systemctl", "restart", unit], check=True)
    else:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            env = dict(_environ(pid))
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except PermissionError:
            raise corral.Unauthorized(f"may not read the daemon's command line (pid {pid}): "
                                      "run as its user (root)") from None
        os.kill(pid, signal.SIGTERM)  # it hands its sandboxes over to the next daemon
        if not _wait(lambda: not _alive(pid)):
            out.error(f"the daemon (pid {pid}) still runs {STOP_POLLS / 10:.0f} s after "
                      "SIGTERM; see its log")
            return 1
        _start_again(sock, argv, env, cwd, embedded=_embedded(sock, pid))
    if not _wait(lambda: answers(sock) and peer_pid(sock) not in (None, pid)):
        out.error(f"no new daemon answers on {sock}: see its log ({sidecar(sock, '.log')})")
        return 1
    new_pid = peer_pid(sock)
    after = _live(ctx)
    how = f"systemctl restart {unit}" if unit else "SIGTERM, started again"
    out.line(f"restarted the daemon on {sock} (pid {pid} -> {new_pid}, {how}): "
             f"{after} of {before} live sandboxes kept running")
    return 0


def _live(ctx: Context) -> int:
    counts = ctx.client.info()["counts"]
    return sum(n for state, n in counts.items() if state in LIVE_STATES)


def _wait(done: Any) -> bool:
    for _ in range(STOP_POLLS):
        if done():
            return True
        time.sleep(0.1)
    return False


def systemd_unit(pid: int) -> str | None:
    """The systemd service running ``pid`` as its main process, if any."""
    try:
        groups = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in groups:
        path = line.split(":", 2)[-1]
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.endswith(".service") and "/user@" not in path and shutil.which("systemctl"):
            main = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", name],
                                  capture_output=True, text=True)
            if main.stdout.strip() == str(pid):
                return name
    return None


def _environ(pid: int) -> list[tuple[str, str]]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = []
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            pairs.append((os.fsdecode(key), os.fsdecode(value)))
    return pairs


def _start_again(sock: str, argv: list[bytes], env: dict[str, str], cwd: str, *,
                 embedded: bool) -> None:
    """Start the daemon's command line again, detached, its output to its log."""
    log_path = sidecar(sock, ".log")
    with open(log_path, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} corral daemon restart: "
                  f"{b' '.join(argv).decode(errors='replace')}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                                env=env, close_fds=True)
    if embedded:
        sidecar(sock, ".pid").write_text(f"{proc.pid}\n")


def _alive(pid: int) -> bool:
    """Running (an exited process its parent has not reaped yet is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
