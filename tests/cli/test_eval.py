"""``corral eval``: a policy file evaluated on a real daemon, its table, JSON, PNG and cache."""

from __future__ import annotations

import json

from corral.rl.envs import tictactoe
from tests.conftest import requires_root

pytestmark = requires_root


def test_eval_json_table_png_and_cache(cli, tmp_path):
    policy = tmp_path / "greedy.py"
    policy.write_text(tictactoe.GREEDY_POLICY)
    cache = tmp_path / "cache.sqlite"
    png = tmp_path / "returns.png"
    args = ["eval", str(policy), "--env", "tictactoe", "--seeds", "0-5", "--cache", str(cache)]

    first = cli(*args, "--json", "--png", str(png))
    data = first.json()
    assert data["summary"]["n"] == 6 and data["infra_failures"] == 0
    # 1 base + 6 episodes + seed 0 once more, to check the policy is deterministic
    assert data["cache_hits"] == 0 and data["sandboxes_created"] == 8
    assert data["deterministic"] is True and data["summary"]["ci_method"] == "bootstrap"
    assert [e["seed"] for e in data["episodes"]] == list(range(6))
    assert data["env"]["id"] == "corral/TicTacToe-v0" and data["policy"] == "greedy.py"
    assert png.read_bytes()[:4] == b"\x89PNG"

    again = cli(*args, "--per-seed")
    assert again.code == 0, again.err
    assert "95% CI" in again.out and "per seed" in again.out
    assert "6 episodes in" in again.out and "(6 from the cache, 0 sandboxes)" in again.out

    opponent = cli(*args, "--env-arg", "opponent=perfect", "--json").json()
    assert opponent["env"]["kwargs"] == {"opponent": "perfect"}
    assert opponent["cache_hits"] == 0 and opponent["summary"]["mean"] <= 0


def test_eval_adaptive(cli, tmp_path):
    policy = tmp_path / "random.py"
    policy.write_text(tictactoe.RANDOM_POLICY)
    r = cli("eval", str(policy), "--env", "tictactoe", "--adaptive", "--target-halfwidth",
            "0.000001", "--budget", "8", "--batch-size", "4", "--no-cache", "--json")
    data = r.json()
    assert data["stop_reason"] == "budget_episodes" and len(data["episodes"]) == 8
    assert data["target_halfwidth"] == 0.000001


def test_eval_errors(cli, cli_process, tmp_path):
    r = cli("eval", str(tmp_path / "missing.py"))
    assert r.code == 1 and "no policy file" in r.err
    r = cli("eval", str(tmp_path / "p.py"), "--adaptive")
    assert r.code == 2 and "--target-halfwidth" in r.err
    r = cli("eval", str(tmp_path / "p.py"), "--budget", "5")
    assert r.code == 2 and "go with --adaptive" in r.err
    broken = tmp_path / "broken.py"
    broken.write_text("def act(obs):\n    return obs.missing\n")
    r = cli_process("eval", str(broken), "--env", "tictactoe", "--seeds", "0-2", "--no-cache")
    assert r.code == 1 and "AttributeError" in r.err and "Traceback" not in r.err
    r = cli_process("eval", str(broken), "--seeds", "9-3", "--no-cache")
    assert r.code == 1 and "ascending range" in r.err


def test_eval_help_lists_options(cli_process):
    r = cli_process("eval", "-h")
    assert r.code == 0
    for option in ("--env", "--seeds", "--episodes-per-seed", "--adaptive", "--target-halfwidth",
                   "--budget", "--png", "--json", "--no-cache", "--on-error", "--ci-method",
                   "--bounds"):
        assert option in r.out


def test_eval_output_is_parseable_json(cli, tmp_path):
    policy = tmp_path / "w.json"
    policy.write_text(json.dumps({"W": [0, 0, 0, 1], "b": 0}))
    r = cli("eval", str(policy), "--env", "CartPole-v1", "--seeds", "0,1", "--no-cache",
            "--episodes-per-sandbox", "2", "--json")
    data = r.json()
    assert data["summary"]["n"] == 2 and data["sandboxes_created"] == 2
    assert all(e["steps"] > 0 and e["digest"] for e in data["episodes"])


def test_eval_policy_failures_fail_the_command_unless_scored(cli, cli_process, tmp_path):
    """Issue 13: a policy crashing in some episodes was averaged over the rest, exit 0."""
    policy = tmp_path / "crashy.py"  # crashes when the opponent answers in the last row
    policy.write_text("def act(obs):\n    if -1 in obs[6:]:\n        raise RuntimeError('bug')\n"
                      "    return obs.index(0)\n")
    args = ["eval", str(policy), "--env", "tictactoe", "--seeds", "0-7", "--no-cache"]
    r = cli(*args)
    assert r.code == 1 and "failed in" in r.err and "--on-error" in r.err
    assert "RuntimeError: bug" in r.err
    excluded = cli(*args, "--on-error", "exclude", "--json")
    assert excluded.code == 0, excluded.err
    data = excluded.json()
    errors = data["errors"]
    assert 0 < errors < 8 and data["summary"]["n"] == 8 - errors
    assert data["on_error"] == "exclude"
    zero = cli(*args, "--on-error", "zero")
    assert zero.code == 0, zero.err
    assert "errors scored" in zero.out and "as 0" in zero.out
    assert f"failed in {errors} of 8 episodes" in zero.out and "n=8 in the mean" in zero.out
    r = cli_process(*args, "--on-error", "sometimes")
    assert r.code == 2 and "expected raise, exclude, zero or a number" in r.err
