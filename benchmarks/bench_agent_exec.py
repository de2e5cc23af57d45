"""The agent's own cost per command: syscalls (strace) and engine exec RTT, vs a baseline.

    python3 benchmarks/bench_agent_exec.py [--quick] [--smoke] [--json OUT] [--baseline REF]

Each tree (this one, and with ``--baseline`` git ref REF in a temporary worktree) runs
in a child process of its own code: an ``Engine`` in a private state directory, one
sandbox, then

- ``syscalls_per_exec``: ``strace -f -c`` attached to the sandbox's agent (pid 1 inside,
  and every child it forks) while it runs ``exec(["true"])`` K times; per exec, in all
  and by name (``rt_sigaction``: the signal dispositions a command's child resets). A
  count, not a time: the load does not move it. The exec of ``true`` itself (the
  loader's syscalls) is in both trees' counts alike.
- ``exec_ms_p50``: ``engine.exec(["true"])`` back to back without strace (no SDK, no
  daemon: the agent's and the engine's share of issue 30's SDK exec RTT).

Rounds alternate between the trees (ABBA); medians over every sample of a tree. The
host's load is printed. Needs root; without strace only the RTT is measured.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_cpu import _tree  # noqa: E402  (a sibling script, not a package)

HERE = Path(__file__).resolve().parent


def _agent_pid(outer: int) -> int:
    """The host pid of the process that is pid 1 in a sandbox below OUTER (bwrap)."""
    todo = [outer]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if len(nspid) > 1 and nspid[-1] == "1":
            return pid
        todo.extend(int(k) for k in kids)
    raise SystemExit(f"no sandbox pid 1 below {outer}")


def _strace_counts(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        # "% time seconds usecs/call calls [errors] syscall"
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            counts[parts[-1]] = int(parts[3])
    return counts


async def child(n: int, k: int) -> dict[str, object]:
    from corral.runtime.engine import Engine

    state = Path(tempfile.mkdtemp(prefix="corral-bench-agent-"))
    engine = await Engine.open(state)
    try:
        info = await engine.create()
        sid = info.id
        for _ in range(5):
            await engine.exec(sid, ["true"])  # warm
        rtt = []
        for _ in range(n):
            t = time.perf_counter()
            r = await engine.exec(sid, ["true"])
            rtt.append((time.perf_counter() - t) * 1000)
            assert r.returncode == 0
        counts: dict[str, int] = {}
        if k and shutil.which("strace"):
            counts = await _traced(engine, sid, state / "strace.txt", k)
        await engine.delete(sid)
    finally:
        await engine.close()
        shutil.rmtree(state, ignore_errors=True)
    per = {name: c / max(k, 1) for name, c in counts.items()}
    return {"exec_ms": rtt, "syscalls_per_exec": sum(per.values()), "by_name": per}


async def _traced(engine, sid: str, out: Path, k: int) -> dict[str, int]:
    """Syscalls of the sandbox's agent and its children over K execs of ``true``."""
    agent = _agent_pid(engine._live[sid].proc.pid)
    tracer = subprocess.Popen(["strace", "-f", "-c", "-o", str(out), "-p", str(agent)],
                              stderr=subprocess.DEVNULL)
    await asyncio.sleep(0.5)  # attached (strace prints nothing we can wait on)
    for _ in range(k):
        await engine.exec(sid, ["true"])
    await asyncio.sleep(0.2)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(timeout=30)
    return _strace_counts(out)


def _round(src: Path, n: int, k: int) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}
    proc = subprocess.run([sys.executable, __file__, "--child", str(n), str(k)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=src.parent)
    if proc.returncode != 0:
        raise SystemExit(f"a round failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(asyncio.run(child(int(sys.argv[2]), int(sys.argv[3])))))
        return 0
    ap = bench_args.parser(__doc__)
    ap.add_argument("--baseline", metavar="REF", help="also measure git ref REF, alternated")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (real sandboxes)")
        return 1
    rounds, n, k = bench_args.pick(args, (6, 300, 100), (4, 150, 50), (1, 5, 3))
    trees = {"current": HERE.parent / "src"}
    load = [os.getloadavg()[0]]
    rtt: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="corral-bench-agent-") as tmp:
        try:
            if args.baseline:
                trees["baseline"] = _tree(args.baseline, Path(tmp) / "baseline")
            for i in range(rounds):
                for name in (list(trees) if i % 2 == 0 else list(reversed(trees))):
                    got = _round(trees[name], n, k)
                    rtt[name].extend(got["exec_ms"])
                    if got["by_name"]:
                        calls[name].append({"total": got["syscalls_per_exec"], **got["by_name"]})
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force",
                                str(Path(tmp) / "baseline")], check=False)
    load.append(os.getloadavg()[0])
    res: dict[str, float] = {"load_1min_start": load[0], "load_1min_end": load[1]}
    for name in trees:
        res[f"{name}_exec_ms_p50"] = statistics.median(rtt[name])
        names = {key for c in calls[name] for key in c}  # none without strace
        for key in names:
            res[f"{name}_syscalls_{key}"] = statistics.median(c.get(key, 0.0) for c in calls[name])
    for name in trees:
        top = sorted(((res[f"{name}_syscalls_{key}"], key) for key in
                      {k.split("_syscalls_", 1)[1] for k in res if k.startswith(f"{name}_syscalls_")}
                      if key != "total"), reverse=True)[:12]
        print(f"{name}: exec p50 {res[f'{name}_exec_ms_p50']:.3f} ms, syscalls per exec "
              f"{res.get(f'{name}_syscalls_total', float('nan')):.1f}: "
              + ", ".join(f"{key} {v:.1f}" for v, key in top))
    if args.baseline:
        for key in ("exec_ms_p50", "syscalls_total", "syscalls_rt_sigaction"):
            if f"current_{key}" not in res:
                continue
            res[f"ratio_{key}"] = res[f"current_{key}"] / max(res.get(f"baseline_{key}", 0), 1e-9)
            print(f"{key}: current/baseline {res[f'ratio_{key}']:.2f}")
    print(f"load {load[0]:.1f} -> {load[1]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
