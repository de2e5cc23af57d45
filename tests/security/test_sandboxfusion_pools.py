"""A hostile stream of SandboxFusion requests, each of a new shape (``memory_limit_MB``
17, 18, ...): the warm pools it makes stay few, and go once idle, with their ready
sandboxes (``CORRAL_FUSION_POOL_IDLE``). Every request is still answered."""

from __future__ import annotations

import time

import pytest

from tests.server.conftest import uds_client
from tests.server.test_compat_sandboxfusion import checked, serving, verl_request

MAX_POOLS = 8  # sandboxfusion_pools.MAX_POOLS


@pytest.fixture(scope="module")
def sf_idle():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_FUSION_POOL_IDLE", "2")
        mp.setenv("CORRAL_FUSION_WARM", "1")
        with serving() as d:
            yield d


def pools_and_pooled(d) -> tuple[list[str], int]:
    with uds_client(d.socket) as c:
        pools = [p["name"] for p in c.get("/v1/pools").json()["pools"]]
        pooled = sum(1 for s in c.get("/v1/sandboxes").json()["sandboxes"]
                     if s["state"] in ("pending", "running")
                     and any(t.startswith("pool=") for t in s["spec"]["tags"]))
    return pools, pooled


def test_distinct_shapes_make_few_pools_and_idle_ones_go(sf_idle):
    with checked(sf_idle) as d:
        most = 0
        for i in range(3 * MAX_POOLS):
            r = verl_request(d, memory_limit_MB=64 + i, stdin="ab")
            assert (r.json().get("run_result") or {}).get("stdout") == "ba\n", r.text
            most = max(most, len(pools_and_pooled(d)[0]))
        assert 1 <= most <= MAX_POOLS
        deadline = time.monotonic() + 120  # idle 2 s; a sweep at least every 0.5 s
        while pools_and_pooled(d) != ([], 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pools_and_pooled(d) == ([], 0)  # no pool, no ready sandbox kept
        # and a shape seen again gets a pool again
        assert verl_request(d, memory_limit_MB=64, stdin="ab").json()["status"] == "Success"
        assert pools_and_pooled(d)[0] == ["sandboxfusion-python-64"]
