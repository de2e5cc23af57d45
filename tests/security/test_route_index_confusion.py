"""Attack on the daemon's indexed router (server/route_index.py): a path the index
would route differently from Starlette's linear scan (a tenant's request reaching an
admin or peer route, or another route than the one its guard checked). Near-miss
spellings of the admin, peer, tenant and front-end routes (case, doubled and trailing
slashes, dot segments, encoded separators as uvicorn decodes them, a parameter naming a
literal) each pick the route the linear scan picks, for every method. Kept as a failed
attack: none differed. No daemon, no root."""

from __future__ import annotations

import pytest

from tests.server.test_route_index import _app, _first_full

BASES = [
    "/v1/tenants", "/v1/tenants/t1", "/v1/peer/layers/sha256:00", "/v1/peer/stats", "/metrics",
    "/v1/pools/p/acquire", "/v1/sandboxes/sb-1/exec", "/v1/sandboxes/sb-1/processes/p/consume",
    "/v1/processes/exchange", "/v1/snapshots/s1", "/e2b/sandboxes", "/sandboxfusion/t/run_code",
    "/v1/health", "/", "/v1/run",
]


def _spellings(path: str) -> set[str]:
    parts = path.split("/")
    out = {path, path + "/", "/" + path, path.upper(), path.replace("/v1/", "/v1//"),
           path.replace("/v1/", "/v1/./"), path.replace("/v1/", "/v1/x/../"),
           path.replace("/v1/", "/V1/"), path + "/..", path + "%2F"}
    for i in range(1, len(parts)):  # each segment as another route's literal, or empty
        for value in ("tenants", "peer", "admin", "", "..", "sb-1"):
            out.add("/".join(parts[:i] + [value] + parts[i + 1:]))
    return out


@pytest.fixture(scope="module")
def router():
    return _app().router


@pytest.mark.parametrize("base", BASES)
def test_near_misses_route_as_the_linear_scan_does(router, base):
    routes = list(router.routes)
    for path in sorted(_spellings(base)):
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
            want = _first_full(routes, path, method)
            got = _first_full(router.candidates(path), path, method)
            assert got is want, (method, path, getattr(want, "path", None),
                                 getattr(got, "path", None))
