"""What a tenant token costs on the hot path: one daemon on TCP, the same command
through the daemon's own token (the admin) and through a tenant token (its SHA-256
looked up in the registry on every request, the ownership check on every lookup).

    python3 benchmarks/bench_tenants.py [--quick] [--json OUT]

One sandbox each, the two clients taking turns one call at a time (so the host's
drift hits both alike), timing ``sb.exec(["true"])`` and ``GET /v1/sandboxes/{id}``
through the SDK. Reports medians and the tenant's over the admin's. Needs root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import corral

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import start_daemon  # noqa: E402  (a sibling script, not a package)

ADMIN_TOKEN = "bench-admin-" + "x" * 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 1000, 200, 8)
    base = Path(tempfile.mkdtemp(prefix="corral-bench-tenants-"))
    os.chmod(base, 0o711)
    port = _port()
    proc = start_daemon(base, "--tcp", f"127.0.0.1:{port}", "--token", ADMIN_TOKEN)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(base / "corral.sock")),
                          base_url="http://corral") as uds:
            token = uds.post("/v1/tokens", json={"name": "bench"}).json()["token"]
        url = f"http://127.0.0.1:{port}"
        times: dict[str, dict[str, list[float]]] = {"admin": {}, "tenant": {}}
        with corral.Client(url, token=ADMIN_TOKEN) as admin, \
                corral.Client(url, token=token) as tenant:
            boxes = {"admin": corral.Sandbox.create(memory_mb=64, client=admin),
                     "tenant": corral.Sandbox.create(memory_mb=64, client=tenant)}
            try:
                for sb in boxes.values():
                    sb.exec(["true"])  # warm the connection
                for _ in range(n):
                    for who, sb in boxes.items():
                        times[who].setdefault("exec_ms", []).append(
                            _ms(lambda sb=sb: sb.exec(["true"])))
                        times[who].setdefault("get_ms", []).append(_ms(sb.refresh))
            finally:
                for sb in boxes.values():
                    sb.delete()
    finally:
        proc.send_signal(signal.SIGINT)  # stop (SIGTERM hands sandboxes over)
        proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)
    res: dict[str, float] = {}
    for what in ("exec_ms", "get_ms"):
        a = statistics.median(times["admin"][what])
        t = statistics.median(times["tenant"][what])
        res[f"admin_{what}"], res[f"tenant_{what}"], res[f"{what}_ratio"] = a, t, t / a
        print(f"{what:8} admin {a:7.3f}  tenant {t:7.3f}  tenant/admin {t / a:5.3f}  (n={n})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
