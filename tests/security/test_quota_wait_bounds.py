"""Waiting for a quota cannot be turned against the daemon or other tenants (issue 25,
item 5's attack surface): a tenant at its quota that floods creates with a long
``?wait`` parks at most ``--queue-size`` of them; the rest are refused at once, other
tenants create as usual meanwhile, and the parked ones get their places in turn as the
tenant's own sandboxes end."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.security.tenants_helpers import team_daemon


@pytest.fixture(scope="module")
def team():
    with team_daemon("--queue-size", "2", "--queue-timeout", "120") as t:
        yield t


def _done(futures, n: int) -> list:
    deadline = time.monotonic() + 120  # a bound on a hang, not a measurement
    while sum(f.done() for f in futures) < n:
        assert time.monotonic() < deadline, "the refusals never came"
        time.sleep(0.05)
    return [f for f in futures if f.done()]


def test_a_flooding_tenant_parks_at_most_queue_size_creates(team):
    token = team.make_token("flood", max_sandboxes=1)
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=team.url, timeout=150, headers=headers) as c:
        first = c.post("/v1/sandboxes", json={"memory_mb": 32})
        assert first.status_code == 201, first.text

        def create():
            return c.post("/v1/sandboxes", params={"wait": "100"}, json={"memory_mb": 32})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(create) for _ in range(8)]
            refused = [f.result() for f in _done(futures, 6)]
            assert all(r.status_code == 429 for r in refused), [r.text for r in refused]
            assert not any("after waiting" in r.text for r in refused)
            parked = [f for f in futures if not f.done()]
            assert len(parked) == 2
            with team.tenant("bob") as bob:  # another tenant is not held up by the flood
                other = bob.post("/v1/sandboxes", json={"memory_mb": 32})
                assert other.status_code == 201, other.text
                assert bob.delete(f"/v1/sandboxes/{other.json()['id']}").status_code == 204
            holder, made = first.json()["id"], []
            for k in (1, 2):  # each end of its own sandboxes lets one parked create in
                assert c.delete(f"/v1/sandboxes/{holder}").status_code == 204
                new = [f.result() for f in _done(parked, k) if f.result() not in made]
                (reply,) = new
                assert reply.status_code == 201, reply.text
                made.append(reply)
                holder = reply.json()["id"]
            assert c.delete(f"/v1/sandboxes/{holder}").status_code == 204
