"""SandboxFusion's ``/run_code`` on corral, next to the same code through corral's SDK.

    python3 benchmarks/bench_sandboxfusion.py [--quick] [--json OUT]

Starts a private daemon (TCP on 127.0.0.1 with a token) and times ``print(1)`` in
Python, a fresh sandbox per request, at concurrency 1 and 16:

- ``fusion``: ``POST /sandboxfusion/<token>/run_code`` as verl and the
  ``sandbox-fusion`` client send it (the front-end takes each sandbox from its warm
  pool and deletes it after);
- ``sdk_pool``: corral's SDK, the same steps by hand: a warm ``corral.Pool``,
  ``acquire`` → ``exec(["python3", "-c", "print(1)"])`` → delete;
- ``sdk_create``: corral's SDK without a pool: ``Sandbox.create`` → ``exec`` → delete.

Reported: requests/s and p50 latency of each, and the front-end's ratios to the SDK.
SandboxFusion's own server cannot run here (it ships as a container image); compare
with its published figures in the README. Needs root. Never fails on time.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
import httpx

import corral

CODE = "print(1)"
CONCURRENCY = (1, 16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_daemon(token: str) -> Iterator[tuple[str, str]]:
    """A daemon on a temporary socket, state directory and TCP port: (unix URL, http URL)."""
    base = Path(tempfile.mkdtemp(prefix="corral-bench-fusion-"))
    os.chmod(base, 0o711)
    sock, port = base / "corral.sock", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.server", "--socket", str(sock), "--state-dir",
         str(base / "state"), "--tcp", f"127.0.0.1:{port}", "--token", token],
        stdout=open(base / "daemon.log", "wb"), stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited: {(base / 'daemon.log').read_text()[-2000:]}")
            try:
                with corral.Client(f"unix://{sock}") as c:
                    c.health()
                break
            except corral.CorralError:
                if time.monotonic() > deadline:
                    raise SystemExit("daemon did not start") from None
                time.sleep(0.05)
        yield f"unix://{sock}", f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)  # stop (SIGTERM hands sandboxes over)
        proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def measure(one: Callable[[], None], n: int, concurrency: int) -> dict[str, float]:
    """``n`` calls of ``one`` by ``concurrency`` threads: requests/s and latency p50."""
    latencies: list[float] = []

    def timed(_: int) -> None:
        t = time.perf_counter()
        one()
        latencies.append((time.perf_counter() - t) * 1000)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(timed, range(n)))
    took = time.perf_counter() - started
    return {"requests_per_s": n / took, "p50_ms": statistics.median(latencies)}


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 200, 48, 4)
    token = secrets.token_urlsafe(16)
    res: dict[str, dict[str, float]] = {}
    with private_daemon(token) as (unix_url, http_url):
        endpoint = f"{http_url}/sandboxfusion/{token}/run_code"
        http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=32))

        def fusion() -> None:
            r = http.post(endpoint, json={"code": CODE, "language": "python"})
            assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n", r.text

        with corral.Client(unix_url) as client:
            with corral.Pool(image="python", min_ready=4, max_size=64, client=client) as pool:

                def sdk_pool() -> None:
                    with pool.acquire(timeout=120) as sb:
                        assert sb.exec(["python3", "-c", CODE]).stdout == "1\n"

                def sdk_create() -> None:
                    with corral.Sandbox.create(image="python", client=client) as sb:
                        assert sb.exec(["python3", "-c", CODE]).stdout == "1\n"

                for name, one in (("fusion", fusion), ("sdk_pool", sdk_pool),
                                  ("sdk_create", sdk_create)):
                    measure(one, 8, 4)  # warm: pools made, connections open
                    for c in CONCURRENCY:
                        res[f"{name}_c{c}"] = measure(one, n if c > 1 else n // 2, c)
        http.close()
    print(f"{'figure':16} {'requests/s':>11} {'p50 ms':>8}   (print(1), a fresh sandbox each)")
    for key, fig in res.items():
        print(f"{key:16} {fig['requests_per_s']:11.1f} {fig['p50_ms']:8.1f}")
    ratios = {}
    for c in CONCURRENCY:
        for base in ("sdk_pool", "sdk_create"):
            ratios[f"fusion_vs_{base}_c{c}_rps"] = (
                res[f"fusion_c{c}"]["requests_per_s"] / res[f"{base}_c{c}"]["requests_per_s"])
    for key, value in ratios.items():
        print(f"{key:32} {value:5.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"figures": res, "ratios": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
