"""Policy evaluation at scale: two policies on CartPole-v1 and two on tic-tac-toe,
hundreds of seeded episodes in hundreds of sandboxes, mean ± 95% CI back.

Each evaluation writes its policy into one base sandbox, checks it there, snapshots it,
and restores a sandbox per episode (or per few episodes: ``--per-sandbox``) from that
snapshot, so the policy is shared, not copied. Policy and env run in one process inside
the sandbox; only one JSON record per episode comes back. The four evaluations run side
by side (``aevaluate``), sharing the ``--concurrency`` sandboxes, so one's snapshot and
last few episodes overlap the others' episodes. Then everything is evaluated again: the
results come from the cache, and no sandbox starts.

    python examples/policy_eval_demo.py                      # 4 x 200 episodes
    python examples/policy_eval_demo.py --episodes 500 --concurrency 16
    CORRAL_DEMO_EPISODES=20 python examples/policy_eval_demo.py   # a quick run

Policies: CartPole ``random`` (the env's seeded action space) and ``linear`` (weights
from a ``.npy`` file: push the cart the way the pole is turning); tic-tac-toe
``random`` and ``greedy`` (code strings from ``corral.rl.envs.tictactoe``), against a
random opponent. Needs the ``rl`` image (gymnasium + numpy) for CartPole.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

import corral
import corral.rl
from corral.rl.envs import tictactoe

CARTPOLE_RANDOM = """
def act(obs):
    # `env` is the episode's environment (set by the runner); its action space is
    # seeded per episode, so this is reproducible by seed.
    return env.action_space.sample()
"""
# obs = (cart position, cart velocity, pole angle, pole angular velocity)
LINEAR_WEIGHTS = np.array([0.0, 0.0, 0.0, 1.0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int,
                        default=int(os.environ.get("CORRAL_DEMO_EPISODES") or 200),
                        help="seeded episodes per policy (default 200, or CORRAL_DEMO_EPISODES)")
    parser.add_argument("--concurrency", type=int, default=8, help="sandboxes at once, shared by the four evaluations (default 8)")
    parser.add_argument("--per-sandbox", type=int, default=4,
                        help="CartPole episodes per sandbox (default 4; gymnasium's import "
                        "dominates one episode); tic-tac-toe always runs one per sandbox")
    parser.add_argument("--png", help="draw both CartPole return distributions here")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()
    # Piped (CI logs, `| tee`): wide enough for the summary table's 13 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    work = Path(tempfile.mkdtemp(prefix="corral-eval-demo-"))
    weights = work / "linear.npy"
    np.save(weights, LINEAR_WEIGHTS)
    # A cache of its own: this run evaluates for real, then shows the cache at work.
    cache = work / "cache.sqlite"
    seeds = range(args.episodes)
    plan = [
        ("CartPole-v1", "random", corral.rl.Policy.from_code(CARTPOLE_RANDOM, label="random"),
         args.per_sandbox),
        ("CartPole-v1", "linear", corral.rl.Policy.from_weights(weights, label="linear (.npy)"),
         args.per_sandbox),
        ("tictactoe", "random", corral.rl.Policy.from_code(tictactoe.RANDOM_POLICY,
                                                           label="random"), 1),
        ("tictactoe", "greedy", corral.rl.Policy.from_code(tictactoe.GREEDY_POLICY,
                                                           label="greedy"), 1),
    ]

    with corral.Client(args.url) as client:
        console.print(f"evaluating {len(plan)} policies x {args.episodes} seeded episodes on "
                      f"{client.url}, {args.concurrency} sandboxes at once")
        started = time.perf_counter()
        results = asyncio.run(evaluate_all(plan, seeds, args.concurrency, cache, client))
        elapsed = time.perf_counter() - started

        console.print(corral.rl.summary_table(results, title="Policy evaluation (95% CI)"))
        for env in ("CartPole-v1", "tictactoe"):
            a, b = [r for (e, *_), r in zip(plan, results, strict=True) if e == env]
            console.print(f"{env}: {b.policy} - {a.policy}, paired by seed: {b.compare(a)}")
        episodes = sum(len(r.episodes) for r in results)
        sandboxes = sum(r.sandboxes_created for r in results)
        infra = sum(r.infra_failures for r in results)
        console.print(f"{episodes} episodes in {sandboxes} sandboxes in {elapsed:.1f} s: "
                      f"{episodes / elapsed:.1f} episodes/s, {sandboxes / elapsed:.1f} sandboxes/s; "
                      f"{infra} infrastructure failures (not scored)")

        t = time.perf_counter()
        again = [corral.rl.evaluate(policy, env, seeds=seeds, episodes_per_sandbox=per_sandbox,
                                    cache=cache, client=client)
                 for env, _, policy, per_sandbox in plan]
        cached_s = time.perf_counter() - t
        same = all(x.to_dict()["summary"] == y.to_dict()["summary"]
                   for x, y in zip(results, again, strict=True))
        console.print(f"evaluated again from the cache in {cached_s:.2f} s: "
                      f"{sum(r.cache_hits for r in again)} cached episodes, "
                      f"{sum(r.sandboxes_created for r in again)} sandboxes, "
                      f"same results: {same}")
        if args.png:
            corral.rl.plot_returns(results[:2], args.png)
            console.print(f"CartPole return distributions: {args.png}")
        left = [sb for r in results for sb in corral.Sandbox.list(tags=[r.tag], client=client)]
    return 1 if infra or left or not same else 0


async def evaluate_all(plan: list, seeds: range, concurrency: int, cache: Path,
                       client: corral.Client) -> list[corral.rl.EvalResult]:
    """The evaluations of ``plan`` side by side, ``concurrency`` sandboxes among them (a
    share each, the remainder to the first), with one live line each."""
    bars: list[corral.rl.EpisodeProgress] = []
    for env, name, _, _ in plan:
        bars.append(corral.rl.EpisodeProgress(None, label=f"{name} on {env}",
                                              below=bars[0] if bars else None))
    shares = [concurrency // len(plan) + (i < concurrency % len(plan)) for i in range(len(plan))]
    async with corral.AsyncClient(**client.connect_args) as aclient:
        with bars[0]:
            return list(await asyncio.gather(*(
                corral.rl.aevaluate(policy, env, seeds=seeds, concurrency=max(1, share),
                                    timeout=60, episodes_per_sandbox=per_sandbox, cache=cache,
                                    progress=bar, client=aclient)
                for (env, _, policy, per_sandbox), share, bar in zip(plan, shares, bars,
                                                                    strict=True))))


if __name__ == "__main__":
    raise SystemExit(main())
