"""Branching a running episode (corral.rl.branching, docs/rl.md "Branching"): a live
fork of a SandboxEnv mid-episode gives copies that step on from the parent's state,
each its own copy of the env server (its pipes reattached), reseeded inside the copy:
different seeds diverge, equal seeds reproduce, and the parent goes on untouched. An
Episode's Python REPL is forked with its variables."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import corral
from corral.errors import InvalidArgument
from corral.rl import Episode, SandboxEnv, SandboxVectorEnv
from corral.rl.branching import SEED_FILE, branch_seeds
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir

# CartPole whose every step draws from the env's own np_random and Python's random:
# branches that share a state diverge only through their generators
NOISY = textwrap.dedent('''
    import random

    import numpy as np
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv


    class NoisyCartPole(CartPoleEnv):
        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            noise = self.np_random.normal(0, 1e-3, 4) + random.random() * 1e-4
            self.state = tuple(np.asarray(self.state) + noise)
            return np.asarray(self.state, dtype=np.float32), reward, terminated, truncated, info
''')
ACTIONS = [0, 1, 1, 0, 1]


@pytest.fixture
def criu_cached():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


def test_branch_seeds():
    assert branch_seeds(3, False) == [None] * 3
    fresh = branch_seeds(3, True)
    assert len(set(fresh)) == 3 and all(0 <= s < 2**63 for s in fresh)
    assert branch_seeds(4, 7) == branch_seeds(4, 7) != branch_seeds(4, 8)
    assert len(set(branch_seeds(4, 7))) == 4
    assert branch_seeds(2, [5, 5]) == [5, 5]
    for bad in ([1], [1, -1], ["1", 2], "12", 1.5, None):
        with pytest.raises(InvalidArgument, match="reseed"):
            branch_seeds(2, bad)
    with pytest.raises(InvalidArgument):
        branch_seeds(0, True)


def _run(env, actions=ACTIONS):
    return np.stack([env.step(a)[0] for a in actions])


def test_a_cartpole_forked_mid_episode_steps_on_in_each_branch(client, criu_cached, tmp_path):
    path = tmp_path / "noisy.py"
    path.write_text(NOISY)
    env = SandboxEnv(f"{path}:NoisyCartPole", client=client,
                     sandbox_options={"checkpointable": True, "network": "none"})
    branches: list[SandboxEnv] = []
    try:
        env.reset(seed=3)
        before = _run(env, [0, 1, 0])[-1]
        branches = env.fork(3, reseed=[11, 11, 12])
        assert len({b.sandbox.id for b in branches} | {env.sandbox.id}) == 4
        # each steps over its own port socket, as the parent does (back on it)
        assert env._remote.channel is not None
        assert all(b._remote.channel is not None for b in branches)
        runs = [_run(b) for b in branches]
        # each went on from the parent's state (one step on, not from a reset)
        x = before[0] + 0.02 * before[1]  # CartPole's next position (tau 0.02)
        assert all(abs(r[0][0] - x) < 0.005 for r in runs), (before, runs)
        np.testing.assert_array_equal(runs[0], runs[1])  # equal seeds: the same branch
        assert not np.array_equal(runs[0], runs[2])  # another seed: another branch
        parent = _run(env)  # the parent stepped on, untouched by its branches
        assert not np.array_equal(parent, runs[0]) and not np.array_equal(parent, runs[2])
        # each branch is its own process: a reset there resets only it
        obs, _ = branches[2].reset(seed=3)
        again = SandboxEnv(f"{path}:NoisyCartPole", client=client)
        try:
            np.testing.assert_array_equal(obs, again.reset(seed=3)[0])
        finally:
            again.close()
        # reseed=False: every copy replays the parent's randomness
        same = env.fork(2, reseed=False)
        branches += same
        np.testing.assert_array_equal(_run(same[0]), _run(same[1]))
    finally:
        for b in branches:
            b.close()
        env.close()
    assert all(b.sandbox.id not in {s.id for s in corral.Sandbox.list(client=client)}
               for b in branches)


def test_a_vector_env_forks_every_sub_env_mid_episode(daemon, client, criu_cached, tmp_path):
    """SandboxVectorEnv.fork: each copy has a live fork of every sub-env; equal seeds
    give equal branches, ``reseed=False`` replays the parent's randomness. Built on a
    daemon's URL (a client of its own): each copy gets one, and outlives the parent."""
    path = tmp_path / "noisy.py"
    path.write_text(NOISY)
    envs = SandboxVectorEnv(f"{path}:NoisyCartPole", 2, client=daemon.url,
                            sandbox_options={"checkpointable": True, "network": "none"})
    branches: list[SandboxVectorEnv] = []

    def run(v):
        return np.stack([v.step(np.array([a, 1 - a]))[0] for a in ACTIONS])

    try:
        envs.reset(seed=3)
        envs.step(np.array([0, 1]))
        branches = envs.fork(2, reseed=[11, 11])
        branches += envs.fork(1, reseed=False)
        ids = {sb.id for v in [envs, *branches] for sb in v.sandboxes}
        assert len(ids) == 8 and all(v.num_envs == 2 for v in branches)
        runs = [run(v) for v in branches]
        np.testing.assert_array_equal(runs[0], runs[1])  # equal seeds: the same branch
        assert not np.array_equal(runs[0][:, 0], runs[0][:, 1])  # sub-envs: s, s + 1
        np.testing.assert_array_equal(runs[2], run(envs))  # reseed=False: the parent's
        assert not np.array_equal(runs[0], runs[2])
        branches[0].close()  # a close leaves the others running, the parent's too
        envs.close()
        assert branches[1].step(np.array([0, 0]))[0].shape == (2, 4)
    finally:
        for v in branches:
            v.close()
        envs.close()
    assert not ids & {s.id for s in corral.Sandbox.list(client=client)}


def test_an_env_not_checkpointable_is_refused_and_keeps_running(client, criu_cached):
    env = SandboxEnv("CartPole-v1", client=client)
    try:
        env.reset(seed=0)
        with pytest.raises(corral.errors.InvalidState, match="checkpointable"):
            env.fork(2)
        env.step(0)
    finally:
        env.close()


def test_an_episode_forks_its_repl_with_its_state(client, criu_cached):
    with Episode.start(image="python", client=client, network="none") as ep:
        ep.repl()
        ep.send("import random\nx = 41")
        ep.run("echo root > /tmp/who")
        left, right = ep.fork(2, reseed=[1, 2])
        try:
            assert left.send("x += 1\nprint(x)") == "42\n"
            assert right.send("x -= 1\nprint(x)") == "40\n"
            assert ep.send("print(x)") == "41\n"  # the parent's REPL is its own
            draws = [b.send("print(random.random())") for b in (left, right)]
            assert draws[0] != draws[1]
            assert left.run(f"cat {SEED_FILE}").stdout.strip() == "1"
            assert right.run("echo $CORRAL_SEED").stdout.strip() == "2"
            assert right.run("cat /tmp/who").stdout.strip() == "root"
            assert left.steps[:2] == ep.steps[:2]
        finally:
            left.close()
            right.close()
