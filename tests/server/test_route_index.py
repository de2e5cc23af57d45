"""The daemon's indexed router (``server/route_index.py``) picks, for every route of the
real app (native, front-ends, dashboard, exposed ports), the route Starlette's linear
scan picks, for paths made from each route's own pattern and for near misses; routes
added after the first request are found. No daemon, no root."""

from __future__ import annotations

import re

import pytest
from starlette.routing import Match, Mount, Route, Router

from corral.server import ServerSettings, create_app
from corral.server.route_index import IndexedRouter, literal_prefix, shape
from tests.server.test_units import FakeEngine

_PARAM = re.compile(r"{([^}:]+)(?::([^}]+))?}")


def _app():
    return create_app(ServerSettings(token="t" * 40, max_memory_mb=4096), FakeEngine())


def _fill(path: str, value: str) -> str:
    return _PARAM.sub(lambda m: "a/b" if m[2] == "path" else value, path)


def _paths(routes) -> set[str]:
    """Paths from each route's pattern, and near misses (one segment short or long,
    a trailing slash, a parameter where a literal stood)."""
    out = {"/", "", "/v1", "/v1/", "/nothing/here", "/v1/sandboxes//exec"}
    for route in routes:
        path = getattr(route, "path", None)
        if path is None:
            continue
        if isinstance(route, Mount):
            path += "/x/y"
        for value in ("sb-1", "123", "x.y"):
            concrete = _fill(path, value)
            out |= {concrete, concrete + "/", concrete.rsplit("/", 1)[0], concrete + "/more"}
            parts = concrete.split("/")
            if len(parts) > 2:
                out.add("/".join(parts[:2] + [value] + parts[3:]))
    return out


def _first_full(routes, path: str, method: str):
    scope = {"type": "http", "path": path, "method": method, "root_path": "", "path_params": {}}
    for route in routes:
        if route.matches(scope)[0] is Match.FULL:
            return route
    return None


def test_the_app_uses_it():
    assert isinstance(_app().router, IndexedRouter)


def test_every_path_finds_the_route_a_linear_scan_finds():
    router = _app().router
    routes = list(router.routes)
    paths = _paths(routes)
    assert len(routes) > 50 and len(paths) > 500
    checked = 0
    for path in sorted(paths):
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"):
            want = _first_full(routes, path, method)
            got = _first_full(router.candidates(path), path, method)
            assert got is want, (method, path, getattr(want, "path", None), getattr(got, "path", None))
            checked += want is not None
    assert checked > 200  # most routes were found, not only misses
    # the index narrows: the acquire route is tried among a few, not after ~60 others
    assert len(router.candidates("/v1/pools/p/acquire")) < 10
    # and by the path's shape: exec is not tried after the other sandbox routes
    assert len(router.candidates("/v1/sandboxes/sb-1/exec")) < 4


def test_routes_added_later_are_found():
    async def endpoint(request):  # never called
        raise AssertionError

    router = IndexedRouter([Route("/v1/a/{x}", endpoint)])
    assert router.candidates("/v1/b/c") == []
    late = Route("/v1/b/{x}", endpoint)
    router.routes.append(late)
    assert router.candidates("/v1/b/c") == [late]


@pytest.mark.parametrize("path, prefix", [
    ("/v1/sandboxes/{sandbox_id}/exec", ("v1", "sandboxes")),
    ("/v1/health", ("v1", "health")),
    ("/{token}/run", ()),
    ("/run_code", ("run_code",)),
    ("/", ("",)),
])
def test_literal_prefixes(path, prefix):
    async def endpoint(request):
        raise AssertionError

    assert literal_prefix(Route(path, endpoint)) == prefix
    assert literal_prefix(Mount("", app=Router())) == ()
    assert literal_prefix(Mount("/expose", app=Router())) == ("expose",)


def test_a_route_with_no_literal_prefix_keeps_its_place():
    """A route the index cannot file (a parameter first) is tried wherever it stood:
    here before the literal route that would also match."""
    async def endpoint(request):
        raise AssertionError

    first, literal = Route("/{token}/run", endpoint), Route("/v1/run", endpoint)
    router = IndexedRouter([Route("/v1/other", endpoint), first, literal])
    for path in ("/v1/run", "/x/run", "/v1/other"):
        assert _first_full(router.candidates(path), path, "GET") is _first_full(
            router.routes, path, "GET")
    assert _first_full(router.candidates("/v1/run"), "/v1/run", "GET") is first


def test_shapes():
    """A route's segment count and literal last segment, where its path fixes them."""
    async def endpoint(request):
        raise AssertionError

    assert shape(Route("/v1/sandboxes/{sandbox_id}/exec", endpoint)) == (5, "exec")
    assert shape(Route("/v1/sandboxes/{sandbox_id}", endpoint)) == (4, None)
    assert shape(Route("/v1/sandboxes/{sandbox_id}/files/{path:path}", endpoint)) is None
    assert shape(Mount("/expose", app=Router())) is None
