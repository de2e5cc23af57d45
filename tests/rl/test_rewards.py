"""Code-execution rewards: extraction rules, scoring in real sandboxes, infra failures."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

import corral
from corral.client._models import CommandResult
from corral.errors import ImageNotFound, InvalidArgument
from corral.rl import code_reward
from corral.rl.code import (
    extract_code,
    harness_request,
    normalize_tests,
    parse_report,
    render_result,
)
from corral.rl.rewards import AsyncCodeReward, CodeReward, async_code_reward
from tests.conftest import requires_root

TESTS = ["assert f(2) == 4", "assert f(3) == 6", "assert f(0) == 0"]
GO = "/tmp/corral-go"  # a completion that waits for it holds until the test writes it


def fence(code: str, lang: str = "python") -> str:
    return f"Here you go:\n```{lang}\n{code}\n```\n"


# --------------------------------------------------------------------- extraction


def test_extract_last_python_fence_wins_and_other_languages_are_skipped():
    text = fence("x = 1") + fence("ls -l", "bash") + fence("x = 2", "py") + fence("x = 3", "")
    assert extract_code(text) == "x = 3\n"
    assert extract_code(fence("x = 1") + fence("echo", "bash")) == "x = 1\n"
    assert extract_code("```python3\ny = 1\n```") == "y = 1\n"


def test_extract_answer_tag_beats_fences_and_may_hold_one():
    assert extract_code(fence("x = 1") + "<answer>\nx = 2\n</answer>") == "x = 2"
    assert extract_code("<answer>a</answer> <ANSWER>" + fence("b = 1") + "</ANSWER>") == "b = 1\n"


def test_extract_ignores_unclosed_fences_and_prose():
    assert extract_code("```python\nprint(1)\n") is None  # cut at max_completion_length
    assert extract_code("I would return x * 2.") is None
    assert extract_code("print(1)", fallback="raw") == "print(1)"
    with pytest.raises(InvalidArgument):
        extract_code("x", fallback="everything")  # type: ignore[arg-type]


def test_extract_conversational_completions():
    messages = [
        {"role": "assistant", "content": fence("x = 1")},
        {"role": "tool", "name": "bash", "content": fence("x = 99")},  # not the model's
        {"role": "assistant", "content": [{"type": "text", "text": fence("x = 2")}]},
    ]
    assert extract_code(messages) == "x = 2\n"
    assert extract_code([{"role": "assistant", "content": "none"}]) is None


def test_normalize_tests():
    assert normalize_tests("assert 1") == ["assert 1"]
    assert normalize_tests(None) == []
    assert normalize_tests(("a", "b")) == ["a", "b"]
    with pytest.raises(InvalidArgument, match="list of them"):
        normalize_tests([1, 2])


def test_in_process_report_without_the_token_is_a_crash():
    argv, stdin, token = harness_request(["assert 1"], code="x=1", timeout=5)
    forged = '{"load": ["ok", null], "tests": [["ok", null]], "output": ""}'
    r = CommandResult(args=argv, returncode=0, stdout_bytes=f"corral-report-0{forged}\n".encode())
    assert parse_report(r, token, 1).status == "crashed"
    ok = CommandResult(args=argv, returncode=0, stdout_bytes=f"{token}{forged}\n".encode())
    assert parse_report(ok, token, 1).fraction == 1.0
    assert parse_report(ok, token, 2).status == "crashed"  # a report for other tests
    timed_out = CommandResult(args=argv, returncode=-9, timed_out=True, timeout=5)
    assert parse_report(timed_out, token, 1).reason.startswith("timeout")


# --------------------------------------------------------------------- arguments


def test_a_cut_output_shows_the_model_where_it_was_cut():
    """The tail (the traceback) reaches the model, with a note where the middle was."""
    err = b"Traceback (most recent call last):\n" + b"." * 400 + b"ZeroDivisionError: division by zero\n"
    r = CommandResult(
        args="python3 s.py", returncode=1, stdout_bytes=b"ok\n", stderr_bytes=err[:200] + err[-100:],
        stderr_truncated=True, stderr_dropped=len(err) - 300 + 5000, output_tail=100,
    )
    text = render_result(r, 10_000)
    note = f"\n... [{len(err) - 300 + 5000} bytes of stderr left out] ...\n"
    assert text == "exit code 1\nok\n[stderr]\n" + err[:200].decode() + note + err[-100:].decode()
    assert text.endswith("ZeroDivisionError: division by zero\n")


def test_factory_validates_and_names_the_function():
    r = code_reward("fraction", timeout=3)
    assert isinstance(r, CodeReward) and r.__name__ == "code_reward_fraction"
    assert code_reward(name="exec_ok").__name__ == "exec_ok"
    assert isinstance(async_code_reward(), AsyncCodeReward)
    assert asyncio.iscoroutinefunction(async_code_reward().__call__)
    assert not asyncio.iscoroutinefunction(code_reward().__call__)
    for bad in ({"mode": "partial"}, {"timeout": 0}, {"timeout": float("nan")},
                {"concurrency": 0}, {"memory_mb": 1}, {"fallback": "all"}, {"test_timeout": -1}):
        with pytest.raises(InvalidArgument):
            code_reward(**bad)


def test_missing_tests_column_says_what_to_do():
    r = code_reward()
    with pytest.raises(InvalidArgument, match="no 'tests' column.*tests_column="):
        r(prompts=["p"], completions=["x"], answer=["y"])
    with pytest.raises(InvalidArgument, match="2 values"):
        r(prompts=["p"], completions=["x"], tests=[[], []])


# --------------------------------------------------------------------- real sandboxes


@requires_root
def test_binary_and_fraction_scores(daemon, caplog):
    completions = [
        fence("def f(x):\n    return 2 * x"),                    # all pass
        fence("def f(x):\n    return x * x"),                    # 2 of 3 (f(2), f(0))
        fence("def f(x):\n    return x + 1"),                    # none
        "I would double it.",                                    # no code
        fence("def f(x) return 2 * x"),                          # syntax error
        fence("def f(x):\n    while True:\n        pass"),       # its test loops
        fence("import os\nos._exit(0)"),                         # exits before any test
        fence(f"def f(x):\n    return 2 * x\nprint('corral-report-{'0' * 32}' + '{{}}')"),
        fence("def f(x):\n    return 2 * x\nprint('y' * 3_000_000)"),  # chatty, still right
    ]
    tests = [TESTS] * len(completions)
    tests[5] = TESTS[:1]  # the looping one: one test, so it costs one test_timeout
    # 8 s a test, 60 the run: the right completions must pass within them on a loaded
    # host too (2 s a test was not always enough); the loop never ends, so it times out.
    fraction = code_reward("fraction", timeout=60, test_timeout=8, url=daemon.url)
    binary = code_reward("binary", timeout=60, test_timeout=8, url=daemon.url)
    with caplog.at_level(logging.INFO, logger="corral.rl.rewards"):
        got = fraction(prompts=["p"] * len(completions), completions=completions, tests=tests)
    assert got == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert binary(prompts=None, completions=completions, tests=tests) == [
        1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    by_index = {o.index: o for o in fraction.last_outcomes}
    assert by_index[3].reason == "no code found in the completion" and by_index[3].code is None
    assert "SyntaxError" in by_index[4].reason
    assert by_index[5].timed_out and "timeout" in by_index[5].reason
    assert "process ended while loading" in by_index[6].reason  # os._exit before any test
    assert any("timeout" in r.getMessage() and "completion 5" in r.getMessage()
               for r in caplog.records), "a timeout is logged with its reason"
    s = fraction.stats
    assert (s.completions, s.sandboxes_created, s.sandboxes_deleted) == (9, 8, 8)
    assert s.no_code == 1 and s.timeouts == 1 and s.infra_failures == 0
    assert len({o.sandbox_id for o in fraction.last_outcomes if o.sandbox_id}) == 8
    with corral.Client(daemon.url) as client:
        assert corral.Sandbox.list(tags=["reward=code_reward_fraction"], client=client) == []


@requires_root
def test_each_completion_gets_a_fresh_sandbox_and_never_sees_the_tests(daemon):
    # Each completion leaves a file behind and fails if it finds one: a reused sandbox
    # would show. It also searches the disk for the tests' secret word.
    code = fence(
        "import os, subprocess\n"
        "assert not os.path.exists('/workspace/left-behind')\n"
        "open('/workspace/left-behind', 'w').write('x')\n"
        "found = subprocess.run(['grep', '-rqs', 'SECRET' + '_WORD', '/workspace', '/tmp'])\n"
        "leaked = found.returncode == 0\n"
    )
    reward = code_reward("binary", timeout=60, concurrency=3, url=daemon.url)
    got = reward(completions=[code] * 6, tests=[["SECRET_WORD = 1\nassert not leaked"]] * 6)
    assert got == [1.0] * 6, [o.reason for o in reward.last_outcomes]
    assert len({o.sandbox_id for o in reward.last_outcomes}) == 6


@requires_root
async def test_async_reward_and_conversational_completions(daemon):
    reward = async_code_reward("fraction", url=daemon.url, concurrency=2)
    completions = [[{"role": "assistant", "content": fence("def f(x):\n    return 2 * x")}],
                   [{"role": "assistant", "content": fence("def f(x):\n    return 4")}]]
    got = await reward(prompts=[[{"role": "user", "content": "f"}]] * 2,
                       completions=completions, tests=[TESTS, TESTS], trainer_state=None)
    assert got == pytest.approx([1.0, 1 / 3])
    # The blocking reward works from inside a running event loop too (a notebook).
    assert code_reward(url=daemon.url)(completions=completions[:1], tests=[TESTS]) == [1.0]


@requires_root
def test_results_arrive_as_they_finish(daemon):
    # The slow one holds until the fast one's result has arrived (a sleep of a few
    # seconds could end first on a loaded host); results kept for the end of the batch
    # never let it go, and it times out.
    seen, fast_seen, done = [], threading.Event(), threading.Event()

    def on_result(outcome):
        seen.append(outcome)
        if outcome.index == 1:
            fast_seen.set()

    def release() -> None:
        released: set[str] = set()
        with corral.Client(daemon.url) as client:
            for _ in range(6000):
                if done.is_set():
                    return
                if fast_seen.is_set():
                    for sb in corral.Sandbox.list(tags=["reward=arrive"], client=client):
                        if sb.id not in released:
                            try:
                                sb.files.write(GO, "go")
                                released.add(sb.id)
                            except corral.CorralError:
                                pass  # the fast one's, deleted with its verdict
                time.sleep(0.1)

    reward = code_reward(url=daemon.url, timeout=60, name="arrive", on_result=on_result)
    slow = fence(f"import os, time\nfor _ in range(6000):\n    if os.path.exists({GO!r}):\n"
                 "        break\n    time.sleep(0.1)\ndef f(x):\n    return 2 * x")
    fast = fence("def f(x):\n    return 2 * x")
    helper = threading.Thread(target=release)
    helper.start()
    try:
        reward(completions=[slow, fast], tests=[TESTS, TESTS])
    finally:
        done.set()
        helper.join()
    assert [o.index for o in seen] == [1, 0]
    assert [o.reward for o in reward.last_outcomes] == [1.0, 1.0]


@requires_root
def test_infrastructure_failures_are_none_never_zero(make_daemon, caplog):
    d = make_daemon("--max-sandboxes", "1", "--queue-size", "0")
    reward = code_reward(url=d.url, name="infra")
    completions = [fence("def f(x):\n    return 2 * x"), "no code at all"]
    with corral.Client(d.url) as client, corral.Sandbox.create(client=client, tags=["hog"]):
        with caplog.at_level(logging.WARNING, logger="corral.rl.rewards"):
            got = reward(completions=completions, tests=[TESTS, TESTS])
    assert got == [None, 0.0]  # no room for a sandbox; the prose needs none
    assert reward.stats.infra_failures == 1
    assert "CapacityExceeded" in reward.last_outcomes[0].reason
    assert any("not evaluated" in r.getMessage() for r in caplog.records)
    assert reward(completions=completions[:1], tests=[TESTS]) == [1.0]  # room again
    d.stop()
    assert reward(completions=completions, tests=[TESTS, TESTS]) == [None, 0.0]  # daemon down
    assert "DaemonUnavailable" in reward.last_outcomes[0].reason


@requires_root
def test_a_missing_image_is_an_error_not_a_score(daemon):
    reward = code_reward(image="no-such-image", url=daemon.url)
    with pytest.raises(ImageNotFound):
        reward(completions=[fence("x = 1")] * 3, tests=[[]] * 3)
    with corral.Client(daemon.url) as client:
        assert corral.Sandbox.list(tags=["reward=code_reward_binary"], client=client) == []
