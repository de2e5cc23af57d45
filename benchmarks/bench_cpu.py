"""CPU time per sandbox lifecycle and per exec: the daemon's, the client's, the sandbox's.

    python3 benchmarks/bench_cpu.py [--quick] [--smoke] [--json OUT] [--baseline REF]

Wall-clock figures on a loaded machine are noise; CPU time is not (much). Each round
starts a private daemon (``bench_sdk.private_daemon``) and measures, through the SDK:

- ``lifecycle``: ``Sandbox.create`` → ``exec(["true"])`` → ``delete``, the sync SDK;
- ``exec`` / ``async_exec``: ``exec(["true"])`` on one sandbox, sync and asyncio SDK;
- ``health``: the cheapest request, the HTTP floor;
- ``acquire``: ``pool.acquire()`` of a ready sandbox (the sync SDK), back to back from a
  pool whose ``max_size`` equals ``min_ready``, so no refill's create runs in the window
  (the sandboxes are deleted and the pool refilled outside it).

For each: the client's CPU (``time.process_time``), the daemon's (``/proc/PID/stat``:
its own user+system, and its reaped children — the launchers), the sandboxes' (their
cgroups' ``cpuacct``, sampled, a lower bound), in ms per operation, and the wall time.

Two paired comparisons follow, in batches alternated within seconds (robust to a load
that swings between rounds, which the per-round figures are not): the asyncio SDK's
client CPU per exec on httpx's anyio transport against ``client/_unix.py``'s, and the
daemon's CPU per exec and per lifecycle on asyncio's loop against uvloop's
(``CORRAL_DAEMON_LOOP=uvloop``; skipped where uvloop is not installed).

``--baseline REF`` also measures the tree of git ref REF (a detached worktree in a
temporary directory): rounds alternate between the two trees in one run, and the
ratios current/baseline are printed. Needs root.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)

HERE = Path(__file__).resolve().parent
OPS = ("health", "exec", "async_exec", "acquire", "lifecycle")


def _daemon_cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children) CPU seconds of ``pid``. Its own from each thread's
    ``schedstat`` (nanoseconds; ``stat``'s clock ticks are 10 ms, too coarse for a batch
    of execs); a thread that ended takes its count with it."""
    own = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            own += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return own / 1e9, (int(fields[13]) + int(fields[14])) / tick


def _daemon_pid(url: str) -> int:
    sock = url.removeprefix("unix://").encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if sock in (p / "cmdline").read_bytes():
                    return int(p.name)
            except OSError:
                continue
    raise SystemExit("cannot find the daemon's pid")


def _engine_group_soon(pid: int) -> Path:
    """The engine's cgroup, once a launcher shows it (a loaded host may take a while)."""
    from profile_humaneval import _engine_group

    for _ in range(100):
        try:
            return _engine_group(pid)
        except SystemExit:
            time.sleep(0.1)
    return _engine_group(pid)


