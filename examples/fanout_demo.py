"""Score ~200 "model-generated" solutions in ~200 sandboxes, like a code-execution reward.

The task given to the "model": write ``second_largest(xs)``, the second largest
distinct value of a list, or ``None``. Its completions are a few variants: two
correct ones, two wrong ones, one that loops forever (it hits the command timeout)
and one that is correct but allocates ~800 MB (the sandbox's 128 MB limit gets it
OOM-killed). Each completion runs with the tests in a fresh sandbox; it earns reward
1 if every test passes, 0 otherwise.

    python examples/fanout_demo.py                     # 200 sandboxes, the local daemon
    python examples/fanout_demo.py --count 1000 --parallel 64
    python examples/fanout_demo.py --url unix:///tmp/corral.sock

Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon, starting it if
nothing answers. Every sandbox carries the tags ``demo`` and ``session=ses-...``, and
the session deletes them all at the end, also after Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import corral

EXEC_TIMEOUT = 3.0  # seconds a solution may run: the tests take milliseconds
OUTCOMES = ("pass", "fail", "timeout", "oom", "error")

TESTS = """
CASES = [([3, 1, 4, 1, 5], 4), ([2, 2], None), ([7], None), ([], None),
         ([-1, -5, -3], -3), ([3, 100_000_000, 7], 7)]
for xs, want in CASES:
    got = second_largest(list(xs))
    assert got == want, f"second_largest({xs}) = {got!r}, want {want!r}"
print("all tests passed")
"""

# (name, weight: how often the "model" writes it, code)
VARIANTS = [
    ("sorted-set", 3, """
def second_largest(xs):
    s = sorted(set(xs))
    return s[-2] if len(s) > 1 else None
"""),
    ("one-pass", 2, """
def second_largest(xs):
    best = second = None
    for x in xs:
        if best is None or x > best:
            best, second = x, best
        elif x != best and (second is None or x > second):
            second = x
    return second
"""),
    ("no-dedupe", 2, """
def second_largest(xs):
    return sorted(xs)[-2] if len(xs) > 1 else None
"""),
    ("wrong-end", 1, """
def second_largest(xs):
    s = sorted(set(xs))
    return s[1] if len(s) > 1 else None
"""),
    ("loops-forever", 1, """
def second_largest(xs):
    best = second = None
    i = 0
    while i < len(xs):          # forgets i += 1
        if best is None or xs[i] > best:
            best, second = xs[i], best
    return second
"""),
    ("counting-sort", 1, """
def second_largest(xs):
    if not xs:
        return None
    lo = min(xs)
    counts = [0] * (max(xs) - lo + 1)   # one slot per value in the range: ~800 MB
    for x in xs:
        counts[x - lo] += 1
    seen = [v + lo for v, n in enumerate(counts) if n]
    return seen[-2] if len(seen) > 1 else None
