"""TRL integration: real GRPOTrainer steps on CPU with a tiny random model, rewards and
tool calls run in real sandboxes; and SandboxToolEnv on its own."""

from __future__ import annotations

import gc
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import corral
from corral.errors import InvalidArgument, InvalidState
from corral.rl import SandboxToolEnv, async_code_reward, code_reward
from tests.conftest import requires_root

NEEDS_TRL = "needs the trl extra: pip install 'corral[trl]'"

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
TOOLS = {"bash", "read_file", "write_file", "run_tests"}


def load_example():
    """The tiny model, tokenizer and trainers of examples/trl_grpo.py (one code for both)."""
    pytest.importorskip("trl", reason=NEEDS_TRL)
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def left_on(daemon, *tags: str) -> list:
    with corral.Client(daemon.url) as client:
        return corral.Sandbox.list(tags=list(tags), client=client)


def expected_fraction(code: str, tests: list[str]) -> float:
    """The oracle: the completions are harmless assignments, so run them here too."""
    ns: dict = {}
    try:
        exec(code, ns)
    except Exception:
        return 0.0
    passed = 0
    for t in tests:
        try:
            exec(t, dict(ns))
            passed += 1
        except Exception:
            pass
    return passed / len(tests)


@requires_root
def test_grpo_two_steps_with_code_reward(daemon, tmp_path):
    ex = load_example()
    outcomes = []
    trainer, reward = ex.reward_trainer(2, daemon.url, str(tmp_path), on_result=outcomes.append)
    trainer.train()

    assert trainer.state.global_step == 2
    assert len(outcomes) == 16  # 2 steps x 2 prompts x 4 generations
    assert all(o.code and o.sandbox_id for o in outcomes)
    assert len({o.sandbox_id for o in outcomes}) == 16, "one fresh sandbox per completion"
    for o in outcomes:  # what the sandbox reported is what running the code gives
        tests = ex.REWARD_DATA["tests"][o.report.total - 1]
        assert o.reward == pytest.approx(expected_fraction(o.code, tests)), (o.code, o.reason)
    logged = [h["rewards/code_reward_fraction/mean"] for h in trainer.state.log_history
              if "rewards/code_reward_fraction/mean" in h]
    for step, mean in enumerate(logged):
        batch = outcomes[step * 8:(step + 1) * 8]
        assert mean == pytest.approx(sum(o.reward for o in batch) / 8)
    s = reward.stats
    assert s.sandboxes_created == s.sandboxes_deleted == 16 and s.infra_failures == 0
    assert left_on(daemon, "example=trl_grpo") == []


@requires_root
def test_grpo_two_steps_with_environment_factory(daemon, tmp_path):
    ex = load_example()
    rollouts = []

    class RecordingEnv(SandboxToolEnv):
        """Notes what the model's tool calls left in the sandbox before it is scored."""

        def get_reward(self):
            sb = self._sandbox()
            try:
                written = sb.files.read("solution.py").decode()
            except corral.FileNotFound:
                written = None
            reward = super().get_reward()
            rollouts.append((sb.id, written, reward))
            return reward

    trainer = ex.env_trainer(2, daemon.url, str(tmp_path), env_class=RecordingEnv)
    trainer.train()

    assert trainer.state.global_step == 2
    assert len(rollouts) == 16 and len({sid for sid, _, _ in rollouts}) == 16
    for _, written, reward in rollouts:
        # The first token is always a write_file call: GOOD passes both tests, BAD none.
        assert written in (ex.GOOD, ex.BAD)
        assert reward == (1.0 if written == ex.GOOD else 0.0)
    calls = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert calls and all(c >= 1 for c in calls)
    envs = trainer._environment_pool[None]
    assert sum(e.rollouts for e in envs) == 16 and all(e.sandbox_id is None for e in envs)
    assert left_on(daemon, "example=trl_grpo") == []


