"""What makes an evaluation cheaper keeps its results: episodes import from the image's
byte-code (a pycache prefix only where the image has none), deletes run while the next
episode starts (none outlives its run), the cache commits without an fsync each, and
evaluations side by side share one live display."""

from __future__ import annotations

import asyncio
import sqlite3

import corral
from corral.rl import EnvSpec, EpisodeProgress, Policy, evaluate, run_episodes
from corral.rl._cache import EpisodeCache
from corral.rl.envs import tictactoe
from corral.rl.episodes import ScriptEpisode
from corral.rl.evaluation import PYCACHE_ENV, _Evaluation
from tests.conftest import requires_root

# Imports a module no byte-code can be written for (the policy turns writing off), as
# an image with read-only site-packages and no __pycache__ would.
UNCACHED_POLICY = '''\
import os, sys
sys.dont_write_bytecode = True
os.makedirs("/tmp/nocache", exist_ok=True)
with open("/tmp/nocache/helper_nocache.py", "w") as f:
    f.write("X = 1\\n")
sys.path.insert(0, "/tmp/nocache")
import helper_nocache
sys.dont_write_bytecode = False
''' + tictactoe.RANDOM_POLICY


async def _runner_env(url: str, code: str) -> dict[str, str]:
    async with corral.AsyncClient(url) as ac:
        ev = _Evaluation(Policy.from_code(code), EnvSpec.coerce("tictactoe"), client=ac,
                         timeout=60, concurrency=1, retries=0, per_sandbox=1, sandbox={})
        try:
            ev._snapshot = await ev._make_snapshot()
            return ev.runner_env
        finally:
            await ev.close()


@requires_root
def test_the_pycache_prefix_only_where_byte_code_is_missing(daemon):
    plain = asyncio.run(_runner_env(daemon.url, tictactoe.RANDOM_POLICY))
    assert "PYTHONPYCACHEPREFIX" not in plain  # the image's own byte-code is used
    uncached = asyncio.run(_runner_env(daemon.url, UNCACHED_POLICY))
    assert uncached["PYTHONPYCACHEPREFIX"] == PYCACHE_ENV["PYTHONPYCACHEPREFIX"]
    with corral.Client(daemon.url) as c:
        r = evaluate(UNCACHED_POLICY, "tictactoe", seeds=range(3), cache=False, client=c)
        same = evaluate(tictactoe.RANDOM_POLICY, "tictactoe", seeds=range(3), cache=False,
                        client=c)
    assert r.n == 3 and [e.digest for e in r.episodes] == [e.digest for e in same.episodes]


@requires_root
def test_background_deletes_end_with_the_run(daemon):
    script = ScriptEpisode("import json, sys\nprint(json.dumps({'reward': int(sys.argv[1])}))\n",
                           timeout=60)
    with corral.Client(daemon.url) as c:
        got = list(run_episodes(script, range(6), sandbox={"memory_mb": 64}, concurrency=2,
                                tags=["bgdelete"], client=c))
        assert sorted(r.reward for r in got) == [0, 1, 2, 3, 4, 5]
        assert len({r.sandbox_id for r in got}) == 6  # still one sandbox per episode
        assert corral.Sandbox.list(tags=["bgdelete"], client=c) == []


def test_cache_commits_without_an_fsync_each(tmp_path):
    cache = EpisodeCache(tmp_path / "c.sqlite")
    assert cache._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    cache.put_many([("k", {"return": 1.0})])
    cache.close()
    db = sqlite3.connect(tmp_path / "c.sqlite")
    assert db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0] == 1


def test_progress_lines_share_one_display():
    first = EpisodeProgress(4, label="a", enabled=False)
    second = EpisodeProgress(4, label="b", enabled=False, below=first)
    second.advance("ok")
    first.advance("error")
    tasks = first._bar.tasks
    assert [t.description for t in tasks] == ["a", "b"] and second._bar is first._bar
    assert [t.completed for t in tasks] == [1, 1] and second.counts == {"ok": 1}
