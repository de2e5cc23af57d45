"""Branch running episodes: a CartPole mid-episode and a Python REPL agent episode,
each forked live into copies that go their own way (tree search, Tree-GRPO, vine).

1. A CartPole-v1 in a checkpointable sandbox is stepped to step ``--at``, then forked
   into ``--branches`` running copies (``SandboxEnv.fork``). Every branch then takes
   the same action sequence: CartPole's physics is deterministic, so they agree with
   each other and differ from a fresh episode (they went on from step ``--at``, not from
   a reset). Each branch was reseeded (inside its copy, and its ``np_random`` here), so
   their random rollouts differ; two branches given the same seed replay each other.
2. A Python REPL agent episode (``Episode``) builds some state, is forked in two, and
   each branch takes a different next step: the state from before the fork is in both,
   what comes after is each branch's own, and their random draws differ.

    python examples/branch_episodes.py
    python examples/branch_episodes.py --branches 8 --at 20
    python examples/branch_episodes.py --url unix:///tmp/corral.sock

Needs a host where live checkpoints work (``corral doctor``: "live checkpoints").
Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon, starting it if
nothing answers. Exits 1 if a check fails. Every sandbox is deleted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import corral
import corral.rl


def rollout(env: corral.rl.SandboxEnv, steps: int) -> list[float]:
    """Random actions drawn from the branch's ``np_random`` (reseeded by the fork, like
    the generators inside its copy): the cart's positions."""
    xs = []
    for _ in range(steps):
        obs, _, terminated, truncated, _ = env.step(int(env.np_random.integers(2)))
        xs.append(round(float(obs[0]), 5))
        if terminated or truncated:
            break
    return xs


def cartpole(client: corral.Client, branches: int, at: int) -> bool:
    env = corral.rl.SandboxEnv("CartPole-v1", client=client,
                               sandbox_options={"checkpointable": True, "network": "none"})
    forks: list[corral.rl.SandboxEnv] = []
    try:
        env.reset(seed=0)
        for t in range(at):
            env.step(t % 2)
        started = time.perf_counter()
        forks = env.fork(branches, reseed=[*range(branches - 1), 0])  # the last: seed 0 again
        took = time.perf_counter() - started
        print(f"CartPole forked at step {at} into {branches} running copies in {took:.2f} s")
        same = [np.asarray(b.step(1)[0]) for b in forks]
        fresh = corral.rl.SandboxEnv("CartPole-v1", client=client)
        try:
            fresh.reset(seed=0)
            restart = np.asarray(fresh.step(1)[0])
        finally:
            fresh.close()
        agree = all(np.array_equal(same[0], s) for s in same)
        went_on = not np.array_equal(same[0], restart)
        print(f"  the same action in every branch: {'same' if agree else 'DIFFERENT'} next "
              f"state, {'not' if went_on else 'WRONGLY'} the state of a fresh episode")
        paths = [rollout(b, 15) for b in forks]
        for i, p in enumerate(paths):
            print(f"  branch {i}: random rollout, cart at {p[:5]}...")
        distinct = len({tuple(p) for p in paths[:-1]}) == branches - 1
        replay = paths[0] == paths[-1]
        print(f"  reseeded branches diverge: {distinct}; equal seeds replay: {replay}")
        return agree and went_on and distinct and replay
    finally:
        for b in forks:
            b.close()
        env.close()


def repl_episode(client: corral.Client) -> bool:
    with corral.rl.Episode.start(image="python", client=client, network="none") as ep:
        ep.repl()
        ep.send("import random\nnotes = ['plan: sort the list']\ndata = [5, 3, 9, 1]")
        left, right = ep.fork(2)
        try:
            a = left.send("notes.append('try sorted()')\ndata = sorted(data)\nprint(data, notes)")
            b = right.send("notes.append('try reverse')\ndata.reverse()\nprint(data, notes)")
            print(f"REPL episode forked after {len(ep.steps)} steps (seeds {left.seed}, "
                  f"{right.seed}):\n  left:  {a.strip()}\n  right: {b.strip()}")
            draws = [x.send("print(random.random())").strip() for x in (left, right)]
            print(f"  random draws: {draws}")
            root = ep.send("print(data, notes)").strip()
            print(f"  the root episode is untouched: {root}")
            return (a != b and draws[0] != draws[1]
                    and root == "[5, 3, 9, 1] ['plan: sort the list']")
        finally:
            left.close()
            right.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--at", type=int, default=10, help="the step to branch at")
    parser.add_argument("--url", default=None, help="the daemon (default: CORRAL_URL or local)")
    args = parser.parse_args()
    with corral.Client(args.url) as client:
        ok = cartpole(client, max(2, args.branches), args.at) and repl_episode(client)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
