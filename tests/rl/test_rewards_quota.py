"""A tenant's quota is waited on, not retried in a tight loop (issue 25, item 5).

At a quota of 2 sandboxes, 16 completions scored at once used to come back with 6
``None`` rewards after 13 instant retries: the daemon refused each create over the
quota at once. Now the SDK names its deadline (``POST /v1/sandboxes?wait=S``) and the
daemon queues the create until one of the tenant's own sandboxes ends.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import corral
from corral.rl import code_reward
from tests.conftest import requires_root
from tests.security.tenants_helpers import team_daemon

TESTS = ["assert f(2) == 4", "assert f(3) == 6"]
GOOD = "Here:\n```python\ndef f(x):\n    return 2 * x\n```\n"


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


@requires_root
def test_code_reward_at_a_quota_of_two_scores_every_completion(team, monkeypatch):
    token = team.make_token("trainer", max_sandboxes=2)
    monkeypatch.setenv("CORRAL_TOKEN", token)
    reward = code_reward(url=team.url, name="quota", concurrency=16, memory_mb=64)
    got = reward(completions=[GOOD] * 16, tests=[TESTS] * 16)
    assert got == [1.0] * 16, [o.reason for o in reward.last_outcomes]
    assert reward.stats.infra_retries == 0 and reward.stats.infra_failures == 0
    assert reward.stats.sandboxes_created == 16


@requires_root
def test_a_create_at_its_quota_waits_for_a_delete_then_gives_up_at_its_deadline(team):
    token = team.make_token("waiter", max_sandboxes=1)
    with corral.Client(team.url, token=token) as client:
        first = corral.Sandbox.create(memory_mb=64, client=client)
        # refused at once when the caller will not wait
        with pytest.raises(corral.QuotaExceeded):
            corral.Sandbox.create(memory_mb=64, client=client, wait=0)
        # waits while the tenant's own sandbox lives, and gets its place once it ends
        got: list[object] = []
        waiter = threading.Thread(
            target=lambda: got.append(corral.Sandbox.create(memory_mb=64, client=client)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and got == []  # still waiting, not refused
        first.delete()
        waiter.join(60)
        (second,) = got
        assert isinstance(second, corral.Sandbox) and second.exec("true").ok
        # the caller's deadline bounds the wait
        with pytest.raises(corral.QuotaExceeded, match=r"after waiting"):
            corral.Sandbox.create(memory_mb=64, client=client, wait=0.3)
        second.delete()


@requires_root
def test_without_a_deadline_a_quota_is_refused_at_once_and_one_above_it_never_waits(team):
    token = team.make_token("raw", max_sandboxes=1, max_memory_mb=128)
    with httpx.Client(base_url=team.url, timeout=60,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        made = c.post("/v1/sandboxes", json={"memory_mb": 64})
        assert made.status_code == 201
        assert c.post("/v1/sandboxes", json={"memory_mb": 64}).status_code == 429  # as before
        # one sandbox above the quota by itself: refused at once even with a long wait
        big = c.post("/v1/sandboxes", params={"wait": "100"}, json={"memory_mb": 256})
        assert big.status_code == 429 and big.json()["error"]["details"]["quota"] == "max_memory_mb"
        assert "after waiting" not in big.json()["error"]["message"]
        bad = c.post("/v1/sandboxes", params={"wait": "-1"}, json={"memory_mb": 64})
        assert bad.status_code == 400 and "wait" in bad.json()["error"]["message"]
        assert c.delete(f"/v1/sandboxes/{made.json()['id']}").status_code == 204
