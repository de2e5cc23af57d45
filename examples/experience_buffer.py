"""Collect CartPole episodes in sandboxes into an experience buffer, then read it back.

Each sandbox (image "rl": gymnasium and numpy preinstalled) plays its share of the
seeds with an epsilon-greedy heuristic policy and saves every episode as a ``.npz``;
the host downloads them into one buffer (Parquet shards or a JSON Lines file),
reads it back as numpy arrays and draws a replay batch.

    python examples/experience_buffer.py                       # 16 episodes, Parquet
    python examples/experience_buffer.py --episodes 64 --parallel 8 --format jsonl
    python examples/experience_buffer.py --out runs/cartpole.parquet   # keep the buffer

Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon, starting it if
nothing answers. Without ``--out`` the buffer goes to a temporary directory that is
removed at the end. Needs ``pip install 'corral[rl]'`` on the host (numpy, pyarrow).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import corral
from corral.rl import ExperienceBuffer, ExperienceWriter

# Runs in the sandbox: `python3 episodes.py SEED...` writes ep-SEED.npz for each seed.
EPISODES = """
import sys
import gymnasium as gym
import numpy as np

def policy(obs, rng, epsilon=0.1):
    if rng.random() < epsilon:
        return int(rng.integers(2))
    return int(obs[2] + 0.5 * obs[3] > 0)        # push toward where the pole falls

for seed in map(int, sys.argv[1:]):
    env, rng = gym.make("CartPole-v1"), np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    rows = []
    while True:
        action = policy(obs, rng)
        nxt, reward, terminated, truncated, _ = env.step(action)
        rows.append((obs, action, reward, nxt, terminated, truncated))
        if terminated or truncated:
            break
        obs = nxt
    o, a, r, n, te, tr = zip(*rows)
    np.savez(f"ep-{seed}.npz", observation=np.stack(o), action=np.array(a, np.int64),
             reward=np.array(r), next_observation=np.stack(n), terminated=np.array(te),
             truncated=np.array(tr), seed=np.array(seed))
"""


def collect(seeds: list[int], client: corral.Client) -> list[tuple[int, bytes]]:
    """One sandbox plays ``seeds``; returns each episode's .npz, as downloaded."""
    with corral.Sandbox.create(image="rl", memory_mb=512, timeout=600,
                               tags=["example=experience-buffer"], client=client) as sb:
        sb.files.write("episodes.py", EPISODES)
        sb.exec(["python3", "episodes.py", *map(str, seeds)], timeout=300, check=True)
        return [(seed, sb.files.read(f"ep-{seed}.npz")) for seed in seeds]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16, help="episodes (default 16)")
    parser.add_argument("--parallel", type=int, default=4, help="sandboxes (default 4)")
    parser.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    parser.add_argument("--out", help="buffer path to keep (default: a temporary one)")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()

    tmp = None if args.out else Path(tempfile.mkdtemp(prefix="corral-buffer-"))
    path = Path(args.out) if args.out else tmp / f"cartpole.{args.format}"
    seeds = list(range(args.episodes))
    shares = [seeds[i::args.parallel] for i in range(args.parallel) if seeds[i::args.parallel]]
    try:
        with corral.Client(args.url) as client:
            start = time.perf_counter()
            handles = [corral.submit(collect, share, client) for share in shares]
            with ExperienceWriter(path, format=args.format) as writer:
                for handle in corral.as_completed(handles):
                    for seed, npz in handle.result():
                        writer.add_npz(npz, episode_id=f"seed-{seed}")  # seed is in the file
            collected = time.perf_counter() - start
        print(f"collected {writer.rows_written} transitions of {writer.episodes_written} "
              f"episodes in {len(shares)} sandboxes in {collected:.2f} s -> {path}")

        start = time.perf_counter()
        buf = ExperienceBuffer.load(path)
        read_ms = (time.perf_counter() - start) * 1000
        data = buf.data
        print(f"read back {len(buf)} transitions in {read_ms:.1f} ms")
        for name in ("observation", "action", "reward", "next_observation", "terminated",
                     "truncated", "step", "seed"):
            array = getattr(data, name)
            print(f"  {name:<17} shape {str(array.shape):<10} dtype {array.dtype}")
        returns = list(buf.episode_returns().values())
        print(f"episodes {len(returns)}, mean return {statistics.fmean(returns):.1f} "
              f"(min {min(returns):.0f}, max {max(returns):.0f})")
        batch = buf.sample(256, rng=np.random.default_rng(0))
        print(f"replay batch: observation {batch.observation.shape}, action "
              f"{batch.action.shape}, from {len(set(batch.episode_id))} episodes")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
