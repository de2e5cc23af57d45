"""Multi-agent env: agent programs in their own sandboxes, a referee on the host."""

from __future__ import annotations

import random

import pytest

import corral
from corral.rl import MatrixGame, MultiAgentSandboxEnv, PrisonersDilemma, RockPaperScissors
from tests.conftest import requires_root

ROCK = "def act(observation):\n    return 'rock'\n"

# Remembers the opponent's moves in `state` and a file; plays what beats their favourite.
COUNTER = """
BEATS = {"rock": "paper", "paper": "scissors", "scissors": "rock"}

def act(observation):
    seen = state.setdefault("seen", {})
    for agent, move in (observation["last"] or {}).items():
        if agent != observation["you"] and move:
            seen[move] = seen.get(move, 0) + 1
    with open("rounds.txt", "a") as f:
        f.write(f"{observation['round']}\\n")
    if not seen:
        return "scissors"
    return BEATS[max(seen, key=seen.get)]
"""

RANDOM = """
import random

def act(observation):
    print("thinking out loud")          # goes to stderr, not into the reply
    return random.choice(observation["moves"])
"""


def _env_sandboxes(client):
    return corral.Sandbox.list(tags=["corral-env=multiagent"], client=client)


# ------------------------------------------------------------ the referee alone


def test_matrix_game_scores_every_pair_and_faults():
    game = RockPaperScissors(rounds=2)
    obs = game.reset(["a", "b", "c"], random.Random(0))
    assert obs["a"] == {"round": 0, "rounds": 2, "you": "a", "last": None,
                        "moves": ["rock", "paper", "scissors"],
                        "scores": {"a": 0.0, "b": 0.0, "c": 0.0}}
    out = game.resolve({"a": "rock", "b": "scissors", "c": None})
    assert out.rewards == {"a": 2.0, "b": 0.0, "c": -2.0} and not out.truncated
    assert out.observations["b"]["last"] == {"a": "rock", "b": "scissors", "c": None}
    out = game.resolve({"a": "paper", "b": "paper", "c": "rock"})
    assert out.rewards == {"a": 1.0, "b": 1.0, "c": -2.0} and out.truncated
    assert out.observations["c"]["scores"] == {"a": 3.0, "b": 1.0, "c": -4.0}
    with pytest.raises(ValueError, match="not a move"):
        game.check_action("a", "lizard")
    pd = PrisonersDilemma()
    pd.reset(["x", "y"], random.Random(0))
    assert pd.resolve({"x": "defect", "y": "cooperate"}).rewards == {"x": 5.0, "y": 0.0}


def test_noise_follows_the_seed():
    def play(seed):
        game = PrisonersDilemma(rounds=50, noise=0.3)
        game.reset(["x", "y"], random.Random(seed))
        return [game.resolve({"x": "cooperate", "y": "cooperate"}).infos["x"]["played"]
                for _ in range(50)]

    assert play(1) == play(1) and play(1) != play(2)
    assert 5 < play(1).count("defect") < 30


def test_bad_arguments_fail_before_any_sandbox():
    game = RockPaperScissors()
    with pytest.raises(corral.InvalidArgument, match="agent name"):
        MultiAgentSandboxEnv(game, {"no spaces": ROCK})
    with pytest.raises(corral.InvalidArgument, match="non-empty code string"):
        MultiAgentSandboxEnv(game, {"a": "  "})
    with pytest.raises(corral.InvalidArgument, match="at least one agent"):
        MultiAgentSandboxEnv(game, {})
    with pytest.raises(corral.InvalidArgument, match="Game"):
        MultiAgentSandboxEnv("rps", {"a": ROCK})
    with pytest.raises(corral.InvalidArgument, match="every pair"):
        MatrixGame("g", {("a", "a"): 1.0, ("a", "b"): 0.0})
    with pytest.raises(corral.InvalidArgument, match="memory_mb"):
        MultiAgentSandboxEnv(game, {"a": ROCK}, memory_mb=1)
    env = MultiAgentSandboxEnv(game, {"a": ROCK})
    with pytest.raises(corral.InvalidState, match="reset"):
        env.step()
    with pytest.raises(corral.InvalidArgument, match="no agent 'b'"):
        env.sandbox("b")
    with pytest.raises(corral.InvalidArgument, match="seed must be an integer"):
        env.reset(seed="seven")


# ------------------------------------------------------------ real sandboxes


