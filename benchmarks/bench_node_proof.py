"""What a cluster daemon's proof of identity costs a client (corral.cluster.proof): the
first request on a new connection, and a request on a kept-alive one, through a plain
httpx client and through a proven one, against the same node daemon, in one run.

    python3 benchmarks/bench_node_proof.py [--quick | --smoke] [--json OUT]

One daemon on loopback TCP started as a node's daemon (``--node``, its key in
``CORRAL_NODE_KEY``), no Ray needed. The two clients take turns, ``GET /v1/info`` each
time. Reports medians and proven / plain. Needs root (a real daemon).
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
from pathlib import Path

import httpx

from corral.cluster import proof

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)

TOKEN = "bench-node-proof-" + "x" * 32


def _start(base: Path, port: int, node: str, key: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.server", "--socket", str(base / "corral.sock"),
         "--state-dir", str(base / "state"), "--tcp", f"127.0.0.1:{port}", "--token", TOKEN,
         "--node", node],
        stdout=open(base / "daemon.log", "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, proof.KEY_ENV: key})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(base / 'daemon.log').read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    raise SystemExit("daemon did not start")


def main() -> int:
    args = bench_args.parser(__doc__).parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 400, 100, 5)
    base = Path(tempfile.mkdtemp(prefix="corral-bench-proof-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = secrets.token_hex(28)
    private, public = proof.make_key()
    proc = _start(base, port, node, private)
    url = f"http://127.0.0.1:{port}/v1/info"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    pins = proof.Pins([(f"http://127.0.0.1:{port}", node, public)])
    makers = {"plain": lambda: httpx.Client(timeout=60),
              "proven": lambda: proof.proven_client(pins, timeout=60)}
    times: dict[str, dict[str, list[float]]] = {k: {"new_ms": [], "kept_ms": []} for k in makers}
    try:
        for _ in range(n):
            for name, make in makers.items():
                with make() as http:
                    for what in ("new_ms", "kept_ms"):
                        t = time.perf_counter()
                        http.get(url, headers=headers).raise_for_status()
                        times[name][what].append((time.perf_counter() - t) * 1000)
    finally:
        proc.send_signal(signal.SIGINT)  # stop (SIGTERM hands sandboxes over)
        proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)
    res: dict[str, float] = {}
    for what in ("new_ms", "kept_ms"):
        plain = statistics.median(times["plain"][what])
        proven = statistics.median(times["proven"][what])
        res[f"plain_{what}"], res[f"proven_{what}"] = plain, proven
        res[f"{what}_ratio"] = proven / plain
        print(f"{what:8} plain {plain:7.3f}  proven {proven:7.3f}  proven/plain "
              f"{proven / plain:5.2f}  (n={n})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
