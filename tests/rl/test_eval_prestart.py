"""Pre-started episode runners (``evaluate(..., prestart=...)``, corral/rl/_eval_live.py):
the base sandbox is checkpointed live with ``runner.py serve`` at READY and every
episode's sandbox is restored from it. The records are those of fresh runners, and no
state of one episode reaches another (files, environment, processes, modules, the
policy's globals) — while two episodes the API puts in one sandbox
(``episodes_per_sandbox=2``) do find each other's, which shows the check can fail."""

from __future__ import annotations

import asyncio

import pytest

import corral
from corral.rl import EnvSpec, Policy, evaluate
from corral.rl.evaluation import _Evaluation
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root

pytestmark = requires_root

# Raises if an earlier episode left anything where this one can see it, then leaves all
# of it itself. Not in the base's check run (``runner.py check``): what that leaves is
# the evaluation's snapshot, shared by design. Acts from the seeded action space, so
# its trajectories are reproducible by seed.
POLICY = r'''
import os, subprocess, sys, types

MARKS = ("/tmp/corral-mark", "/workspace/corral-mark", os.path.expanduser("~/corral-mark"))
EPISODES = []


def crossed():
    found = [p for p in MARKS if os.path.exists(p)]
    if os.environ.get("CORRAL_MARK"):
        found.append("env")
    if "corral_mark" in sys.modules:
        found.append("module")
    if EPISODES:
        found.append("globals")
    for pid in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as fh:
                if fh.read().startswith(b"sleep\0" + b"4242"):
                    found.append("process")
        except OSError:
            pass
    return found


def leave():
    for p in MARKS:
        try:
            with open(p, "w") as fh:
                fh.write("left")
        except OSError:
            pass
    os.environ["CORRAL_MARK"] = "left"
    sys.modules["corral_mark"] = types.ModuleType("corral_mark")
    subprocess.Popen(["sleep", "4242"], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def act(obs):
    # An episode's first action (the env's step count is 0): look, then leave.
    if sys.argv[1:2] != ["check"] and env.get_wrapper_attr("_elapsed_steps") == 0:
        found = crossed()
        if found:
            raise RuntimeError("state crossed: " + ", ".join(found))
        leave()
        EPISODES.append(1)
    return env.action_space.sample()
'''


@pytest.fixture
def criu_cached():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


async def _prestarted(url: str, seeds: range) -> tuple[_Evaluation, str, list]:
    """The episodes of ``seeds`` through pre-started runners, and the snapshot's kind."""
    async with corral.AsyncClient(url) as ac:
        ev = _Evaluation(Policy.from_code(POLICY), EnvSpec.coerce("CartPole-v1"), client=ac,
                         timeout=60, concurrency=2, retries=0, per_sandbox=1, sandbox={},
                         prestart=True)
        try:
            episodes = [e async for batch, _ in ev.run([(s, 0) for s in seeds]) for e in batch]
            assert ev._snapshot is not None
            return ev, ev._snapshot.info.kind, episodes
        finally:
            await ev.close()


def test_prestarted_runners_give_fresh_runners_records_and_share_nothing(
        daemon, client, criu_cached):
    ev, kind, episodes = asyncio.run(_prestarted(daemon.url, range(3)))
    assert kind == "live" and ev.served is not None  # restored runners, not fresh ones
    assert [e.status for e in episodes] == ["ok"] * 3, [e.error for e in episodes]
    assert len({e.sandbox_id for e in episodes}) == 3
    fresh = evaluate(POLICY, "CartPole-v1", seeds=range(3), cache=False, client=client,
                     prestart=False, concurrency=2)
    by_seed = {e.seed: e.digest for e in episodes}
    assert [by_seed[e.seed] for e in fresh.episodes] == [e.digest for e in fresh.episodes]
    # The control: two episodes in one sandbox (the API's choice) see each other.
    shared = evaluate(POLICY, "CartPole-v1", seeds=range(2), cache=False, client=client,
                      prestart=True, episodes_per_sandbox=2, on_error="zero")
    second = sorted(shared.episodes, key=lambda e: e.seed)[1]
    assert second.status == "error" and "state crossed" in (second.error or ""), second
