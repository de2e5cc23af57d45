"""Policy evaluation on a real daemon (CartPole-v1 in the ``rl`` image, tic-tac-toe in
``python``), checked against the same episodes run in this process; plus the
statistics and the tic-tac-toe env on their own."""

from __future__ import annotations

import json
import math
import random

import pytest

import corral
from corral.errors import InvalidArgument
from corral.rl import EnvSpec, EpisodeErrors, Policy, evaluate, parse_seeds
from corral.rl._eval_result import error_scoring
from corral.rl.envs import tictactoe
from corral.rl.envs.tictactoe import TicTacToeEnv, greedy_move, perfect_move
from corral.rl.stats import paired_difference, summarize, t_cdf, t_quantile
from tests.conftest import requires_root

OMEGA = "def act(obs):\n    return int(obs[3] > 0)\n"  # push the way the pole turns


@pytest.fixture
def client(daemon):
    """A client on the test daemon; fails the test if it leaves sandboxes or snapshots."""
    with corral.Client(daemon.url) as c:
        sandboxes = {sb.id for sb in corral.Sandbox.list(client=c)}
        snapshots = {s.id for s in corral.Snapshot.list(client=c)}
        yield c
        leaked = [sb.id for sb in corral.Sandbox.list(client=c) if sb.id not in sandboxes]
        leaked_snaps = [s.id for s in corral.Snapshot.list(client=c) if s.id not in snapshots]
        for sid in leaked:
            corral.Sandbox.connect(sid, client=c).delete()
        assert not leaked and not leaked_snaps, f"left behind: {leaked} {leaked_snaps}"


def cartpole_in_process(seeds) -> dict[int, tuple[float, int]]:
    gym = pytest.importorskip("gymnasium")
    env = gym.make("CartPole-v1")
    out = {}
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        total, steps, done = 0.0, 0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(int(obs[3] > 0))
            total, steps, done = total + reward, steps + 1, terminated or truncated
        out[seed] = (total, steps)
    return out


# ------------------------------------------------------------ no sandboxes


def test_t_quantile_matches_tables():
    for df, want in ((1, 12.7062047), (2, 4.30265273), (5, 2.57058184), (10, 2.22813885),
                     (29, 2.04522964), (100, 1.98397152), (10**7, 1.95996422)):
        assert t_quantile(0.975, df) == pytest.approx(want, rel=1e-7)
    assert t_quantile(0.995, 3) == pytest.approx(5.84090931, rel=1e-7)
    assert t_quantile(0.025, 10) == pytest.approx(-2.22813885, rel=1e-7)
    assert t_cdf(0.0, 7) == pytest.approx(0.5)
    with pytest.raises(InvalidArgument):
        t_quantile(1.0, 3)


