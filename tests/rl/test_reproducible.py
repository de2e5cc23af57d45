"""Same seed, same trajectory: digests across sandboxes and this process."""

from __future__ import annotations

import textwrap

import gymnasium as gym
import pytest

import corral
from corral.rl import SandboxEnv, trajectory_digest, verify_reproducible
from corral.rl.reproducibility import IN_PROCESS, SeedResult, trajectory
from tests.conftest import requires_root

# Deterministic except that every process draws its own salt: two sandboxes part.
SALTED = textwrap.dedent('''
    import os

    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces

    SALT = int.from_bytes(os.urandom(6), "little") + 1


    class Salted(gym.Env):
        def __init__(self):
            self.observation_space = spaces.Box(0, 2**62, (1,), dtype=np.int64)
            self.action_space = spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self._t = 0
            return np.array([0]), {}

        def step(self, action):
            self._t += 1
            salt = SALT if self._t >= 3 else 0  # the first 2 steps agree, then they part
            return np.array([self._t * 10 + int(action) + salt]), 1.0, False, self._t >= 50, {}
''')


def test_digests_of_local_runs():
    env = gym.make("CartPole-v1")
    first = trajectory(env, 3, 40)
    assert len(first) == 40 and trajectory(env, 3, 40) == first  # same seed, same digests
    assert trajectory_digest(env, 3, 40) == first[-1]
    assert trajectory_digest(env, 4, 40) != first[-1]
    assert trajectory_digest(env, 3, 41) != first[-1]
    with pytest.raises(corral.InvalidArgument):
        trajectory(env, 3, 0)
    result = SeedResult(seed=1, steps=5, digests={"a": "x", "b": "x"})
    assert result.match and not SeedResult(1, 5, {"a": "x", "b": "y"}, 2).match
    with pytest.raises(corral.InvalidArgument, match="sandboxes >= 2"):
        verify_reproducible("CartPole-v1", sandboxes=1)
    with pytest.raises(corral.InvalidArgument, match="seeds"):
        verify_reproducible("CartPole-v1", seeds=[])


@requires_root
def test_cartpole_is_reproducible_across_sandboxes_and_here(client):
    report = verify_reproducible("CartPole-v1", seeds=[0, 7], steps=80, client=client)
    assert report.all_match and report.mismatched == [] and report.in_process
    assert len(report.sources) == 3 and report.sources[-1] == IN_PROCESS
    assert len({s for s in report.sources if s.startswith("sandbox sb-")}) == 2
    local = gym.make("CartPole-v1")
    for result in report.results:
        assert set(result.digests) == set(report.sources) and result.first_divergence is None
        assert set(result.digests.values()) == {trajectory_digest(local, result.seed, 80)}
    assert report.results[0].digests != report.results[1].digests  # seeds differ
    text = str(report)
    assert "seed 0: match" in text and "seed 7: match" in text


@requires_root
def test_a_nondeterministic_env_is_caught(client, tmp_path):
    salted = tmp_path / "salted.py"
    salted.write_text(SALTED)

    def factory():
        return SandboxEnv(f"{salted}:Salted", client=client)

    report = verify_reproducible(factory, seeds=[1], steps=10, local=False)
    assert not report.all_match and report.mismatched == [1] and not report.in_process
    (result,) = report.results
    assert result.first_divergence == 2  # steps 0 and 1 agreed
    assert "MISMATCH from step 2" in str(report)
    with pytest.raises(corral.InvalidArgument, match="local=True"):
        verify_reproducible(factory, local=True)
