"""Quota races: a tenant that does at once what the quota checks one at a time.

A tenant's ``max_snapshot_mb`` covers its snapshots and the kept files of its stopped
sandboxes. Stopping several sandboxes at once must not keep them all because each was
checked before any other was counted. Real daemon, real sandboxes."""

from __future__ import annotations

import json
import os
import threading

from tests.security.tenants_helpers import Team, no_traceback, team_daemon
from tests.security.test_host_limits import _sandbox_with, _usage


def _at_once(calls) -> list:
    out: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i, call):
        barrier.wait(30)
        out[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_stopping_many_sandboxes_at_once_keeps_no_more_than_the_quota():
    with team_daemon() as team:
        _stop_race(team)


def _stop_race(team: Team) -> None:
    team.make_token("racer", max_snapshot_mb=2, max_sandboxes=4)
    with team.tenant("racer") as r:
        ids = [_sandbox_with(r, 1500 << 10) for _ in range(4)]  # each fits alone, two do not

        def stop(sid):
            return lambda: r.post(f"/v1/sandboxes/{sid}/stop", json={}).status_code

        assert _at_once([stop(s) for s in ids]) == [200] * 4
        kept = [s for s in ids
                if r.get(f"/v1/sandboxes/{s}/files?path=/workspace/blob").status_code == 200]
        used = _usage(team, "racer")["usage"]
        assert used["kept_mb"] <= 2, used
        assert len(kept) <= 1, kept
        stopped = team.daemon.state_dir / "stopped"
        assert sorted(p.name for p in stopped.iterdir()) == sorted(kept)  # nothing half-kept
    team.cleanup()
    no_traceback(team)


def test_a_build_whose_client_hangs_up_gives_its_places_back():
    """A tenant that starts builds and hangs up mid-step must not keep the host's build
    slots nor its admitted memory: the next build runs."""
    with team_daemon("--max-builds", "1") as team:
        team.make_token("quitter", allow_images=True, max_builds=1, max_memory_mb=512)
        nonce = os.urandom(4).hex()
        body = {"spec": {"base": "python", "memory_mb": 256,
                         "steps": [{"run": f"sleep 60; : {nonce}"}]}, "name": f"q-{nonce}"}
        for round_ in range(3):  # a loop of hang-ups leaks nothing either
            with team.tenant("quitter") as q, q.stream("POST", "/v1/images/build",
                                                      json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():  # until the step runs
                    if line.strip() and json.loads(line).get("type") == "step":
                        break
            for _ in range(300):  # bounded: the daemon notices the hang-up
                with team.admin() as c:
                    info = c.get("/v1/info").json()
                    live = c.get("/v1/sandboxes").json()["sandboxes"]
                if info.get("builds", 0) == 0 and not live \
                        and _usage(team, "quitter")["usage"].get("sandboxes", 0) == 0:
                    break
                threading.Event().wait(0.1)
            assert info.get("builds", 0) == 0, (round_, live, info)
            assert live == [], live
            assert _usage(team, "quitter")["usage"].get("memory_mb", 0) == 0
        no_traceback(team)


def test_snapshots_and_stops_at_once_fit_in_the_quota_together():
    """Two snapshots and two stops of one tenant at once, each alone within its
    max_snapshot_mb, two together over it: at most one is kept, whichever wins."""
    with team_daemon() as team:
        team.make_token("mixer", max_snapshot_mb=2, max_sandboxes=4)
        with team.tenant("mixer") as m:
            for _ in range(3):  # a few rounds: the checks interleave differently
                ids = [_sandbox_with(m, 1500 << 10) for _ in range(4)]
                calls = [lambda s=ids[0]: m.post(f"/v1/sandboxes/{s}/snapshot", json={}),
                         lambda s=ids[1]: m.post(f"/v1/sandboxes/{s}/stop", json={}),
                         lambda s=ids[2]: m.post(f"/v1/sandboxes/{s}/snapshot", json={}),
                         lambda s=ids[3]: m.post(f"/v1/sandboxes/{s}/stop", json={})]
                replies = _at_once(calls)
                assert all(r.status_code in (200, 201, 429) for r in replies), \
                    [r.text for r in replies]
                used = _usage(team, "mixer")["usage"]
                assert used.get("snapshot_mb", 0) + used.get("kept_mb", 0) <= 2, used
                team.cleanup()
        no_traceback(team)
