"""Hibernate and resume through the daemon's admission (red team 13): a hibernated
sandbox leaves the host's caps but stays in its tenant's quota, and its resume waits
for room like a create (``Engine.resume_gate`` -> ``Admission.readmit``).

Attacks, by a tenant with ``max_sandboxes=1``: hibernate its one sandbox to make room
for a second (refused: the sleeper still counts); then its own resume must not be
refused by the place it already holds; a delete of the sleeper frees the place as its
reply comes (a create just after is admitted); a wake storm (many commands at once on
the sleeper, some while the first one's resume runs) answers every command (one that came
while the resume ran was refused 'pending': fixed) and leaves one place taken; another
tenant's command meanwhile is answered not found, as for an unknown id.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

import corral
from corral.errors import QuotaExceeded, SandboxNotFound
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.security.tenants_helpers import no_traceback, team_daemon


@pytest.fixture(scope="module")
def team():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    with team_daemon("--queue-timeout", "1") as t:
        t.make_token("sleepy", max_sandboxes=1)
        yield t
        t.cleanup()
        no_traceback(t)


def test_a_sleeper_keeps_its_place_and_wakes_into_it(team):
    with corral.Client(team.url, token=team.tokens["sleepy"]) as sleepy:
        sb = corral.Sandbox.create(network="none", checkpointable=True, memory_mb=64,
                                   client=sleepy)
        sb.exec(["sh", "-c", "echo 41 > /tmp/n"])
        sb.hibernate()
        with pytest.raises(QuotaExceeded):  # the sleeper still counts
            corral.Sandbox.create(memory_mb=64, client=sleepy)
        # a wake storm, commands sent a little apart (some while the first one's resume
        # is under way): each is answered; the one place taken is the one it held
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = []
            def read() -> str:
                return sb.exec(["cat", "/tmp/n"]).stdout

            def resume() -> str:  # an explicit resume among the commands
                return "41\n" if sb.resume().state.value == "running" else "not running"

            for i in range(8):
                futures.append(pool.submit(resume if i % 3 == 1 else read))
                time.sleep(0.03)
            with corral.Client(team.url, token=team.tokens["bob"]) as bob:
                with pytest.raises(SandboxNotFound):  # another's: not found, not woken
                    corral.Sandbox.connect(sb.id, client=bob).exec(["true"])
            outs = [f.result() for f in futures]
        assert outs == ["41\n"] * 8
        with pytest.raises(QuotaExceeded):  # awake: still one, and only one
            corral.Sandbox.create(memory_mb=64, client=sleepy)
        sb.hibernate()
        sb.delete()
        other = corral.Sandbox.create(memory_mb=64, client=sleepy)  # the place is free
        assert other.exec(["true"]).returncode == 0
        other.delete()


def test_a_sandbox_being_resumed_is_never_missing_from_its_owners_view(team):
    """While a command's wake resumes it, the owner's GET and listing still find it
    (its row is written again by the resume's create: in between it was missing, and a
    client polling its state took it for deleted)."""
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(network="none", checkpointable=True, memory_mb=64,
                                   client=alice)
        try:
            for _ in range(2):
                sb.hibernate()
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    woken = pool.submit(lambda: sb.exec(["true"]).returncode)
                    seen = []
                    with team.tenant("alice") as http:
                        while not woken.done():
                            seen.append(http.get(f"/v1/sandboxes/{sb.id}").status_code)
                            listed = http.get("/v1/sandboxes").json()["sandboxes"]
                            seen.append(200 if sb.id in [s["id"] for s in listed] else 404)
                    assert woken.result() == 0
                assert set(seen) <= {200}, seen
        finally:
            sb.delete()
