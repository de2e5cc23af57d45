"""The episode runner on a real daemon: records as episodes end, retries of
infrastructure failures only (sandboxes really deleted or stopped from outside),
timeouts, sources (image, snapshot, pool), and cleanup."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

import corral
from corral.errors import ImageNotFound, InvalidArgument
from corral.rl.episodes import (
    EpisodeRunner,
    EpisodeStatus,
    ScriptEpisode,
    arun_episodes,
    is_infrastructure_error,
    parse_json_line,
    run_episodes,
)
from tests.conftest import requires_root

SMALL = {"memory_mb": 64}


def _kill_later(sandbox_id: str, url: str, how: str, delay: float = 0.3) -> None:
    """Delete or stop a sandbox from outside (another client), while it runs a command."""

    def kill() -> None:
        time.sleep(delay)
        with corral.Client(url) as other:
            sb = corral.Sandbox.connect(sandbox_id, client=other)
            sb.delete() if how == "delete" else sb.stop()

    threading.Thread(target=kill, daemon=True).start()


def test_classification_and_validation():
    assert is_infrastructure_error(corral.SandboxLost("gone"))
    assert is_infrastructure_error(corral.DaemonUnavailable("down"))
    assert is_infrastructure_error(corral.CapacityExceeded("full"))
    assert not is_infrastructure_error(ValueError("policy"))
    assert not is_infrastructure_error(corral.ExecTimeout("slow"))
    assert parse_json_line('noise\n{"reward": 1}\n{bad\n') == {"reward": 1}
    with pytest.raises(Exception, match="no JSON record"):
        parse_json_line("nothing here")
    with pytest.raises(InvalidArgument, match="one sandbox source"):
        EpisodeRunner(lambda sb, s: 0, image="python", snapshot="snap-x")
    with pytest.raises(InvalidArgument, match="concurrency"):
        EpisodeRunner(lambda sb, s: 0, concurrency=0)
    with pytest.raises(InvalidArgument, match="function"):
        EpisodeRunner("not callable")  # type: ignore[arg-type]


@requires_root
def test_records_arrive_with_fields(client):
    def episode(sb: corral.Sandbox, seed: int) -> dict:
        r = sb.exec(["python3", "-c", f"print({seed} * 10)"], timeout=30)
        return {"reward": float(r.stdout), "steps": seed, "trajectory": [seed, sb.id[:3]]}

    records = list(run_episodes(episode, range(6), image="python", sandbox=SMALL,
                                concurrency=3, client=client))
    assert sorted(r.seed for r in records) == list(range(6))
    assert sorted(r.index for r in records) == list(range(6))
    for r in records:
        assert r.status is EpisodeStatus.OK and r.ok
        assert r.reward == r.seed * 10.0 and r.steps == r.seed
        assert r.attempts == 1 and r.infra_errors == () and r.error is None
        assert r.sandbox_id.startswith("sb-")
        assert r.queue_s >= 0 and r.create_s > 0 and r.run_s > 0 and r.total_s >= r.run_s
        assert len(r.digest) == 16
    assert len({r.sandbox_id for r in records}) == 6, "a sandbox served two episodes"
    # The digest follows the trajectory: same trajectory, same digest.
    assert len({r.digest for r in records}) == 6
    assert records[0].to_dict()["status"] == "ok"


@requires_root
def test_policy_failures_are_results_not_retried(client):
    calls: Counter[int] = Counter()

    def episode(sb: corral.Sandbox, seed: int) -> float:
        calls[seed] += 1
        if seed == 1:
            raise ValueError("the policy blew up")
        if seed == 2:
            sb.exec(["python3", "-c", "import sys; sys.exit(3)"], check=True)
        return 1.0

    records = {r.seed: r for r in run_episodes(episode, range(3), sandbox=SMALL, client=client)}
    assert records[0].status is EpisodeStatus.OK and records[0].reward == 1.0
    assert records[1].status is EpisodeStatus.ERROR and records[1].reward is None
    assert "ValueError: the policy blew up" in records[1].error
    assert records[2].status is EpisodeStatus.ERROR and "CalledProcessError" in records[2].error
    assert all(r.attempts == 1 for r in records.values())
    assert calls == {0: 1, 1: 1, 2: 1}, "a policy failure was retried"


@requires_root
def test_script_episode_results(client):
    script = ScriptEpisode(
        "import json, sys\n"
        "seed = int(sys.argv[1])\n"
        "if seed == 1: raise SystemExit('bad policy')\n"
        "if seed == 2: import time; time.sleep(600)\n"
        "print('log line')\n"
        "print(json.dumps({'reward': seed / 2, 'steps': 7, 'digest': 'd%d' % seed}))\n",
        timeout=10,  # a python3 start alone took over 1.5 s at load 55
    )
    records = {r.seed: r for r in run_episodes(script, [0, 1, 2, 3], sandbox=SMALL, client=client)}
    assert records[0].ok and records[0].reward == 0.0 and records[0].digest == "d0"
    assert records[3].ok and records[3].reward == 1.5 and records[3].steps == 7
    assert records[1].status is EpisodeStatus.ERROR and "bad policy" in records[1].error
    assert records[2].status is EpisodeStatus.TIMEOUT and records[2].attempts == 1


@requires_root
@pytest.mark.parametrize("how", ["delete", "stop"])
def test_sandbox_killed_from_outside_is_retried(client, daemon, how):
    """The first attempt's sandbox is deleted (or stopped) by someone else while the
    episode runs a command: retried on a new sandbox, and recorded with attempts=2."""
    attempts: Counter[int] = Counter()

    def episode(sb: corral.Sandbox, seed: int) -> dict:
        attempts[seed] += 1
        if seed == 0 and attempts[seed] == 1:
            _kill_later(sb.id, daemon.url, how)
            r = sb.exec(["sleep", "30"], timeout=60)  # dies under us (or returns -15)
            if r.returncode != 0:
                raise RuntimeError(f"command killed: {r.returncode}")
        return {"reward": 1.0}

    records = {r.seed: r for r in run_episodes(episode, range(2), sandbox=SMALL, client=client)}
    killed = records[0]
    assert killed.status is EpisodeStatus.OK and killed.reward == 1.0
    assert killed.attempts == 2 and len(killed.infra_errors) == 1
    assert records[1].attempts == 1 and records[1].infra_errors == ()


@requires_root
def test_infrastructure_failure_is_reported_apart(client, daemon):
    """Every attempt loses its sandbox: status infra_error, never a reward of 0."""

    def episode(sb: corral.Sandbox, seed: int) -> float:
        with corral.Client(daemon.url) as other:
            corral.Sandbox.connect(sb.id, client=other).delete()
        sb.exec(["true"])
        return 0.0

    [record] = run_episodes(episode, [5], sandbox=SMALL, retries=1, client=client)
    assert record.status is EpisodeStatus.INFRA_ERROR
    assert record.reward is None and record.attempts == 2 and len(record.infra_errors) == 2
    assert "SandboxNotFound" in record.error or "SandboxLost" in record.error


@requires_root
def test_episode_timeout_deletes_the_sandbox(client):
    def episode(sb: corral.Sandbox, seed: int) -> float:
        sb.exec(["sleep", "60"], timeout=None)
        return 1.0

    [record] = run_episodes(episode, [0], sandbox=SMALL, timeout=1.0, client=client)
    assert record.status is EpisodeStatus.TIMEOUT and record.attempts == 1
    assert "timeout" in record.error and record.reward is None
    # the client fixture checks that the sandbox is gone


@requires_root
def test_configuration_error_raises_at_once(client):
    with pytest.raises(ImageNotFound):
        list(run_episodes(lambda sb, s: 1.0, range(4), image="no-such-image", client=client))


@requires_root
def test_breaking_out_early_cleans_up(client):
    def episode(sb: corral.Sandbox, seed: int) -> float:
        if seed > 0:
            time.sleep(2)
        return 1.0

    it = run_episodes(episode, range(6), sandbox=SMALL, concurrency=3, client=client)
    first = next(it)
    assert first.ok
    it.close()  # stops the run; its sandboxes are deleted before close() returns


@requires_root
async def test_async_episodes_on_a_snapshot(daemon):
    async with corral.AsyncClient(daemon.url) as ac:
        base = await corral.AsyncSandbox.create(image="python", client=ac, **SMALL)
        try:
            await base.files.write("/workspace/env.txt", b"shared")
            snap = await base.snapshot()
        finally:
            await base.delete()
        try:
            async def episode(sb: corral.AsyncSandbox, seed: int) -> dict:
                text = (await sb.files.read("/workspace/env.txt")).decode()
                await sb.files.write("/workspace/env.txt", f"mine {seed}")  # copies never meet
                return {"reward": float(seed), "text": text}

            records = [r async for r in arun_episodes(episode, range(5), snapshot=snap,
                                                      concurrency=5, client=ac)]
        finally:
            await snap.delete()
        assert sorted(r.seed for r in records) == list(range(5))
        assert all(r.ok and r.value["text"] == "shared" for r in records)
        left = await corral.AsyncSandbox.list(state="running", client=ac)
        assert not [sb for sb in left if sb.id in {r.sandbox_id for r in records}]


@requires_root
def test_episodes_from_a_pool(client):
    with corral.Pool(image="python", min_ready=1, max_size=3, client=client, **SMALL) as pool:
        records = list(run_episodes(lambda sb, seed: {"reward": 1.0, "id": sb.id}, range(4),
                                    pool=pool, concurrency=2, client=client))
        assert all(r.ok for r in records) and len({r.sandbox_id for r in records}) == 4
        # acquired sandboxes are deleted after their episode, never handed out again
        deadline = time.monotonic() + 30
        while pool.stats().acquired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.stats().acquired == 0


@requires_root
async def test_async_script_episode_with_progress(daemon, capsys):
    script = ScriptEpisode("import json, sys; print(json.dumps({'reward': int(sys.argv[1])}))")
    async with corral.AsyncClient(daemon.url) as ac:
        records = [r async for r in arun_episodes(script, 3, sandbox=SMALL, client=ac,
                                                  progress=True)]
        await asyncio.sleep(0)
    assert sorted(r.reward for r in records) == [0.0, 1.0, 2.0]
    assert "3/3" in capsys.readouterr().err


@requires_root
async def test_a_failed_delete_is_tried_again_at_the_runs_end(client, monkeypatch):
    """A background delete that fails (here the daemon seems unreachable once per
    sandbox, injected in the SDK) is tried again when the run ends: a pool's sandboxes,
    which no tag sweep finds, go back too. One that keeps failing is tried
    DELETE_TRIES more times and named in ``runner.undeleted``."""
    from corral.errors import DaemonUnavailable
    from corral.rl.episodes import DELETE_TRIES

    real = corral.AsyncSandbox.delete
    tries: Counter[str] = Counter()
    refuse: set[str] = set()  # refused every time

    async def flaky(self, *args, **kwargs):
        tries[self.id] += 1
        if tries[self.id] == 1 or self.id in refuse:
            raise DaemonUnavailable("injected: the daemon did not answer")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(corral.AsyncSandbox, "delete", flaky)
    with corral.Pool(image="python", min_ready=1, max_size=3, client=client, **SMALL) as pool:
        runner = EpisodeRunner(lambda sb, seed: 1.0, pool=pool, concurrency=2, client=client)
        records = [r async for r in runner.run(range(3))]
        assert all(r.ok for r in records)
        assert {r.sandbox_id for r in records} == set(tries) and set(tries.values()) == {2}
        assert runner.undeleted == []
        await runner.aclose()
        deadline = time.monotonic() + 30  # (a bound, never a measure)
        while pool.stats().acquired and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert pool.stats().acquired == 0  # before: 3, held until the pool was closed

        runner = EpisodeRunner(lambda sb, seed: refuse.add(sb.id) or 1.0, pool=pool,
                               client=client)
        (rec,) = [r async for r in runner.run([0])]
        assert runner.undeleted == [rec.sandbox_id]
        assert tries[rec.sandbox_id] == 1 + DELETE_TRIES
        await runner.aclose()
        corral.Sandbox.connect(rec.sandbox_id, client=client).delete()  # (the sync SDK's)
