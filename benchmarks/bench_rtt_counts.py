"""What one SDK call costs the daemon, in counts the host's load does not move.

    python3 benchmarks/bench_rtt_counts.py [--quick] [--smoke] [--json OUT] [--baseline REF]

Each tree gets a private daemon of its own code; a probe process of that tree's SDK
makes ``n`` calls of each kind on it — ``exec``: ``exec(["true"])`` on one sandbox
(blocking SDK), ``async_exec`` (asyncio SDK), ``acquire``: ``pool.acquire()`` from a
pool of ``2n`` ready sandboxes (none deleted before the end) — twice: once with ``strace -c -f`` attached to the
daemon (system calls per call: ``epoll_wait`` is one turn of its event loop,
``recvfrom`` one read, ``getpid`` one asyncio loop look-up on Python 3.11), once
without (the daemon's CPU per call from ``/proc/PID/stat``, the probe's own CPU per
call, and the wall p50). Rounds alternate between the trees (ABBA); medians of the
rounds. The wall figures move with the host's load; the counts do not. Needs root;
without strace only the timed pass runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_cpu import _tree, tree_daemons  # noqa: E402  (a sibling script, not a package)

HERE = Path(__file__).resolve().parent
KINDS = ("exec", "async_exec", "acquire")
SYSCALLS = ("epoll_wait", "recvfrom", "sendto", "getpid")


def _probe(url: str, kind: str, n: int) -> None:
    """The probe: set up, say ``ready``; then, per line read, ``n`` calls and a line of
    figures; at EOF clean up."""
    import asyncio

    import corral

    client = corral.Client(url)
    stack = contextlib.ExitStack()
    loop = asyncio.new_event_loop()
    if kind == "acquire":
        # twice n ready, none deleted before the end: no refill and no teardown in either pass
        pool = stack.enter_context(corral.Pool(image="python", memory_mb=128, min_ready=2 * n,
                                               max_size=2 * n, client=client))
        pool.wait_ready(timeout=300)
        time.sleep(1.0)  # the refills' bookkeeping done

        def call() -> None:
            stack.callback(pool.acquire(timeout=30).delete)
    else:
        sb = stack.enter_context(corral.Sandbox.create(memory_mb=128, client=client))
        if kind == "exec":
            def call() -> None:
                sb.exec(["true"])
        else:
            ac = corral.AsyncClient(url)
            asb = loop.run_until_complete(corral.AsyncSandbox.connect(sb.id, client=ac))

            def call() -> None:
                loop.run_until_complete(asb.exec(["true"]))
        for _ in range(5):
            call()
    print("ready", flush=True)
    for _ in sys.stdin:
        wall, cpu = [], time.process_time()
        for _ in range(n):
            t = time.perf_counter()
            call()
            wall.append((time.perf_counter() - t) * 1000)
        cpu = (time.process_time() - cpu) / n * 1000
        print(json.dumps({"wall_ms_p50": statistics.median(wall), "client_cpu_ms": cpu}),
              flush=True)
    stack.close()


def _daemon_pid(url: str) -> int:
    sock = url.removeprefix("unix://")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"corral.server" in argv and sock.encode() in argv:
                return int(entry.name)
    raise SystemExit(f"no daemon found for {url}")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_LINE = re.compile(r"^\d+\s+(\d+\.\d+) (?:<\.\.\. )?(\w+)")


def _strace_counts(path: Path, start: float, end: float) -> dict[str, int]:
    """System calls the trace shows entered between ``start`` and ``end`` (epoch s)."""
    counts: dict[str, int] = {"total": 0}
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if m is None or "resumed>" in line or not start <= float(m[1]) <= end:
            continue
        counts[m[2]] = counts.get(m[2], 0) + 1
        counts["total"] += 1
    return counts


def one_round(src: Path, url: str, kind: str, n: int, tmp: Path) -> dict[str, float]:
    """One probe of ``kind`` on ``url``'s daemon: a timed pass, then a straced one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}
    pid = _daemon_pid(url)
    probe = subprocess.Popen([sys.executable, __file__, "--probe", url, kind, str(n)],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert probe.stdin is not None and probe.stdout is not None
    try:
        if probe.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {kind} probe did not start")
        cpu = _cpu_s(pid)
        probe.stdin.write("go\n")
        probe.stdin.flush()
        res = json.loads(probe.stdout.readline())
        res["daemon_cpu_ms"] = (_cpu_s(pid) - cpu) / n * 1000
        if shutil.which("strace") is None:
            return res
        out = tmp / f"strace-{pid}-{kind}.txt"
        tracer = subprocess.Popen(["strace", "-f", "-ttt", "-qq", "-p", str(pid), "-o", str(out)],
                                  stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached to every thread
        start = time.time()
        probe.stdin.write("go\n")
        probe.stdin.flush()
        json.loads(probe.stdout.readline())
        end = time.time()
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        counts = _strace_counts(out, start, end)
        out.unlink()
        for name in {*SYSCALLS, *counts}:  # the named ones, and any made once a call or more
            if name in SYSCALLS or name == "total" or counts[name] >= n / 2:
                res[f"{name}_per_call"] = counts.get(name, 0) / n
    finally:
        probe.stdin.close()
        probe.wait(120)
    return res


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--probe":
        _probe(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    ap = bench_args.parser(__doc__)
    ap.add_argument("--baseline", metavar="REF", help="also measure git ref REF, alternated")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root")
        return 1
    if shutil.which("strace") is None:
        print("no strace here: system calls are not counted")
    rounds, n = bench_args.pick(args, (4, 200), (2, 100), (1, 3))
    grab = min(n, 20)  # acquires a pass (from a pool of twice this many ready)
    trees = {"current": HERE.parent / "src"}
    load = [os.getloadavg()[0]]
    got: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="corral-bench-counts-") as tmp, \
            contextlib.ExitStack() as stack:
        if args.baseline:
            trees["baseline"] = _tree(args.baseline, Path(tmp) / "baseline")
            stack.callback(subprocess.run, ["git", "-C", str(HERE.parent), "worktree", "remove",
                                            "--force", str(Path(tmp) / "baseline")], check=False)
        urls = tree_daemons(stack, trees, "corral-bench-counts-")
        for i in range(rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))  # ABBA
            for kind in KINDS:
                for name in order:
                    k = grab if kind == "acquire" else n
                    for key, value in one_round(trees[name], urls[name], kind, k,
                                                Path(tmp)).items():
                        got.setdefault(f"{name}_{kind}_{key}", []).append(value)
    load.append(os.getloadavg()[0])
    res: dict[str, float] = {k: statistics.median(v) for k, v in got.items()}
    res["load_1min_start"], res["load_1min_end"] = load
    print(f"{'per call (median of rounds)':36} {'current':>9}"
          + (f" {'baseline':>9} {'ratio':>6}" if args.baseline else ""))
    for key in sorted({k.split("_", 1)[1] for k in res if k.startswith(tuple(trees))}):
        mine, base = res.get("current_" + key), res.get("baseline_" + key)
        line = f"{key:36} " + (f"{mine:9.3f}" if mine is not None else f"{'-':>9}")
        if args.baseline:  # a system call only one tree makes: "-" for the other
            line += f" {base:9.3f}" if base is not None else f" {'-':>9}"
            if mine is not None and base:
                res["ratio_" + key] = mine / base
                line += f" {res['ratio_' + key]:6.2f}"
        print(line)
    print(f"load {load[0]:.1f} -> {load[1]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