def test_trl_sees_the_right_kind_of_reward_function():
    pytest.importorskip("trl", reason=NEEDS_TRL)
    from trl.trainer.utils import get_callable_name, is_async_callable

    assert get_callable_name(code_reward("binary")) == "code_reward_binary"
    assert not is_async_callable(code_reward())
    assert is_async_callable(async_code_reward())


def test_tools_are_the_public_methods_with_schemas():
    pytest.importorskip("transformers", reason=NEEDS_TRL)
    from transformers.utils import get_json_schema

    env = SandboxToolEnv()
    members = {n for n, _ in inspect.getmembers(SandboxToolEnv, predicate=inspect.isfunction)
               if not n.startswith("_")}
    assert members == TOOLS | {"reset", "get_reward"}  # what TRL exposes, and its hooks
    schemas = {name: get_json_schema(getattr(env, name)) for name in TOOLS}
    assert schemas["write_file"]["function"]["parameters"]["required"] == ["path", "content"]
    assert schemas["bash"]["function"]["parameters"]["properties"]["command"]["type"] == "string"
    with pytest.raises(InvalidArgument):
        SandboxToolEnv(mode="most")


@requires_root
def test_one_persistent_sandbox_per_rollout(daemon):
    env = SandboxToolEnv(url=daemon.url, files={"README": "hello"}, instructions="Use the tools.",
                         tags=["test=trl-env"])
    tests = ["from solution import f\nassert f(2) == 4", "assert f(0) == 0"]
    assert env.reset(prompt="p", tests=tests) == "Use the tools."
    assert env.read_file("README") == "hello"
    assert env.write_file("solution.py", "def f(x):\n    return x + 1\n") == "wrote 27 bytes to solution.py"
    assert env.bash("python3 -c 'import solution; print(solution.f(5))'") == "exit code 0\n6\n"
    assert "exit code 3" in env.bash("echo oops >&2; exit 3")
    assert env.read_file("missing.txt").startswith("error: no such file")
    feedback = env.run_tests()
    assert feedback.startswith("passed 0/2; test 0: AssertionError")
    first = env.sandbox_id
    env.bash("echo 'def f(x): return 2 * x' > solution.py")
    assert env.get_reward() == 1.0 and env.get_reward() == 1.0
    assert env.sandbox_id is None and left_on(daemon, "test=trl-env") == []
    with pytest.raises(InvalidState, match="reset"):
        env.bash("true")

    env.reset(tests=["assert False"])
    env.bash("true")
    assert env.sandbox_id != first and env.read_file("solution.py").startswith("error")
    second = env.sandbox_id
    env.reset(tests=[])  # a new rollout before the last was scored: the old one goes
    env.bash("true")
    assert [sb.id for sb in left_on(daemon, "test=trl-env")] == [env.sandbox_id] != [second]
    assert env.get_reward() == 0.0  # no solution.py: it does not load
    with pytest.raises(InvalidArgument, match="no 'tests' column"):
        env.reset(prompt="p")


@requires_root
def test_no_sandbox_outlives_its_environment(daemon, make_daemon):
    envs = [SandboxToolEnv(url=daemon.url, tags=["test=trl-leak"]) for _ in range(3)]
    for e in envs:
        e.reset(tests=[])
        e.bash("true")
    assert len(left_on(daemon, "test=trl-leak")) == 3
    del e
    envs.pop()
    gc.collect()  # a garbage-collected environment deletes its sandbox
    assert len(left_on(daemon, "test=trl-leak")) == 2
    assert SandboxToolEnv.close_all() >= 2
    assert left_on(daemon, "test=trl-leak") == []

    other = make_daemon()
    env = SandboxToolEnv(url=other.url)
    env.reset(tests=["assert 1"])
    env.bash("true")
    other.stop()
    assert env.get_reward() is None  # the daemon went away: unknown, not 0.0


def test_environment_module_imports_no_gymnasium():
    code = ("import sys, corral.rl.trl_env, corral.rl.envs.codegen, corral.rl.rewards; "
            "assert 'gymnasium' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