def test_summaries():
    s = summarize([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert s.n == 8 and s.mean == 5.0 and s.std == pytest.approx(2.13808994)
    assert s.stderr == pytest.approx(s.std / math.sqrt(8))
    assert s.halfwidth == pytest.approx(t_quantile(0.975, 7) * s.stderr)
    assert s.ci_low < s.mean < s.ci_high and (s.minimum, s.maximum) == (2.0, 9.0)
    assert summarize([3.0]).halfwidth == math.inf and math.isnan(summarize([]).mean)
    # Paired: a constant difference has no spread at all.
    a, b = {i: float(i) + 1 for i in range(5)}, {i: float(i) for i in range(6)}
    d = paired_difference(a, b)
    assert d.n == 5 and d.mean == 1.0 and d.halfwidth == 0.0
    with pytest.raises(InvalidArgument):
        summarize([1.0, 2.0], confidence=1.5)


def test_bootstrap_interval_stays_in_the_range_and_is_seeded():
    # CartPole-like returns piled up at the 500 cap: the symmetric t interval passes it.
    values = [500.0] * 17 + [412.0, 455.0, 389.0]
    t = summarize(values)
    assert t.method == "t" and t.ci_high > 500
    clamped = summarize(values, bounds=(0, 500))
    assert (clamped.ci_low, clamped.ci_high) == (t.ci_low, 500.0)
    b = summarize(values, method="bootstrap")
    assert b.method == "bootstrap" and min(values) <= b.ci_low < b.mean < b.ci_high <= 500
    assert summarize(values[::-1], method="bootstrap") == b  # seeded, order-blind
    assert b.to_dict()["ci_method"] == "bootstrap"
    same = summarize([7.0] * 5, method="bootstrap")
    assert (same.ci_low, same.ci_high) == (7.0, 7.0)
    one = summarize([3.0], bounds=(0, 10))  # one value: the interval is the whole range
    assert (one.ci_low, one.ci_high) == (0.0, 10.0)
    # Coverage on a skewed, bounded distribution (true mean 460): near the nominal 95%.
    rng = random.Random(7)
    hits = 0
    for _ in range(200):
        xs = [500.0 if rng.random() < 0.8 else rng.uniform(100, 500) for _ in range(30)]
        s = summarize(xs, method="bootstrap", resamples=2000)
        hits += s.ci_low <= 460.0 <= s.ci_high and s.ci_high <= 500
    assert 0.88 <= hits / 200 <= 0.99, hits
    with pytest.raises(InvalidArgument, match="ci_method"):
        summarize(values, method="bca")
    with pytest.raises(InvalidArgument, match="bounds"):
        summarize(values, bounds=(5, 1))


def test_error_scoring_and_known_return_bounds():
    assert error_scoring("raise") == ("raise", None)
    assert error_scoring("exclude") == ("exclude", None)
    assert error_scoring("zero") == error_scoring(0) == ("zero", 0.0)
    assert error_scoring(-1) == ("score", -1.0)
    assert error_scoring("raise", error_return=-2.0) == ("score", -2.0)  # the older spelling
    for bad in ("ignore", float("nan"), True):
        with pytest.raises(InvalidArgument, match="on_error"):
            error_scoring(bad)
    with pytest.raises(InvalidArgument, match="not both"):
        error_scoring("exclude", error_return=1.0)
    assert EnvSpec.coerce("CartPole-v1").return_bounds == (0.0, 500.0)
    assert EnvSpec.coerce("CartPole-v1", max_steps=50).return_bounds == (0.0, 50.0)
    assert EnvSpec.coerce("CartPole-v1", kwargs={"max_episode_steps": 900}).return_bounds is None
    assert EnvSpec.coerce("MountainCar-v0").return_bounds == (-200.0, 0.0)
    assert EnvSpec.coerce("tictactoe").return_bounds == (-1.0, 1.0)
    assert EnvSpec.coerce("tictactoe", kwargs={"illegal_move_reward": -5}).return_bounds == (-5.0, 1.0)
    assert EnvSpec.coerce("Pendulum-v1").return_bounds is None


def test_tictactoe_env():
    env = TicTacToeEnv("greedy")
    obs, info = env.reset(seed=3)
    assert obs == [0] * 9 and info["legal_actions"] == list(range(9))
    obs, reward, terminated, truncated, info = env.step(0)
    assert obs.count(1) == 1 and obs.count(-1) == 1 and reward == 0 and not terminated
    occupied = obs.index(-1)
    obs, reward, terminated, _, info = env.step(occupied)  # illegal: an occupied cell
    assert terminated and reward == -1.0 and info["illegal"]
    with pytest.raises(RuntimeError):
        env.step(1)
    with pytest.raises(ValueError, match="unknown opponent"):
        TicTacToeEnv("clever")

    def play(opponent: str, seed: int, move) -> list:
        env, rng = TicTacToeEnv(opponent), random.Random(seed)
        obs, _ = env.reset(seed=seed)
        trace, done = [], False
        while not done:
            obs, reward, done, _, _ = env.step(move(obs, 1, rng))
            trace.append((tuple(obs), reward))
        return trace

    assert play("random", 5, greedy_move) == play("random", 5, greedy_move)  # seeded
    assert all(play("perfect", s, perfect_move)[-1][1] == 0.0 for s in range(5))  # draws
    env = TicTacToeEnv("random", agent_first=False)
    obs, _ = env.reset(seed=1)
    assert obs.count(-1) == 1 and obs.count(1) == 0
    assert env.render().count(".") == 8


def test_bad_input_is_refused_before_any_sandbox():
    with pytest.raises(InvalidArgument, match="not valid Python"):
        evaluate("def act(obs):\n  return (", "CartPole-v1")
    with pytest.raises(InvalidArgument, match="neither act"):
        evaluate("def policy(obs):\n    return 0\n", "CartPole-v1")
    with pytest.raises(InvalidArgument, match="no policy file"):
        evaluate("missing_policy.py", "CartPole-v1")
    with pytest.raises(InvalidArgument, match="seeds must be integers"):
        evaluate(OMEGA, "CartPole-v1", seeds=[1, -2], cache=False)
    with pytest.raises(InvalidArgument, match="target_halfwidth"):
        evaluate(OMEGA, "CartPole-v1", adaptive=True)
    with pytest.raises(InvalidArgument, match="concurrency"):
        evaluate(OMEGA, "CartPole-v1", concurrency=0)
    with pytest.raises(InvalidArgument, match="on_error"):
        evaluate(OMEGA, "CartPole-v1", on_error="ignore")
    with pytest.raises(InvalidArgument, match="ci_method"):
        evaluate(OMEGA, "CartPole-v1", ci_method="normal")
    with pytest.raises(InvalidArgument, match="file name"):
        Policy.from_code(OMEGA, files={"../x": b""})
    with pytest.raises(InvalidArgument, match="2 dimensions"):
        Policy.from_weights([[[1.0]]])
    assert parse_seeds("0-3,10") == [0, 1, 2, 3, 10]
    with pytest.raises(InvalidArgument):
        parse_seeds("5-1")


def test_policy_hash_follows_content(tmp_path):
    a = Policy.from_code(OMEGA)
    assert a.hash == Policy.from_code(OMEGA, label="other name").hash
    assert a.hash != Policy.from_code(OMEGA + "# changed\n").hash
    assert a.hash != Policy.from_code(OMEGA, files={"q.json": b"{}"}).hash
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"W": [0, 0, 0, 1], "b": 0}))
    assert Policy.coerce(str(path)).kind == "linear"