@requires_root
def test_a_match_keeps_state_in_each_sandbox(client):
    with MultiAgentSandboxEnv(RockPaperScissors(rounds=4), {"rock": ROCK, "counter": COUNTER},
                              client=client) as env:
        obs, infos = env.reset(seed=3)
        assert env.agents == ["rock", "counter"] and obs["rock"]["round"] == 0
        ids = {infos[a]["sandbox_id"] for a in env.agents}
        assert len(ids) == 2  # one sandbox per agent
        moves, rewards = [], []
        while env.agents:
            obs, rew, term, trunc, info = env.step()
            moves.append(info["counter"]["action"])
            rewards.append(rew)
        # counter starts blind, then beats rock from its memory of round 1 on.
        assert moves == ["scissors", "paper", "paper", "paper"]
        assert rewards[0] == {"rock": 1.0, "counter": -1.0}
        assert rewards[3] == {"rock": -1.0, "counter": 1.0}
        assert trunc == {"rock": True, "counter": True} and term == {"rock": False, "counter": False}
        assert obs["counter"]["scores"] == {"rock": -2.0, "counter": 2.0}
        # Its file lives in its own sandbox only, one line per step.
        assert env.sandbox("counter").files.read("rounds.txt") == b"0\n1\n2\n3\n"
        assert not env.sandbox("rock").files.exists("rounds.txt")
        with pytest.raises(corral.InvalidState, match="reset"):
            env.step()
        # A new episode starts on fresh sandboxes: nothing carries over.
        _, infos = env.reset(seed=3)
        assert {infos[a]["sandbox_id"] for a in env.agents}.isdisjoint(ids)
        assert not env.sandbox("counter").files.exists("rounds.txt")
        assert len(_env_sandboxes(client)) == 2
    assert _env_sandboxes(client) == []


@requires_root
def test_faults_are_per_agent_results(client):
    programs = {
        "rock": ROCK,
        "crash": "def act(observation):\n    raise ValueError('boom')\n",
        "sleepy": "import time\ndef act(observation):\n    time.sleep(600)\n",
        "hungry": "def act(observation):\n    x = b'x' * (1 << 30)\n    return 'rock'\n",
        "lizard": "def act(observation):\n    return 'lizard'\n",
        "nojson": "def act(observation):\n    return {1, 2}\n",
        "noact": "x = 1\n",
        # Writes a deeply nested mess to the runner's reply descriptor itself.
        "forger": "import os\ndef act(observation):\n    os.write(3, b'[' * 60000)\n"
                  "    return 'rock'\n",
    }
    # act_timeout 10 s: at 2 s every agent's first act timed out at load 40
    with MultiAgentSandboxEnv(RockPaperScissors(rounds=1), programs, act_timeout=10.0,
                              memory_mb=64, fault_penalty=-10.0, client=client) as env:
        env.reset(seed=0)
        _, rewards, _, trunc, infos = env.step()
    faults = {a: i["fault"] for a, i in infos.items()}
    assert faults == {"rock": None, "crash": "crash", "sleepy": "timeout", "hungry": "oom",
                      "lizard": "invalid_action", "nojson": "invalid_action", "noact": "crash",
                      "forger": "crash"}
    assert "ValueError: boom" in infos["crash"]["error"]
    assert "not a move" in infos["lizard"]["error"] and "not a JSON value" in infos["nojson"]["error"]
    assert "defines no function act" in infos["noact"]["error"]
    assert "no reply from act()" in infos["forger"]["error"]
    # rock beats seven forfeits; each faulty agent loses to everyone, plus the penalty.
    assert rewards["rock"] == 7.0
    assert all(rewards[a] == -7.0 - 10.0 for a in programs if a != "rock")
    assert all(trunc.values())
    assert _env_sandboxes(client) == []


@requires_root
def test_same_seed_same_episode_and_new_programs_keep_memory(client):
    game = RockPaperScissors(rounds=5, noise=0.2)

    def episode(env, seed):
        env.reset(seed=seed)
        trace = []
        while env.agents:
            _, rewards, _, _, infos = env.step()
            trace.append(([infos[a]["action"] for a in env.possible_agents],
                          [infos[a]["played"] for a in env.possible_agents], rewards))
        return trace

    with MultiAgentSandboxEnv(game, {"r1": RANDOM, "r2": RANDOM}, client=client) as env:
        first, again, other = episode(env, 11), episode(env, 11), episode(env, 12)
        assert first == again and first != other
        assert first[0][0][0] != first[0][0][1] or first[1][0][0] != first[1][0][1]  # own seeds
        # A new program (the "action") mid-episode: it runs from now on, state kept.
        env.reset(seed=1)
        env.step()
        env.step()
        counting = ("def act(observation):\n    state['n'] = state.get('n', 0) + 1\n"
                    "    return ['rock', 'paper', 'scissors'][state['n'] % 3]\n")
        _, _, _, _, infos = env.step({"r1": counting})
        _, _, _, _, infos2 = env.step()
        assert (infos["r1"]["action"], infos2["r1"]["action"]) == ("paper", "scissors")
        assert env.program("r1") == counting
        with pytest.raises(corral.InvalidArgument, match="not a live agent"):
            env.step({"ghost": ROCK})


@requires_root
def test_infrastructure_failure_raises_a_typed_error(client):
    env = MultiAgentSandboxEnv(RockPaperScissors(rounds=3), {"a": ROCK, "b": ROCK},
                               client=client)
    try:
        env.reset(seed=0)
        env.sandbox("b").delete()  # the sandbox disappears under the env
        with pytest.raises(corral.SandboxNotFound, match="agent 'b'") as excinfo:
            env.step()
        assert excinfo.value.details["agent"] == "b"
        with pytest.raises(corral.InvalidState, match="reset"):
            env.step()  # the episode is over; reset() starts a new one
        env.reset(seed=0)
        _, rewards, _, _, _ = env.step()
        assert rewards == {"a": 0.0, "b": 0.0}
    finally:
        env.close()
    env.close()  # twice is fine
    assert _env_sandboxes(client) == []
    with pytest.raises(corral.InvalidState, match="closed"):
        env.reset()