def child(n: int) -> dict[str, float]:
    """One round in this process, against the tree on ``sys.path``: figures per op."""
    import asyncio

    from bench_sdk import private_daemon
    from profile_humaneval import EngineCpu

    import corral

    out: dict[str, float] = {}
    with private_daemon("corral-bench-cpu-") as url:
        pid = _daemon_pid(url)

        def snap() -> tuple[float, float, float, float, float]:
            return (time.process_time(), *_daemon_cpu(pid), EngineCpu.usage(group), time.perf_counter())

        def since(before: tuple[float, ...]) -> list[float]:
            """What was spent since ``before`` (the wall time up to now)."""
            wall = time.perf_counter() - before[4]
            return [*(a - b for a, b in zip(snap()[:4], before, strict=False)), wall]

        def record(name: str, ops: int, before: tuple[float, ...]) -> None:
            put(name, ops, since(before))

        def put(name: str, ops: int, spent: list[float]) -> None:
            """``spent``: (client, daemon own, launchers, sandboxes, wall) seconds."""
            for key, value in zip(("client", "daemon", "launcher", "sandbox", "wall"), spent, strict=True):
                out[f"{name}_{key}_{'ms' if key == 'wall' else 'cpu_ms'}"] = value / ops * 1000

        def measure(name: str, ops: int, run) -> None:
            before = snap()
            run(ops)
            record(name, ops, before)

        with corral.Client(url) as client:
            with corral.Sandbox.create(memory_mb=128, client=client) as sb:
                sb.exec(["true"])
                # the engine's group keeps what its sandboxes used, deleted ones included
                group = _engine_group_soon(pid)

                def health(k: int) -> None:
                    for _ in range(k):
                        client.health()

                def execs(k: int) -> None:
                    for _ in range(k):
                        sb.exec(["true"])

                measure("health", n, health)
                measure("exec", n, execs)

            async def aexecs(k: int) -> None:
                async with corral.AsyncClient(url) as ac:
                    asb = await corral.AsyncSandbox.create(memory_mb=128, client=ac)
                    try:
                        await asb.exec(["true"])  # the connection made before the clock
                        before = snap()
                        for _ in range(k):
                            await asb.exec(["true"])
                        record("async_exec", k, before)
                    finally:
                        await asb.delete()

            asyncio.run(aexecs(n))

            with corral.Pool(image="python", memory_mb=128, min_ready=min(n, 20),
                             max_size=min(n, 20), client=client) as pool:
                spent, acquired = [0.0] * 5, 0
                while acquired < n:
                    pool.wait_ready(timeout=300)
                    time.sleep(0.03)
                    start = snap()
                    held = [pool.acquire(timeout=30) for _ in range(min(n, 20))]
                    spent = [a + b for a, b in zip(spent, since(start), strict=True)]
                    acquired += len(held)
                    for s in held:
                        s.delete()
                put("acquire", acquired, spent)

            def lifecycles(k: int) -> None:
                for _ in range(k):
                    with corral.Sandbox.create(memory_mb=128, client=client) as s:
                        s.exec(["true"])

            lifecycles(2)  # warm
            measure("lifecycle", max(2, n // 2), lifecycles)
    return out


def paired_transport(batches: int, per: int) -> dict[str, float]:
    """Client CPU per async exec: httpx's anyio transport vs the direct one, alternated."""
    import asyncio

    import httpx
    from bench_sdk import private_daemon

    import corral
    from corral.client._unix import AsyncDaemonTransport

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    with private_daemon("corral-bench-cpu-") as url:
        uds = url.removeprefix("unix://")

        async def run() -> dict[str, float]:
            kinds = {"anyio": httpx.AsyncHTTPTransport(uds=uds, limits=limits),
                     "direct": AsyncDaemonTransport(uds=uds, limits=limits)}
            clients = {k: corral.AsyncClient(url, transport=t) for k, t in kinds.items()}
            sbs = {k: await corral.AsyncSandbox.create(memory_mb=128, client=c)
                   for k, c in clients.items()}
            got: dict[str, list[float]] = {k: [] for k in kinds}
            try:
                for sb in sbs.values():
                    await sb.exec(["true"])
                for _ in range(batches):
                    for k, sb in sbs.items():
                        t = time.process_time()
                        for _ in range(per):
                            await sb.exec(["true"])
                        got[k].append((time.process_time() - t) / per * 1000)
            finally:
                for k in kinds:
                    await sbs[k].delete()
                    await clients[k].aclose()
            return {f"paired_async_exec_client_cpu_ms_{k}": statistics.median(v)
                    for k, v in got.items()}

        return asyncio.run(run())


def paired_loops(batches: int, per: int) -> dict[str, float]:
    """The daemon's own CPU per exec and per lifecycle on asyncio's loop vs uvloop's."""
    import importlib.util

    from bench_sdk import private_daemon

    import corral

    if importlib.util.find_spec("uvloop") is None:
        return {}
    got: dict[str, list[float]] = {}
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for loop in ("asyncio", "uvloop"):
            os.environ["CORRAL_DAEMON_LOOP"] = loop
            urls[loop] = stack.enter_context(private_daemon("corral-bench-cpu-"))
        del os.environ["CORRAL_DAEMON_LOOP"]
        pids = {k: _daemon_pid(u) for k, u in urls.items()}
        clients = {k: stack.enter_context(corral.Client(u)) for k, u in urls.items()}
        sbs = {k: stack.enter_context(corral.Sandbox.create(memory_mb=128, client=c))
               for k, c in clients.items()}
        for _ in range(batches):
            for k in urls:
                own = _daemon_cpu(pids[k])[0]
                for _ in range(per):
                    sbs[k].exec(["true"])
                got.setdefault(f"paired_exec_daemon_cpu_ms_{k}", []).append(
                    (_daemon_cpu(pids[k])[0] - own) / per * 1000)
                own = _daemon_cpu(pids[k])[0]
                for _ in range(max(1, per // 5)):
                    with corral.Sandbox.create(memory_mb=128, client=clients[k]) as s:
                        s.exec(["true"])
                got.setdefault(f"paired_lifecycle_daemon_cpu_ms_{k}", []).append(
                    (_daemon_cpu(pids[k])[0] - own) / max(1, per // 5) * 1000)
    return {k: statistics.median(v) for k, v in got.items()}


def paired_trees(batches: int, per: int, baseline: Path) -> dict[str, float]:
    """The daemon's own CPU and the client's per health / exec / pool acquire, on a
    daemon of this tree against one of ``baseline`` (a ``src`` directory), in batches
    alternated within seconds. The client is this tree's for both. A pool's acquires
    run back to back from a pool whose ``max_size`` is its ``min_ready`` (no refill in
    the window), refilled between batches."""
    import corral

    got: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        urls = tree_daemons(stack, {"baseline": baseline, "current": HERE.parent / "src"},
                            "corral-bench-cpu-")
        pids = {k: _daemon_pid(u) for k, u in urls.items()}
        clients = {k: stack.enter_context(corral.Client(u)) for k, u in urls.items()}
        sbs = {k: stack.enter_context(corral.Sandbox.create(memory_mb=128, client=c))
               for k, c in clients.items()}
        grab = max(1, per // 4)  # acquires per batch: each is a create to refill
        pools = {k: stack.enter_context(corral.Pool(image="python", memory_mb=128, min_ready=grab,
                                                    max_size=grab, client=c))
                 for k, c in clients.items()}

        def batch(key: str, name: str, run, ops: int = per) -> None:
            pid = pids[name]
            me, own = time.process_time(), _daemon_cpu(pid)[0]
            run()
            got.setdefault(f"paired_{key}_client_cpu_ms_{name}", []).append(
                (time.process_time() - me) / ops * 1000)
            got.setdefault(f"paired_{key}_daemon_cpu_ms_{name}", []).append(
                (_daemon_cpu(pid)[0] - own) / ops * 1000)

        held: list[corral.Sandbox] = []  # deleted after each batch

        def acquires(pool: corral.Pool) -> None:
            held.extend(pool.acquire(timeout=30) for _ in range(grab))

        for _ in range(batches):
            for name in urls:
                client, sb, pool = clients[name], sbs[name], pools[name]
                batch("health", name, functools.partial(_repeat, per, client.health))
                batch("exec", name, functools.partial(_repeat, per, sb.exec, ["true"]))
                pool.wait_ready(timeout=300)
                time.sleep(0.05)  # the last refill's teardown and bookkeeping done
                batch("acquire", name, functools.partial(acquires, pool), grab)
                for s in held:
                    s.delete()
                held.clear()
    return {k: statistics.median(v) for k, v in got.items()}


def tree_daemons(stack: contextlib.ExitStack, trees: dict[str, Path], prefix: str) -> dict[str, str]:
    """A private daemon of each tree's code (its ``src`` first on ``PYTHONPATH``),
    stopped with ``stack``; their URLs by tree."""
    from bench_sdk import private_daemon

    urls: dict[str, str] = {}
    saved = os.environ.get("PYTHONPATH")
    try:
        for name, src in trees.items():
            os.environ["PYTHONPATH"] = os.pathsep.join([str(src), str(HERE)])
            urls[name] = stack.enter_context(private_daemon(prefix))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return urls


def _repeat(k: int, fn, *args) -> None:
    for _ in range(k):
        fn(*args)


def _tree(ref: str, into: Path) -> Path:
    """A detached worktree of ``ref`` under ``into``; its ``src`` directory."""
    subprocess.run(["git", "-C", str(HERE.parent), "worktree", "add", "--detach", "-q",
                    str(into), ref], check=True)
    return into / "src"


def _round(src: Path, n: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}
    proc = subprocess.run([sys.executable, __file__, "--child", str(n)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"a round failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]))))
        return 0
    ap = bench_args.parser(__doc__)
    ap.add_argument("--baseline", metavar="REF", help="also measure git ref REF, interleaved")
    ap.add_argument("--paired-only", action="store_true",
                    help="only the paired batches (with --baseline: only the two trees')")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    trees = {"current": HERE.parent / "src"}
    with tempfile.TemporaryDirectory(prefix="corral-bench-cpu-") as tmp:
        try:
            if args.baseline:
                trees["baseline"] = _tree(args.baseline, Path(tmp) / "baseline")
            res = {} if args.paired_only else rounds(args, trees)
            res.update(paired(args, trees))
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force",
                                str(Path(tmp) / "baseline")], check=False)
    res["load_1min"] = os.getloadavg()[0]
    print(f"load {res['load_1min']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


def rounds(args, trees: dict[str, Path]) -> dict[str, float]:
    """Whole rounds (a daemon each), the trees interleaved; medians per figure."""
    n = bench_args.pick(args, 300, 100, 5)
    count = bench_args.pick(args, 5, 3, 1)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for _ in range(count):
        for name, src in trees.items():  # interleaved: load drifts hit both
            runs[name].append(_round(src, n))
    res: dict[str, float] = {}
    for name, figs in runs.items():
        for key in figs[0]:
            res[f"{name}_{key}"] = statistics.median(f[key] for f in figs)
    print(f"load {os.getloadavg()[0]:.1f}; medians of {count} round(s), ms per operation")
    print(f"{'figure':38} {'current':>9}" + (f" {'baseline':>9} {'ratio':>6}" if args.baseline else ""))
    for key in runs["current"][0]:
        line = f"{key:38} {res['current_' + key]:9.3f}"
        if args.baseline:
            base = res["baseline_" + key]
            line += f" {base:9.3f} {res['current_' + key] / base if base else float('nan'):6.2f}"
        print(line)
    return res


def paired(args, trees: dict[str, Path]) -> dict[str, float]:
    """The paired batches: transports, loops, and (with a baseline) the two trees."""
    batches, per = bench_args.pick(args, (12, 60), (8, 40), (1, 5))
    sys.path.insert(0, str(HERE.parent / "src"))
    got: dict[str, float] = {}
    if not (args.paired_only and "baseline" in trees):
        got.update({**paired_transport(batches, per), **paired_loops(batches, per)})
    if "baseline" in trees:
        got.update(paired_trees(batches, per, trees["baseline"]))
    print(f"paired batches ({batches} x {per}), ms per operation")
    for key, value in got.items():
        print(f"{key:46} {value:9.3f}")
    for a, b in (("paired_async_exec_client_cpu_ms_direct", "paired_async_exec_client_cpu_ms_anyio"),
                 ("paired_exec_daemon_cpu_ms_uvloop", "paired_exec_daemon_cpu_ms_asyncio"),
                 ("paired_lifecycle_daemon_cpu_ms_uvloop", "paired_lifecycle_daemon_cpu_ms_asyncio"),
                 *((f"paired_{op}_{who}_cpu_ms_current", f"paired_{op}_{who}_cpu_ms_baseline")
                   for op in ("health", "exec", "acquire") for who in ("client", "daemon"))):
        if a in got and got[b]:
            print(f"ratio {a.removeprefix('paired_')} / {b.rsplit('_', 1)[1]}: {got[a] / got[b]:.2f}")
    return got


if __name__ == "__main__":
    sys.exit(main())