# ---------------------------------------------------------------- sandboxes


@requires_root
def test_cartpole_matches_in_process_and_is_cached(client, tmp_path):
    cache = tmp_path / "cache.sqlite"
    want = cartpole_in_process(range(8))
    first = evaluate(OMEGA, "CartPole-v1", seeds=range(6), cache=cache, concurrency=3,
                     client=client)
    assert first.stop_reason == "complete" and first.counts == {"ok": 6}
    assert {e.seed: (e.episode_return, e.steps) for e in first.episodes} == {
        s: want[s] for s in range(6)}
    # 1 base + 1 per episode + 1 re-running seed 0, which found the policy deterministic
    assert first.sandboxes_created == 8 and first.cache_hits == 0 and first.deterministic
    values = [want[s][0] for s in range(6)]
    assert first.mean == pytest.approx(sum(values) / 6)
    assert first.ci_method == "bootstrap"  # CartPole's returns lie in [0, 500]
    assert min(values) <= first.ci[0] < first.mean < first.ci[1] <= max(values)
    assert len({e.sandbox_id for e in first.episodes}) == 6

    snapshots = {s.id for s in corral.Snapshot.list(client=client)}
    again = evaluate(OMEGA, "CartPole-v1", seeds=range(6), cache=cache, client=client)
    assert again.cache_hits == 6 and again.sandboxes_created == 0
    assert {s.id for s in corral.Snapshot.list(client=client)} == snapshots  # no base made
    assert [e.digest for e in again.episodes] == [e.digest for e in first.episodes]
    assert again.summary == first.summary and all(e.cached for e in again.episodes)

    more = evaluate(OMEGA, "CartPole-v1", seeds=range(8), cache=cache, client=client)
    assert more.cache_hits == 6 and more.sandboxes_created == 3  # base + the 2 new seeds
    assert more.returns()[(7, 0)] == want[7][0]
    changed = evaluate(OMEGA + "# one more byte\n", "CartPole-v1", seeds=[0], cache=cache,
                       client=client)
    assert changed.cache_hits == 0 and changed.sandboxes_created == 3  # checked again


