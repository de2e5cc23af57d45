"""The episode runner deletes each sandbox in the background while its worker starts
the next episode (src/corral/rl/episodes.py): an episode never gets, sees or inherits
the previous episode's sandbox, and no path out of a run leaves one behind."""

from __future__ import annotations

import asyncio

import pytest

import corral
from corral.rl.episodes import EpisodeRunner, run_episodes
from tests.conftest import requires_root

pytestmark = requires_root
SMALL = {"memory_mb": 64}


def test_an_episode_inherits_nothing_from_the_previous_one(daemon):
    """One worker, deletes in the background: each episode leaves a file and a process
    behind and finds neither from the one before."""
    def episode(sb: corral.Sandbox, seed: int) -> dict:
        seen = sb.exec(["sh", "-c", "cat /tmp/mark 2>/dev/null; pgrep -f lurker || true"]).stdout
        sb.exec(["sh", "-c", f"echo {seed} > /tmp/mark; (exec -a lurker sleep 600 &)"])
        return {"reward": 1.0, "seen": seen}

    with corral.Client(daemon.url) as client:
        records = list(run_episodes(episode, range(4), sandbox=SMALL, concurrency=1,
                                    client=client))
        assert all(r.ok for r in records), [r.error for r in records]
        assert [r.value["seen"] for r in records] == [""] * 4
        ids = {r.sandbox_id for r in records}
        assert len(ids) == 4
        assert not ids & {s.id for s in corral.Sandbox.list(client=client)}


async def test_a_worker_cancelled_while_waiting_to_delete_still_deletes(daemon):
    """Every delete place taken (a slow daemon), the run stopped meanwhile: the sandbox
    the worker held is deleted all the same (a pool's is not swept by tag)."""
    async with corral.AsyncClient(daemon.url) as ac:
        runner = EpisodeRunner(lambda sb, seed: 1.0, sandbox=SMALL, concurrency=1, client=ac)
        sb = await corral.AsyncSandbox.create(client=ac, **SMALL)
        runner._delete_slots = asyncio.Semaphore(0)  # every place taken
        waiting = asyncio.ensure_future(runner._release_soon(sb))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await runner._drain()
        assert sb.id not in {s.id for s in await corral.AsyncSandbox.list(client=ac)}


CRASHING_RUNNER = """
import sys, time, corral
from corral.rl.episodes import run_episodes
def episode(sb, seed):
    print(sb.id, flush=True)
    time.sleep(600)
for _ in run_episodes(episode, range(2), sandbox={"memory_mb": 64}, concurrency=2,
                      timeout=20, client=corral.Client(sys.argv[1])):
    pass
"""


def test_a_killed_runner_leaves_sandboxes_of_bounded_lifetime(daemon):
    """A trainer killed (SIGKILL) mid-run deletes nothing: what it left ends by its
    lifetime, the episode's timeout plus the runner's margin, not the default hour."""
    import os
    import subprocess
    import sys

    from corral.rl.episodes import LIFETIME_MARGIN_S

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", CRASHING_RUNNER, daemon.url],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        ids = [child.stdout.readline().strip() for _ in range(2)]
    finally:
        child.kill()
        child.wait()
    assert all(i.startswith("sb-") for i in ids), ids
    with corral.Client(daemon.url) as client:
        try:
            for sid in ids:
                info = corral.Sandbox.connect(sid, client=client).info
                assert info.spec.timeout <= 20 + LIFETIME_MARGIN_S, info.spec.timeout
        finally:
            for sid in ids:
                corral.Sandbox.connect(sid, client=client).delete()
