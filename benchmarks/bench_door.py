"""What the door costs: exec round trip and create→ready through a tenant token, on
this tree's daemon and on a baseline tree's, in one run.

    git archive <commit before the door> src | tar -x -C /tmp/base
    python3 benchmarks/bench_door.py --baseline-src /tmp/base/src [--quick|--smoke] [--json OUT]

Two daemons on TCP, one started from each source tree (``PYTHONPATH``; without
``--baseline-src``, this tree against itself: the noise floor), each with a tenant; the two take turns one call at a time (so the host's drift hits both alike):
``sb.exec(["true"])`` and a 64 MB ``Sandbox.create`` (to ready) then delete, through
the SDK with the tenant's token, and the same ``true`` through the cwsandbox gRPC
port's unary ``Exec`` (grpc with cwsandbox's stubs; this tree relays that port through
its connection book, ``server/compat/cwsandbox_edge.py``). Reports medians and this
tree's over the baseline's. Needs root and the ``compat`` extra.
"""

from __future__ import annotations

import importlib.util
import json
import os
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

import corral

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)

TOKEN = "bench-door-admin-" + "x" * 32
HERE = Path(__file__).resolve().parent.parent / "src"
GRPC = importlib.util.find_spec("cwsandbox") is not None  # the compat extra: gRPC too


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def _start(base: Path, src: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.server", "--socket", str(base / "corral.sock"),
         "--state-dir", str(base / "state"), "--tcp", f"127.0.0.1:{port}", "--token", TOKEN,
         *(["--grpc", f"127.0.0.1:{_port()}"] if GRPC else [])],
        stdout=open(base / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(base / 'daemon.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1,
                         headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
        tenant = admin.post("/v1/tokens", json={"name": "bench"}).json()["token"]
    return proc, tenant


def _grpc_exec(proc: subprocess.Popen, token: str, sandbox_id: str):
    """One unary ``Exec`` of ``true`` through the daemon's cwsandbox gRPC port."""
    import grpc
    from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc

    channel = grpc.insecure_channel(proc.args[proc.args.index("--grpc") + 1])
    stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
    request = sandbox_pb2.ExecRequest(sandbox_id=sandbox_id, command=["true"])
    metadata = [("authorization", f"Bearer {token}")]

    def run() -> None:
        assert stub.Exec(request, metadata=metadata, timeout=60).exit_code == 0

    return run


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--baseline-src", type=Path, default=HERE,
                    help="the src/ folder of the tree to compare against (default: this one)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemons run real sandboxes)")
        return 1
    n, creates = bench_args.pick(args, (1000, 60), (200, 20), (5, 2))
    bases, procs, clients, tokens = {}, {}, {}, {}
    try:
        for who, src in (("baseline", args.baseline_src.resolve()), ("door", HERE)):
            bases[who] = Path(tempfile.mkdtemp(prefix=f"corral-bench-{who}-"))
            os.chmod(bases[who], 0o711)
            procs[who], tokens[who] = _start(bases[who], src)
            port = procs[who].args[procs[who].args.index("--tcp") + 1]
            clients[who] = corral.Client(f"http://{port}", token=tokens[who])
        times: dict[str, dict[str, list[float]]] = {
            w: {"exec_ms": [], "grpc_exec_ms": [], "create_ms": []} for w in clients}
        boxes = {w: corral.Sandbox.create(memory_mb=64, client=c) for w, c in clients.items()}
        grpc_exec = {w: _grpc_exec(procs[w], tokens[w], boxes[w].id) if GRPC else (lambda: None)
                     for w in clients}
        try:
            for who, sb in boxes.items():
                sb.exec(["true"])  # warm the connections
                grpc_exec[who]()
            for _ in range(n):
                for who, sb in boxes.items():
                    times[who]["exec_ms"].append(_ms(lambda sb=sb: sb.exec(["true"])))
                    times[who]["grpc_exec_ms"].append(_ms(grpc_exec[who]))
            for _ in range(creates):
                for who, c in clients.items():
                    made: list[corral.Sandbox] = []
                    times[who]["create_ms"].append(_ms(
                        lambda c=c, made=made: made.append(
                            corral.Sandbox.create(memory_mb=64, client=c))))
                    made[0].delete()
        finally:
            for sb in boxes.values():
                sb.delete()
    finally:
        for c in clients.values():
            c.close()
        for p in procs.values():
            p.send_signal(signal.SIGINT)  # stop (SIGTERM hands sandboxes over)
            p.wait(30)
        for b in bases.values():
            shutil.rmtree(b, ignore_errors=True)
    res: dict[str, float] = {}
    for what in ("exec_ms", *(["grpc_exec_ms"] if GRPC else []), "create_ms"):
        b = statistics.median(times["baseline"][what])
        d = statistics.median(times["door"][what])
        res[f"baseline_{what}"], res[f"door_{what}"], res[f"{what}_ratio"] = b, d, d / b
        count = len(times["door"][what])
        print(f"{what:9} baseline {b:8.3f}  door {d:8.3f}  door/baseline {d / b:5.3f}  (n={count})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
