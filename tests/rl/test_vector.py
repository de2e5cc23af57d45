"""SandboxVectorEnv: gymnasium's vector API over sandboxes, checked against SyncVectorEnv."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import corral
from corral.rl import EnvError, SandboxVectorEnv
from tests.conftest import requires_root
from tests.rl.test_gym_env import KITCHEN, local_kitchen, same

pytestmark = [requires_root, pytest.mark.root]


@pytest.fixture
def kitchen(tmp_path):
    path = tmp_path / "kitchen.py"
    path.write_text(KITCHEN)
    return path


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_same_as_sync_vector_env(client, mode):
    # one mode over exchange_all (no port channel), the others over port sockets
    channel = mode != AutoresetMode.NEXT_STEP
    envs = SandboxVectorEnv("CartPole-v1", 2, autoreset_mode=mode, client=client,
                            port_channel=channel)
    assert all((r.channel is not None) == channel for r in envs._remotes)
    local = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2, autoreset_mode=mode)
    try:
        assert envs.num_envs == 2 and envs.metadata["autoreset_mode"] == mode
        assert envs.single_observation_space == local.single_observation_space
        assert envs.observation_space == local.observation_space
        assert envs.action_space == local.action_space
        assert len({sb.id for sb in envs.sandboxes}) == 2
        assert same(envs.reset(seed=[4, 9]), local.reset(seed=[4, 9]))
        envs.action_space.seed(4)
        ended = 0
        for _ in range(90):  # random CartPole episodes end every ~20 steps
            actions = envs.action_space.sample()
            if mode == AutoresetMode.DISABLED or _ % 2:
                got = envs.step(actions)
            else:
                envs.step_async(actions)
                got = envs.step_wait()
            want = local.step(actions)
            assert same(got, want)  # observations, rewards, flags and infos (final_obs too)
            done = got[2] | got[3]
            ended += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                assert same(envs.reset(options={"reset_mask": done}),
                            local.reset(options={"reset_mask": done}))
        assert ended >= 2
    finally:
        envs.close()
        local.close()
    assert envs.closed


def test_calls_attributes_render_and_errors(client, kitchen):
    envs = SandboxVectorEnv(f"{kitchen}:Kitchen", 2, client=client, render_mode="ansi")
    try:
        Kitchen = local_kitchen(kitchen)
        local = gym.vector.SyncVectorEnv([lambda: Kitchen(render_mode="ansi")] * 2)
        assert same(envs.reset(seed=1), local.reset(seed=1))
        assert envs.render() == local.render()
        envs.set_attr("size", [5, 6])
        assert envs.get_attr("size") == (5, 6)
        envs.set_attr("size", 3)
        assert envs.call("size") == (3, 3)

        bad = (np.array([0, 7]), np.zeros((2, 1), np.float32))  # sub-env 1 raises on 7
        with pytest.raises(EnvError, match="IndexError"):
            envs.step(bad)
        # Every reply was read: the vector env is still in step with its servers.
        assert same(envs.reset(seed=1), local.reset(seed=1))
        actions = envs.action_space.sample()
        assert same(envs.step(actions), local.step(actions))

        with pytest.raises(corral.InvalidState, match="step_async"):
            envs.step_wait()
        envs.step_async(envs.action_space.sample())
        with pytest.raises(corral.InvalidState):
            envs.step_async(envs.action_space.sample())
        envs.step_wait()
        with pytest.raises(corral.InvalidArgument, match="seeds"):
            envs.reset(seed=[1, 2, 3])
        with pytest.raises(corral.InvalidArgument, match="reset_mask"):
            envs.reset(options={"reset_mask": np.zeros(2, dtype=np.bool_)})
        local.close()
    finally:
        envs.close()
    with pytest.raises(corral.InvalidState, match="closed"):
        envs.step(envs.action_space.sample())


def test_disabled_autoreset_refuses_to_step_an_ended_env(client):
    envs = SandboxVectorEnv("CartPole-v1", 1, client=client, autoreset_mode="Disabled")
    try:
        envs.reset(seed=0)
        for _ in range(600):  # always pushing left ends an episode within ~10 steps
            _, _, terminated, truncated, _ = envs.step(np.array([0]))
            if terminated[0] or truncated[0]:
                break
        with pytest.raises(corral.InvalidState, match="reset_mask"):
            envs.step(np.array([0]))
    finally:
        envs.close()


def test_a_failed_start_leaves_nothing(client):
    with pytest.raises(EnvError, match="NameNotFound"):
        SandboxVectorEnv("NoSuchEnv-v0", 3, client=client)
    with pytest.raises(corral.InvalidArgument):
        SandboxVectorEnv("CartPole-v1", 0, client=client)
