"""What a step costs in ``corral.rl.evaluate``'s episode runner, whose policy runs in a
process of its own (one pipe round trip a step, docs/evaluation.md), on the host.

    python3 benchmarks/bench_eval_runner.py [--quick | --smoke] [--rev REV] [--json OUT]

CartPole-v1 episodes (seeds 0..N-1, the README's linear policy as a module) run by
``runner.py run`` in a private directory, as a sandbox runs it; the per-step time is
the records' ``seconds`` over their ``steps`` (the episodes only: start-up and imports
are not in it). The baseline, in the same run: the same episodes with the policy
called in this process (``eval_runner_inprocess_step_us``: what the one-process runner
paid), and with ``--rev`` the runner of that git revision (``eval_runner_rev_step_us``,
e.g. one from before the split). Medians over rounds; records must match
(``eval_runner_match``). Needs gymnasium (the ``bench`` extra).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_args import parser, pick  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
POLICY = "def act(obs):\n    return int(obs[2] + obs[3] > 0)\n"


def run_runner(runner: str, episodes: int) -> tuple[float, list[str]]:
    """(µs a step, digests) of ``runner``'s source on ``episodes`` CartPole episodes."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "runner.py").write_text(runner)
        (d / "policy.py").write_text(POLICY)
        (d / "job.json").write_text(json.dumps({
            "policy": {"kind": "module", "module": "policy.py"},
            "env": {"id": "CartPole-v1", "kwargs": {}, "max_steps": None}}))
        out = subprocess.run([sys.executable, "runner.py", "run",
                              *(f"{s}:0" for s in range(episodes))],
                             cwd=d, capture_output=True, text=True, timeout=600, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines()]
    steps = sum(r["steps"] for r in records)
    return sum(r["seconds"] for r in records) / steps * 1e6, [r["digest"] for r in records]


def in_process(episodes: int) -> float:
    """µs a step with the policy called here (env, policy, digest as the runner's)."""
    import gymnasium

    from corral.rl._eval_runner import dumps, plain, sha256

    ns: dict = {}
    exec(POLICY, ns)
    act, env = ns["act"], gymnasium.make("CartPole-v1")
    steps, t0 = 0, time.perf_counter()
    for seed in range(episodes):
        obs, _ = env.reset(seed=seed)
        digest = sha256(dumps(plain(obs)).encode())
        done = False
        while not done:
            action = act(obs)
            obs, reward, term, trunc, _ = env.step(action)
            digest.update(dumps([plain(action), float(reward), plain(obs)]).encode())
            steps += 1
            done = term or trunc
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rev", help="also the runner of this git revision")
    args = ap.parse_args()
    episodes, rounds = pick(args, (100, 5), (30, 3), (2, 1))
    current = (ROOT / "src/corral/rl/_eval_runner.py").read_text()
    old = None
    if args.rev:
        old = subprocess.run(["git", "show", f"{args.rev}:src/corral/rl/_eval_runner.py"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    split, base, rev, match = [], [], [], True
    for _ in range(rounds):
        us, digests = run_runner(current, episodes)
        split.append(us)
        base.append(in_process(episodes))
        if old is not None:
            us_old, old_digests = run_runner(old, episodes)
            rev.append(us_old)
            match &= old_digests == digests
    res = {"eval_runner_step_us": round(statistics.median(split), 2),
           "eval_runner_inprocess_step_us": round(statistics.median(base), 2),
           "eval_runner_ratio": round(statistics.median(split) / statistics.median(base), 2),
           "eval_runner_episodes": episodes, "eval_runner_match": match}
    if rev:
        res["eval_runner_rev_step_us"] = round(statistics.median(rev), 2)
        res["eval_runner_rev_ratio"] = round(statistics.median(split) / statistics.median(rev), 2)
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    if not match:
        sys.exit("records differ between the runners")


if __name__ == "__main__":
    main()
