"""Same seed, same CartPole trajectory: in two sandboxes and in this process.

Each sandbox hosts a real ``gymnasium`` CartPole-v1 (image ``rl``), stepped from here
through ``corral.rl.SandboxEnv``. For every seed, ``reset(seed=s)`` and an action space
seeded with ``s`` drive ``--steps`` steps; the digest of the whole trajectory
(observations bit for bit, rewards, terminations) must be the same in both sandboxes
and in an in-process ``gymnasium.make("CartPole-v1")``. Then a 4-sandbox vector env
runs the same seeds side by side and is checked against gymnasium's own
``SyncVectorEnv``.

    python examples/cartpole_reproducibility.py
    python examples/cartpole_reproducibility.py --seeds 0 1 2 3 --steps 300
    python examples/cartpole_reproducibility.py --url unix:///tmp/corral.sock

Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon, starting it if
nothing answers. Exits 1 if a seed's trajectories differ. Every sandbox is deleted.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

import corral
import corral.rl


def vector_check(client: corral.Client, seed: int, steps: int, num_envs: int) -> bool:
    """A SandboxVectorEnv against gymnasium's SyncVectorEnv, step by step."""
    sandboxed = corral.rl.SandboxVectorEnv("CartPole-v1", num_envs, client=client)
    local = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * num_envs)
    try:
        obs, _ = sandboxed.reset(seed=seed)
        same = np.array_equal(obs, local.reset(seed=seed)[0])
        sandboxed.action_space.seed(seed)
        started = time.perf_counter()
        for _ in range(steps):
            actions = sandboxed.action_space.sample()
            ours, theirs = sandboxed.step(actions), local.step(actions)
            same = same and all(np.array_equal(a, b) for a, b in zip(ours[:4], theirs[:4], strict=True))
        elapsed = time.perf_counter() - started
        print(f"vector env: {num_envs} sandboxes x {steps} steps in {elapsed:.2f} s "
              f"({num_envs * steps / elapsed:.0f} env steps/s); "
              f"same as SyncVectorEnv: {'yes' if same else 'NO'}")
        return same
    finally:
        sandboxed.close()
        local.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds to run")
    parser.add_argument("--steps", type=int, default=200, help="steps per seed (default 200)")
    parser.add_argument("--vector-envs", type=int, default=4, help="sandboxes of the vector run")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()

    with corral.Client(args.url) as client:
        started = time.perf_counter()
        report = corral.rl.verify_reproducible(
            "CartPole-v1", seeds=args.seeds, steps=args.steps, client=client
        )
        print(report)
        print(f"checked in {time.perf_counter() - started:.2f} s; "
              f"all match: {'yes' if report.all_match else 'NO'}")
        vector_ok = vector_check(client, args.seeds[0], args.steps, args.vector_envs)
    return 0 if report.all_match and vector_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
