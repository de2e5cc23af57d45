"""The admin's latency while strangers hold the daemon's door (issue 23's fault test):
2000 idle unauthenticated connections, kept up by reconnecting whenever the daemon
closes one, plus a dashboard session trying to hold 400 live event streams, while the
admin creates sandboxes and runs a command in each.

    python3 benchmarks/bench_preauth.py [--quick | --smoke] [--json OUT]

One daemon on loopback TCP, its open-file limit raised to 8192 for the run (2000
connections must fit). The admin's create→ready and exec round trip are timed quiet,
under the attack, and quiet again (the two quiet runs pooled, so the host's drift hits
both sides); the report gives medians and loaded / quiet. The attacker runs in its own
process, from 40 loopback addresses (50 connections each). Needs root.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)

ADMIN_TOKEN = "bench-preauth-admin-" + "x" * 32
OPEN_FILES = 8192
IDLE_CONNECTIONS = 2000
SOURCES = 40
STREAMS = 400
LOADED_S = 12.0  # at least two rounds of the idle connections being cut and reopened
LOGIN = b"GET /ui/login HTTP/1.1\r\nHost: bench\r\n\r\n"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(base: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["prlimit", f"--nofile={OPEN_FILES}:{OPEN_FILES}", "--", sys.executable, "-m",
         "corral.server", "--socket", str(base / "corral.sock"), "--state-dir",
         str(base / "state"), "--tcp", f"127.0.0.1:{port}", "--token", ADMIN_TOKEN],
        stdout=open(base / "daemon.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(base / 'daemon.log').read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    raise SystemExit("daemon did not start")


# ------------------------------------------------------------------ the attacker


def _hold_idle(port: int, idle: int, stop: multiprocessing.synchronize.Event,
               stats: dict) -> None:
    """Keep ``idle`` unauthenticated connections open: reconnect each one the
    daemon closes (at most 500 new connections a second, so this process does not
    starve the host's two cores by itself)."""
    sel = selectors.DefaultSelector()
    opened = closed = refused = 0

    def one(index: int) -> None:
        nonlocal opened, refused
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((f"127.0.1.{1 + index % SOURCES}", 0))
            s.connect_ex(("127.0.0.1", port))
            sel.register(s, selectors.EVENT_WRITE, index)
            opened += 1
        except OSError:
            s.close()
            refused += 1

    for i in range(idle):
        one(i)
    held_samples = []
    last_sample = time.monotonic()
    while not stop.is_set():
        budget = 50
        for key, events in sel.select(0.1):
            s, index = key.fileobj, key.data
            if events & selectors.EVENT_WRITE:
                try:
                    s.send(LOGIN)
                    sel.modify(s, selectors.EVENT_READ, index)
                except OSError:
                    sel.unregister(s)
                    s.close()
                    closed += 1
                    if budget > 0:
                        budget -= 1
                        one(index)
                continue
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:  # the daemon closed it: come back
                sel.unregister(s)
                s.close()
                closed += 1
                if budget > 0:
                    budget -= 1
                    one(index)
        while len(sel.get_map()) < idle and budget > 0:
            budget -= 1
            one(len(sel.get_map()))
        if time.monotonic() - last_sample > 1.0:
            held_samples.append(len(sel.get_map()))
            last_sample = time.monotonic()
    stats.update(opened=opened, closed=closed, refused=refused,
                 held_median=statistics.median(held_samples) if held_samples else 0)


def _flood_streams(base: str, token: str, streams: int,
                   stop: multiprocessing.synchronize.Event, stats: dict) -> None:
    """One dashboard session trying to hold ``streams`` live event streams."""
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=streams)
    accepted = refused = 0
    with httpx.Client(base_url=base, timeout=30, limits=limits,
                      follow_redirects=False) as browser:
        browser.post("/ui/login", data={"token": token})
        open_ = []
        while not stop.is_set():
            while len(open_) < streams and not stop.is_set():
                reply = browser.send(browser.build_request("GET", "/ui/events"), stream=True)
                if reply.status_code == 200:
                    accepted += 1
                    open_.append(reply)
                else:
                    refused += 1
                    reply.close()
                    break
            stop.wait(0.5)  # then try for more again
        for reply in open_:
            reply.close()
    stats.update(streams_accepted=accepted, streams_refused=refused)


