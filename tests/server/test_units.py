"""Pieces of the server that need no root: settings, UTF-8 chunking, OpenAPI, the guard."""

from __future__ import annotations

import base64
import logging
import tempfile
import types
from pathlib import Path

import httpx
import pytest

import corral.server
from corral.errors import InvalidArgument
from corral.server import ServerSettings, create_app
from corral.server.endpoints import endpoints
from corral.server.settings import host_memory_mb, parse_tcp
from corral.server.streaming import Utf8Chunker

TOKEN = "unit-token"


def test_public_names():
    assert corral.server.__all__ == sorted(corral.server.__all__)
    for name in corral.server.__all__:
        assert getattr(corral.server, name).__doc__


def test_parse_tcp():
    assert parse_tcp("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert parse_tcp("[::1]:0") == ("::1", 0)
    for bad in ("7070", "host:", ":80", "h:99999", "h:x"):
        with pytest.raises(InvalidArgument, match="HOST:PORT"):
            parse_tcp(bad)


def test_settings_defaults_env_and_validation(monkeypatch):
    monkeypatch.setenv("CORRAL_SOCKET", "/tmp/x/corral.sock")
    monkeypatch.setenv("CORRAL_TOKEN", "from-env")
    s = ServerSettings.from_env(max_starting=None, queue_size=3)
    assert s.socket == Path("/tmp/x/corral.sock") and s.token == "from-env"
    assert (s.max_starting, s.queue_size, s.max_sandboxes) == (8, 3, 2000)
    assert s.max_memory_mb == 8 * host_memory_mb() > 0
    assert "from-env" not in repr(s)
    monkeypatch.delenv("CORRAL_TOKEN")
    with pytest.raises(InvalidArgument, match="CORRAL_TOKEN"):
        ServerSettings.from_env(tcp=("127.0.0.1", 1))
    with pytest.raises(InvalidArgument, match="max_starting"):
        ServerSettings(max_starting=0)
    with pytest.raises(InvalidArgument, match="idle_exit"):
        ServerSettings(idle_exit=-1)


def test_utf8_chunker_keeps_characters_whole():
    c = Utf8Chunker()
    euro = "\u20ac".encode()  # 3 bytes
    assert c.feed(b"a" + euro[:1]) == {"data": "a"}
    assert c.feed(euro[1:2]) == {}
    assert c.feed(euro[2:] + b"b") == {"data": "\u20acb"}
    assert c.feed(b"\xff\xfeok") == {"data_b64": base64.b64encode(b"\xff\xfeok").decode()}
    assert c.feed(euro[:2]) == {}
    assert c.flush() == {"data_b64": base64.b64encode(euro[:2]).decode()}
    assert c.flush() == {}


class FakeEngine:
    """Just enough engine for routes that do not touch a sandbox."""

    class cgroups:  # noqa: N801 - mimics the attribute
        version = 2

    def __init__(self, fail: bool = False) -> None:
        import sqlite3

        from corral.runtime.events import Events
        from corral.runtime.ownership import Owners

        self.fail = fail
        self.events = Events()
        self.owners = Owners()  # who sees what (each call names its owner)
        self.registry = types.SimpleNamespace(db=sqlite3.connect(":memory:"))  # tokens
        self.layout = types.SimpleNamespace(state_dir=Path(tempfile.mkdtemp()),  # logs.db
                                            cache_dir=Path("/nonexistent-cache"))
        # a tenant's disk use (tenant_routes), none here
        self.snapshots = types.SimpleNamespace(quota_of=None, usage_bytes=lambda owner: 0)
        self.kept = types.SimpleNamespace(bytes_of=lambda owner: 0)
        self.gpus = types.SimpleNamespace(total=0, free=lambda: [], holding=dict)  # no GPU here

    def list(self, **kwargs):
        if self.fail:
            raise RuntimeError("secret internals")
        return []

    def counts(self, **kwargs):
        return {"running": 0}


def make_client(engine=None) -> httpx.AsyncClient:
    """A client that calls the app in-process, as if over TCP."""
    settings = ServerSettings(token=TOKEN, max_memory_mb=4096)
    app = create_app(settings, engine or FakeEngine())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://corral")


async def test_openapi_lists_every_route():
    client = make_client()
    reply = await client.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    doc = reply.json()
    served = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    app = client._transport.app
    routes = {(m, r.path) for r in app.routes for m in r.methods if m != "HEAD"}
    assert routes == served
    assert len(endpoints()) + 1 == len(served)
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for ref in _refs(op):
                assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"], (path, ref)


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


async def test_requests_not_on_the_unix_socket_need_the_token():
    client = make_client()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        reply = await client.get("/v1/health", headers=headers)
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "unauthorized"
    ok = await client.get("/v1/info", headers={"Authorization": f"bearer {TOKEN}"})
    assert ok.status_code == 200
    assert ok.json()["capacity"]["max_memory_mb"] == 4096
    assert ok.json()["counts"]["running"] == 0


async def test_unexpected_errors_are_logged_never_shown(caplog):
    client = make_client(FakeEngine(fail=True))
    with caplog.at_level(logging.ERROR, logger="corral.server"):
        reply = await client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "internal"
    assert "secret" not in reply.text and "Traceback" not in reply.text
    assert "secret internals" in caplog.text
    # and the app still serves
    health = await client.get("/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert health.status_code == 200
