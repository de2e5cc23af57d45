"""Clients bound to the shared test daemon; each checks that its test left no sandbox."""

from __future__ import annotations

import pytest

import corral


def _live(client: corral.Client) -> set[str]:
    return {sb.id for sb in corral.Sandbox.list(state=["pending", "running", "paused"], client=client)}


@pytest.fixture
def client(daemon):
    """A blocking client on the test daemon (never the embedded default)."""
    with corral.Client(daemon.url) as c:
        before = _live(c)
        yield c
        leaked = _live(c) - before
        for sid in leaked:
            corral.Sandbox.connect(sid, client=c).delete()
        assert not leaked, f"the test left sandboxes behind: {sorted(leaked)}"


@pytest.fixture
async def aclient(daemon):
    """An asyncio client on the test daemon."""
    async with corral.AsyncClient(daemon.url) as c:
        before = {sb.id for sb in await corral.AsyncSandbox.list(state="running", client=c)}
        yield c
        after = {sb.id for sb in await corral.AsyncSandbox.list(state="running", client=c)}
        leaked = after - before
        for sid in leaked:
            await (await corral.AsyncSandbox.connect(sid, client=c)).delete()
        assert not leaked, f"the test left sandboxes behind: {sorted(leaked)}"


def streamed_connection(client):
    """The connection a streamed call (httpx's pool, as a process's output) used;
    whole replies go on connections of their own (client/_wire.py)."""
    response = client.stream("GET", "/v1/health")
    try:
        response.read()
        return response.extensions["network_stream"]
    finally:
        response.close()


async def astreamed_connection(aclient):
    response = await aclient.stream("GET", "/v1/health")
    try:
        await response.aread()
        return response.extensions["network_stream"]
    finally:
        await response.aclose()