@requires_root
def test_weights_files(client, tmp_path):
    """.npy, .json and .pt weights give the code policy's returns (one linear rule)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    want = cartpole_in_process(range(3))
    np.save(tmp_path / "w.npy", np.array([0.0, 0.0, 0.0, 1.0]))
    (tmp_path / "w.json").write_text(json.dumps({"W": [0, 0, 0, 1], "b": 0}))
    torch.save({"weight": torch.tensor([[0.0, 0, 0, -1], [0.0, 0, 0, 1]]),
                "bias": torch.zeros(2)}, tmp_path / "w.pt")
    for name in ("w.npy", "w.json", "w.pt"):
        r = evaluate(str(tmp_path / name), "CartPole-v1", seeds=range(3), cache=False,
                     episodes_per_sandbox=3, client=client)
        assert r.policy == name and r.sandboxes_created == 2
        assert {e.seed: (e.episode_return, e.steps) for e in r.episodes} == want, name
    (tmp_path / "bad.json").write_text("[1.0, 2.0, 3.0]")  # CartPole has 4 observations
    with pytest.raises(InvalidArgument, match="cannot run on CartPole-v1"):
        evaluate(str(tmp_path / "bad.json"), "CartPole-v1", seeds=[0], cache=False, client=client)


@requires_root
def test_tictactoe_random_vs_greedy(client, tmp_path):
    common = dict(seeds=range(12), cache=False, concurrency=6, client=client)
    rnd = evaluate(tictactoe.RANDOM_POLICY, "tictactoe", label="random", **common)
    greedy = evaluate(tictactoe.GREEDY_POLICY, "tictactoe", label="greedy", **common)
    assert rnd.n == greedy.n == 12 and greedy.mean > rnd.mean
    assert greedy.compare(rnd).mean > 0
    assert all(e.terminated and e.steps <= 5 for e in greedy.episodes)
    assert [row.seed for row in greedy.per_seed()] == list(range(12))
    json.dumps(greedy.to_dict())
    path = greedy.save_png(tmp_path / "returns.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    vs_perfect = evaluate(tictactoe.GREEDY_POLICY, "tictactoe", env_kwargs={"opponent": "perfect"},
                          **common)
    assert vs_perfect.mean <= 0  # nobody beats minimax


@requires_root
def test_policy_errors_and_timeouts_are_counted_apart(client):
    # Raises at the 3rd step in about half the episodes (random is seeded per episode).
    flaky = ("import random\nsteps = 0\n"
             "def act(obs):\n    global steps\n    steps += 1\n"
             "    if steps == 3 and random.random() < 0.5:\n        raise RuntimeError('bug')\n"
             "    return int(obs[3] > 0)\n")
    # By default no mean at all: leaving the failures out would inflate it.
    with pytest.raises(EpisodeErrors, match=r"failed in \d of 8 episodes .*RuntimeError: bug"
                       ) as caught:
        evaluate(flaky, "CartPole-v1", seeds=range(8), cache=False, client=client)
    errors = caught.value.details["errors"]
    assert 0 < errors < 8 and caught.value.details["timeouts"] == 0
    assert len(caught.value.episodes) == 8
    r = evaluate(flaky, "CartPole-v1", seeds=range(8), cache=False, on_error="exclude",
                 client=client)
    assert r.errors == errors and r.n == 8 - r.errors and r.infra_failures == 0
    assert r.on_error == "exclude" and r.errors_scored == "excluded"
    failed = [e for e in r.episodes if not e.ok]
    assert all("RuntimeError: bug" in e.error and e.episode_return is None for e in failed)
    scored = evaluate(flaky, "CartPole-v1", seeds=range(8), cache=False, on_error="zero",
                      client=client)
    assert scored.n == 8 and scored.mean < r.mean and scored.errors == errors
    assert scored.mean == pytest.approx(sum(r.returns().values()) / 8)
    assert scored.to_dict()["on_error"] == "zero" and scored.errors_scored == "as 0"
    minus = evaluate(flaky, "CartPole-v1", seeds=range(8), cache=False, on_error=-10,
                     client=client)
    assert minus.mean == pytest.approx((sum(r.returns().values()) - 10 * errors) / 8)

    # Hangs whenever the opponent's first mark is in cell 8 (never in the check run).
    hang = ("import time\n"
            "def act(obs):\n    if obs[8] == -1:\n        time.sleep(3600)\n"
            "    return obs.index(0)\n")

    def hangs(seed: int) -> bool:
        env = TicTacToeEnv("random")
        obs, _ = env.reset(seed=seed)
        obs, *_ = env.step(0)
        return obs[8] == -1

    ok_seed = next(s for s in range(100) if not hangs(s))
    hang_seed = next(s for s in range(ok_seed + 1, 200) if hangs(s))
    # 6 s an episode: the first must end within it (1.5 s was tight under load)
    r = evaluate(hang, "tictactoe", seeds=[ok_seed, hang_seed], timeout=6, cache=False,
                 episodes_per_sandbox=2, on_error="exclude", client=client)
    by_seed = {e.seed: e for e in r.episodes}
    assert by_seed[ok_seed].ok, "the record before the timeout was kept"
    assert by_seed[hang_seed].status == "timeout" and r.timeouts == 1
    assert r.sandboxes_created == 2


@requires_root
def test_adaptive_stops_at_target_or_budget(client):
    common = dict(cache=False, concurrency=4, client=client)
    done = evaluate(tictactoe.GREEDY_POLICY, "tictactoe", adaptive=True, target_halfwidth=0.5,
                    batch_size=10, **common)
    assert done.stop_reason == "target" and done.halfwidth <= 0.5 and len(done.episodes) == 10
    assert [e.seed for e in done.episodes] == list(range(10))  # seeds in order
    budget = evaluate(tictactoe.RANDOM_POLICY, "tictactoe", adaptive=True,
                      target_halfwidth=1e-6, budget_episodes=16, batch_size=8, **common)
    assert budget.stop_reason == "budget_episodes" and len(budget.episodes) == 16
    timed = evaluate(tictactoe.RANDOM_POLICY, "tictactoe", adaptive=True, target_halfwidth=1e-6,
                     budget_seconds=1e-3, batch_size=4, **common)
    assert timed.stop_reason == "budget_seconds" and len(timed.episodes) == 4
    short = evaluate(tictactoe.RANDOM_POLICY, "tictactoe", adaptive=True, target_halfwidth=1e-6,
                     seeds=range(6), batch_size=4, **common)
    assert short.stop_reason == "seeds_exhausted" and len(short.episodes) == 6


@requires_root
def test_a_policy_that_fails_to_load_runs_nothing(client):
    with pytest.raises(InvalidArgument, match=r"ZeroDivisionError.*policy.py:2"):
        evaluate("def act(obs):\n    return 1 / 0\n", "CartPole-v1", cache=False, client=client)
    with pytest.raises(InvalidArgument, match="NoSuchEnv"):
        evaluate(OMEGA, "NoSuchEnv-v0", cache=False, client=client)
    with pytest.raises(corral.ImageNotFound):
        evaluate(OMEGA, "CartPole-v1", image="no-such-image", cache=False, client=client)


README_POLICY = "def act(obs):\n    return int(obs[2] + obs[3] > 0)\n"


@requires_root
def test_cartpole_interval_stays_below_the_cap(client):
    """Issue 13: mean 494.5 with a t interval up to 505.8, past the 500 maximum."""
    r = evaluate(README_POLICY, "CartPole-v1", seeds=range(20), concurrency=8, cache=False,
                 client=client)
    values = list(r.returns().values())
    assert r.ci_method == "bootstrap" and r.summary.bounds == (0.0, 500.0)
    assert max(values) == 500 and min(values) <= r.ci[0] <= r.mean <= r.ci[1] <= 500
    assert summarize(values).ci_high > 500  # what the t interval would have said
    assert r.to_dict()["summary"]["ci_method"] == "bootstrap"
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(r.table())
    text = console.export_text()
    assert "95% CI (bootstrap)" in text
    t = evaluate(README_POLICY, "CartPole-v1", seeds=range(20), cache=False, ci_method="t",
                 bounds=(0, 500), client=client)
    assert t.ci_method == "t" and t.mean == r.mean and t.ci[1] == 500.0  # clamped


@requires_root
def test_cache_serves_only_a_deterministic_policy(client, tmp_path):
    """Issue 13: a policy drawing os.urandom had its first result served forever."""
    cache = tmp_path / "cache.sqlite"
    urandom = "import os\ndef act(obs):\n    return os.urandom(1)[0] % 2\n"
    first = evaluate(urandom, "CartPole-v1", seeds=range(3), cache=cache, client=client)
    assert first.deterministic is False
    assert first.sandboxes_created == 5  # base + 3 episodes + seed 0 again
    again = evaluate(urandom, "CartPole-v1", seeds=range(3), cache=cache, client=client)
    assert again.cache_hits == 0 and again.deterministic is False
    assert again.sandboxes_created == 4  # known: no second check, and nothing cached
    assert [e.digest for e in again.episodes] != [e.digest for e in first.episodes]
    # The runner seeds `random` per episode: such a policy is deterministic, and cached.
    seeded = "import random\ndef act(obs):\n    return random.randrange(2)\n"
    first = evaluate(seeded, "CartPole-v1", seeds=range(3), cache=cache, client=client)
    assert first.deterministic is True and first.sandboxes_created == 5
    again = evaluate(seeded, "CartPole-v1", seeds=range(3), cache=cache, client=client)
    assert again.cache_hits == 3 and again.sandboxes_created == 0 and again.deterministic
    assert again.summary == first.summary
