"""Starlette's router, trying a request against a few candidate routes instead of all.

Starlette tries every route's regex in order until one matches. The daemon has ~100
routes before the front-ends' mounts: ``POST /v1/pools/NAME/acquire`` was the 65th,
and finding it cost ~30 µs on a quiet host, 0.1 ms under load — as much as the rest of
the request's HTTP handling (``benchmarks/bench_rtt.py``, docs/performance.md).

A route can only match a path that starts with its leading literal segments (those
before its first parameter). :class:`IndexedRouter` files each route under its first
two of them, and a request tries, in the routes' original order, only those filed under
its own first two segments, its first one, or none; among those, a route whose path has
a fixed number of segments (no mount, no ``:path`` parameter) is tried only for a
request with as many, and, where its last segment is literal, the same last one
(``POST /v1/sandboxes/ID/exec`` was the 18th of its two segments' routes: now among
three). The first full match among those is the first among all routes, so the same
route serves it; when none matches fully (a wrong method's 405, a slash redirect, a
404), Starlette's own scan decides, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match, Mount, Route, Router, WebSocketRoute, get_route_path
from starlette.types import Receive, Scope, Send

_Key = tuple[str | None, str | None]
_ANY: _Key = (None, None)
_Shape = tuple[int, str | None]  # a path's segment count and last segment (None: any)


def literal_prefix(route: BaseRoute) -> tuple[str, ...]:
    """The route's first (at most two) path segments that hold no parameter; empty for a
    route this cannot tell (a host route, a mount at the root)."""
    if not isinstance(route, (Route, WebSocketRoute, Mount)):
        return ()
    out: list[str] = []
    for segment in route.path.split("/")[1:3]:
        if "{" in segment or (isinstance(route, Mount) and not segment):
            break
        out.append(segment)
    return tuple(out)


def candidates_by_key(routes: Sequence[BaseRoute]) -> dict[_Key, list[BaseRoute]]:
    """For each key a request can have (its first two segments, its first one, or
    neither), the routes it may match, in their original order."""
    filed = [(literal_prefix(route), route) for route in routes]
    keys: set[_Key] = {_ANY}
    for prefix, _ in filed:
        if prefix:
            keys.add((prefix[0], None))
        if len(prefix) == 2:
            keys.add((prefix[0], prefix[1]))

    def fits(prefix: tuple[str, ...], key: _Key) -> bool:
        first, second = key
        if not prefix:
            return True
        if prefix[0] != first:
            return False
        return len(prefix) == 1 or prefix[1] == second

    return {key: [route for prefix, route in filed if fits(prefix, key)] for key in keys}


def shape(route: BaseRoute) -> _Shape | None:
    """The segments a path must have to match ``route``: how many, and its last one
    (None: a parameter, any); None where that is not fixed (a mount, a ``:path``
    parameter, which spans segments, or no path at all)."""
    if not isinstance(route, (Route, WebSocketRoute)) or ":path}" in route.path:
        return None
    parts = route.path.split("/")
    return len(parts), (None if "{" in parts[-1] else parts[-1])


class _Narrowed:
    """One key's candidate routes, narrowed further by a request path's shape."""

    __slots__ = ("routes", "_by_shape", "_unshaped")

    def __init__(self, routes: list[BaseRoute]) -> None:
        self.routes = routes
        shaped = [(shape(route), route) for route in routes]
        keys: set[_Shape] = set()
        for s, _ in shaped:
            if s is not None:
                keys |= {s, (s[0], None)}

        def fits(s: _Shape | None, key: _Shape) -> bool:
            return s is None or (s[0] == key[0] and s[1] in (None, key[1]))

        self._by_shape = {key: [r for s, r in shaped if fits(s, key)] for key in keys}
        self._unshaped = [r for s, r in shaped if s is None]

    def for_path(self, path: str) -> list[BaseRoute]:
        count, last = path.count("/") + 1, path.rpartition("/")[2]
        found = self._by_shape.get((count, last))
        if found is None:
            found = self._by_shape.get((count, None), self._unshaped)
        return found


class IndexedRouter(Router):
    """:class:`starlette.routing.Router`, with the look-up of the module's docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._index: dict[_Key, _Narrowed] = {}
        self._indexed = -1  # routes are added after the app is built: re-filed then

    def candidates(self, path: str) -> list[BaseRoute]:
        """The routes that may match ``path``, in order."""
        if self._indexed != len(self.routes):
            self._index = {key: _Narrowed(routes)
                           for key, routes in candidates_by_key(self.routes).items()}
            self._indexed = len(self.routes)
        parts = path.split("/", 3)
        first = parts[1] if len(parts) > 1 else ""
        second = parts[2] if len(parts) > 2 else None
        index = self._index
        found = index.get((first, second))
        if found is None:
            found = index.get((first, None))
        return (index[_ANY] if found is None else found).for_path(path)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            if "router" not in scope:
                scope["router"] = self
            for route in self.candidates(get_route_path(scope)):
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope["route"] = route
                    scope.update(child_scope)
                    await route.handle(scope, receive, send)
                    return
        await super().app(scope, receive, send)
