"""Seeded CartPole-v1 episodes under a random policy; imported in-process by the
benchmark and run as a script inside sandboxes, so both run the very same code.

    python3 cartpole_episodes.py FIRST_SEED COUNT    # prints one JSON line per episode
    python3 cartpole_episodes.py serve               # pre-started: see serve()

Each episode: ``env.reset(seed=s)``, ``env.action_space.seed(s)``, then sampled
actions until the episode ends. Its record is ``[seed, steps, return, digest]``,
where the digest covers every observation, so equal records mean equal trajectories.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def run_episodes(first_seed: int, count: int, env=None) -> list[list]:
    """Records of ``count`` episodes from ``first_seed`` (in ``env``, else a new one);
    the env is closed afterwards either way."""
    if env is None:
        import gymnasium as gym

        env = gym.make("CartPole-v1")
    records = []
    try:
        for seed in range(first_seed, first_seed + count):
            obs, _ = env.reset(seed=seed)
            env.action_space.seed(seed)
            digest = hashlib.sha256(obs.tobytes())
            steps, total, done = 0, 0.0, False
            while not done:
                obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
                digest.update(obs.tobytes())
                steps += 1
                total += float(reward)
                done = terminated or truncated
            records.append([seed, steps, total, digest.hexdigest()[:16]])
    finally:
        env.close()
    return records


def serve() -> float:
    """A pre-started episode server: import gymnasium and make the env, say ``READY``,
    then wait for ONE request ``FIRST COUNT`` on stdin, print its records and exit. An
    episode run this way pays neither the interpreter's start nor the import; the
    process (and its env) never serves a second request. Returns its CPU seconds at
    ``READY``."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    ready = cpu_s()
    print("READY", flush=True)
    first, count = (int(x) for x in sys.stdin.readline().split())
    for record in run_episodes(first, count, env):
        print(json.dumps(record))
    return ready


def cpu_s() -> float:
    """This process's CPU seconds (user + system): a figure the host's load moves little."""
    t = os.times()
    return t.user + t.system


if __name__ == "__main__":
    ready = 0.0
    if sys.argv[1:] == ["serve"]:
        ready = serve()
    else:
        for record in run_episodes(int(sys.argv[1]), int(sys.argv[2])):
            print(json.dumps(record))
    # CPU seconds, the start and import included, and of them those before READY
    print(json.dumps({"cpu_s": cpu_s(), "ready_cpu_s": ready}), file=sys.stderr)
