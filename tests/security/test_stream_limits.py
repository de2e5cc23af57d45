"""Attack 6 of issue 23: one dashboard session opened unlimited live streams (400 of
them took the admin's ``/v1/info`` from 69 ms to 2.65 s). Now live streams are counted
per dashboard session and per tenant (:mod:`corral.server.stream_limits`): past the
limit a stream is refused (429) and what would have fed it is stopped. Real daemon,
real connections; counts are asserted, never times.
"""

from __future__ import annotations

import contextlib
import re
import time

import httpx
import pytest

from tests.conftest import have_root_runtime
from tests.security.edge_daemon import AUTH, HANG_GUARD_S, TOKEN, served

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason="needs root (a real daemon)")

FLOOD = 40
RETRIES = 600  # x 0.1 s
POOL = httpx.Limits(max_connections=FLOOD + 10, max_keepalive_connections=FLOOD + 10)


def _login(browser: httpx.Client) -> None:
    reply = browser.post("/ui/login", data={"token": TOKEN})
    assert reply.status_code == 303, reply.text
    page = browser.get("/ui", headers={"Accept": "text/html"})
    assert re.search(r'name="csrf-token"', page.text), page.text[:300]


def _open(client: httpx.Client, stack: contextlib.ExitStack, path: str, n: int,
          **kwargs) -> list[int]:
    """Open ``n`` streams of ``path`` at once (kept open in ``stack``); their statuses."""
    statuses = []
    for _ in range(n):
        reply = stack.enter_context(client.stream("GET", path, **kwargs))
        statuses.append(reply.status_code)
        if reply.status_code != 200:
            reply.read()
    return statuses


def test_one_dashboard_session_holds_few_live_streams():
    with served("--max-session-streams", "4") as daemon:
        with httpx.Client(base_url=daemon.base, timeout=HANG_GUARD_S, limits=POOL,
                          follow_redirects=False) as browser:
            _login(browser)
            with contextlib.ExitStack() as stack:
                statuses = _open(browser, stack, "/ui/events", FLOOD)
                print("statuses:", statuses)
                assert statuses.count(200) == 4 and statuses.count(429) == FLOOD - 4
                with daemon.client() as admin:  # the admin's own API is not held up by it
                    assert admin.get("/v1/info").status_code == 200
            # the streams ended: their slots are free again (once the daemon saw them go)
            for _ in range(RETRIES):
                with contextlib.ExitStack() as stack:
                    if _open(browser, stack, "/ui/events", 1) == [200]:
                        break
                time.sleep(0.1)
            else:
                raise AssertionError("the session's slots were never given back")


def test_one_tenant_holds_few_followed_logs():
    with served("--max-tenant-streams", "3") as daemon:
        with daemon.client() as admin:
            made = admin.post("/v1/tokens", json={"name": "streamer"})
            assert made.status_code == 201, made.text
            tenant_auth = {"Authorization": f"Bearer {made.json()['token']}"}
            with httpx.Client(base_url=daemon.base, headers=tenant_auth, timeout=HANG_GUARD_S,
                              limits=POOL) as tenant:
                sb = tenant.post("/v1/sandboxes", json={"memory_mb": 64})
                assert sb.status_code == 201, sb.text
                logs = f"/v1/sandboxes/{sb.json()['id']}/logs"
                try:
                    with contextlib.ExitStack() as stack:
                        statuses = _open(tenant, stack, logs, 10, params={"follow": "1"})
                        print("tenant:", statuses)
                        assert statuses.count(200) == 3 and statuses.count(429) == 7
                        # the admin is not counted against any tenant
                        with httpx.Client(base_url=daemon.base, headers=AUTH,
                                          timeout=HANG_GUARD_S, limits=POOL) as own:
                            assert _open(own, stack, logs, 10, params={"follow": "1"}) == [
                                200] * 10
                finally:
                    admin.delete(f"/v1/sandboxes/{sb.json()['id']}")