"""),
]


@dataclass
class Trial:
    variant: str
    outcome: str
    create: float
    exec: float
    delete: float


def run_one(session: corral.Session, variant: str, code: str, stop: threading.Event,
            exec_timeout: float = EXEC_TIMEOUT) -> Trial | None:
    """One completion in its own sandbox: create, run the tests, delete."""
    if stop.is_set():  # Ctrl-C: start nothing new
        return None
    t0 = time.perf_counter()
    sb = session.create()
    t1 = time.perf_counter()
    try:
        sb.files.write("solution.py", code + TESTS)
        r = sb.exec(["python3", "solution.py"], timeout=exec_timeout)
        t2 = time.perf_counter()
    finally:
        sb.delete()
    t3 = time.perf_counter()
    outcome = "timeout" if r.timed_out else "oom" if r.oom_killed else "pass" if r.ok else "fail"
    return Trial(variant, outcome, t1 - t0, t2 - t1, t3 - t2)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summarize(console: Console, trials: list[Trial], errors: int, elapsed: float) -> None:
    outcomes = Counter(t.outcome for t in trials) + Counter(error=errors)
    total = len(trials) + errors
    table = Table(title="Summary: outcomes")
    table.add_column("outcome")
    table.add_column("sandboxes", justify="right")
    table.add_column("share", justify="right")
    for name in OUTCOMES:
        table.add_row(name, str(outcomes[name]), f"{outcomes[name] / max(total, 1):.0%}")
    console.print(table)
    console.print(f"{total} sandboxes in {elapsed:.1f} s: {total / elapsed:.1f} sandboxes/s")
    if trials:
        table = Table(title="Latency (ms)")
        table.add_column("phase")
        table.add_column("p50", justify="right")
        table.add_column("p95", justify="right")
        for phase in ("create", "exec", "delete"):
            ms = [getattr(t, phase) * 1000 for t in trials]
            table.add_row(phase, f"{percentile(ms, 50):.0f}", f"{percentile(ms, 95):.0f}")
        console.print(table)
    by_variant: dict[str, list[Trial]] = defaultdict(list)
    for t in trials:
        by_variant[t.variant].append(t)
    table = Table(title="Reward per variant")
    table.add_column("variant")
    table.add_column("n", justify="right")
    table.add_column("reward", justify="right")
    table.add_column("outcomes")
    for name, _, _ in VARIANTS:
        runs = by_variant.get(name, [])
        reward = sum(t.outcome == "pass" for t in runs) / len(runs) if runs else 0.0
        seen = Counter(t.outcome for t in runs)
        table.add_row(name, str(len(runs)), f"{reward:.2f}", ", ".join(f"{k} {v}" for k, v in seen.items()))
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="completions to score (default 200)")
    parser.add_argument("--parallel", type=int, default=32, help="sandboxes at once (default 32)")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    parser.add_argument("--exec-timeout", type=float, default=EXEC_TIMEOUT,
                        help=f"seconds a solution may run (default {EXEC_TIMEOUT:g})")
    args = parser.parse_args()
    # The SDK's shared thread pool runs corral.submit calls; its size is read on first use.
    os.environ["CORRAL_MAX_WORKERS"] = str(args.parallel)

    console = Console()
    plan = [(name, code) for name, weight, code in VARIANTS for _ in range(weight)]
    completions = [plan[i % len(plan)] for i in range(args.count)]
    stop = threading.Event()
    trials: list[Trial] = []
    errors: list[BaseException] = []
    counts = Counter[str]()
    interrupted = False

    with corral.Client(args.url) as client, corral.Session(
        defaults={"image": "python", "memory_mb": 128, "timeout": 300},
        tags=["demo"], client=client,
    ) as session:
        console.print(f"scoring {args.count} completions on {client.url}, tag {session.tag}")
        start = time.perf_counter()
        handles = [corral.submit(run_one, session, name, code, stop, args.exec_timeout)
                   for name, code in completions]
        progress = Progress(
            BarColumn(bar_width=16), MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"), TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(), console=console,
        )
        try:
            with progress:
                task = progress.add_task("", total=len(handles), counts="", rate="")
                for h in corral.as_completed(handles):
                    try:
                        trial = h.result()
                    except corral.CorralError as exc:
                        errors.append(exc)
                        counts["error"] += 1
                    else:
                        if trial is not None:
                            trials.append(trial)
                            counts[trial.outcome] += 1
                    rate = sum(counts.values()) / (time.perf_counter() - start)
                    progress.update(
                        task, advance=1, rate=f"{rate:.1f}/s",
                        counts=" ".join(f"{k} {n}" for k in OUTCOMES if (n := counts[k]) or k != "error"),
                    )
        except KeyboardInterrupt:  # stop, let the running ones end, then the session deletes all
            interrupted = True
            stop.set()
            for h in handles:
                h.cancel()
            console.print(f"interrupted: finishing the running sandboxes, then deleting {session.tag}")
            corral.wait(handles)
        elapsed = time.perf_counter() - start

    summarize(console, trials, len(errors), elapsed)
    if errors:
        console.print(f"[red]{len(errors)} sandboxes failed: {errors[0]}")
    if interrupted:
        console.print("interrupted: the sandboxes above were scored; every sandbox was deleted")
        return 130
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