def _attack(port: int, token: str, idle: int, streams: int, stop, stats) -> None:
    import threading

    flood = threading.Thread(target=_flood_streams,
                             args=(f"http://127.0.0.1:{port}", token, streams, stop, stats))
    flood.start()
    _hold_idle(port, idle, stop, stats)
    flood.join()


# ------------------------------------------------------------------ the admin


def _admin_round(admin: httpx.Client) -> tuple[float, float]:
    t = time.perf_counter()
    made = admin.post("/v1/sandboxes", json={"memory_mb": 64})
    create_ms = (time.perf_counter() - t) * 1000
    made.raise_for_status()
    sid = made.json()["id"]
    try:
        t = time.perf_counter()
        admin.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]}).raise_for_status()
        exec_ms = (time.perf_counter() - t) * 1000
    finally:
        admin.delete(f"/v1/sandboxes/{sid}")
    return create_ms, exec_ms


def _rounds(admin: httpx.Client, n: int, at_least_s: float = 0.0) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"create_ms": [], "exec_ms": []}
    until = time.monotonic() + at_least_s
    while len(out["exec_ms"]) < n or time.monotonic() < until:
        c, e = _admin_round(admin)
        out["create_ms"].append(c)
        out["exec_ms"].append(e)
    return out


def main() -> int:
    args = bench_args.parser(__doc__).parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 60, 20, 3)
    loaded_s = bench_args.pick(args, LOADED_S, LOADED_S, 1.0)
    base = Path(tempfile.mkdtemp(prefix="corral-bench-preauth-"))
    os.chmod(base, 0o711)
    port = _port()
    proc = _start(base, port)
    ctx = multiprocessing.get_context("fork")
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(base / "corral.sock")),
                          base_url="http://corral") as uds:
            tenant = uds.post("/v1/tokens", json={"name": "flood"}).json()["token"]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as admin:
            _admin_round(admin)  # warm
            quiet = _rounds(admin, n)
            with ctx.Manager() as manager:
                stats = manager.dict()
                stop = ctx.Event()
                attacker = ctx.Process(target=_attack, args=(
                    port, tenant, bench_args.pick(args, IDLE_CONNECTIONS, IDLE_CONNECTIONS, 100),
                    bench_args.pick(args, STREAMS, STREAMS, 20), stop, stats))
                attacker.start()
                time.sleep(bench_args.pick(args, 5.0, 5.0, 1.0))  # all up, the flood at its limits
                loaded = _rounds(admin, n, at_least_s=loaded_s)  # idle ones churn meanwhile
                stop.set()
                attacker.join(60)
                attack = dict(stats)
            again = _rounds(admin, n)
    finally:
        proc.send_signal(signal.SIGINT)  # stop (SIGTERM hands sandboxes over)
        proc.wait(30)
        log_bytes = (base / "daemon.log").stat().st_size
        shutil.rmtree(base, ignore_errors=True)
    res: dict[str, float] = {"daemon_log_bytes": log_bytes, **attack}
    for what in ("create_ms", "exec_ms"):
        q = statistics.median(quiet[what] + again[what])
        a = statistics.median(loaded[what])
        res[f"quiet_{what}"], res[f"attacked_{what}"], res[f"{what}_ratio"] = q, a, a / q
        print(f"{what:10} quiet {q:8.2f}  under attack {a:8.2f}  ratio {a / q:5.2f}  (n={n})")
    print("attacker:", {k: v for k, v in attack.items()}, f"daemon log {log_bytes} bytes")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
