"""Streamed downloads against a sandbox that changes the file while it is read.

Downloads stream from the sandbox a chunk at a time (server/wire.py ``file_response``),
so sandbox code may change the file meanwhile. It must not make the daemon send more
than the size it announced (a file that grows forever would otherwise stream forever),
nor pass a file cut short for a whole one: a file that shrinks cuts the connection
short of its Content-Length, which the client reports as an error.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import requires_root
from tests.server.conftest import client  # noqa: F401  (a fixture: the session's daemon)

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

MB = 1 << 20


@pytest.fixture
def sid(client):  # noqa: F811
    reply = client.post("/v1/sandboxes", json={"memory_mb": 256, "tags": ["test-server"]})
    assert reply.status_code == 201, reply.text
    yield reply.json()["id"]
    client.delete(f"/v1/sandboxes/{reply.json()['id']}")


def _exec(http, sid: str, cmd: str) -> None:
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sh", "-c", cmd], "timeout": 60})
    assert r.status_code == 200 and r.json()["returncode"] == 0, r.text


def test_a_growing_file_is_sent_at_its_announced_size(client, sid):  # noqa: F811
    _exec(client, sid, "head -c 8388608 /dev/zero > /tmp/grow; "
          "(while :; do head -c 1048576 /dev/zero >> /tmp/grow; done) >/dev/null 2>&1 &")
    with client.stream("GET", f"/v1/sandboxes/{sid}/files",
                       params={"path": "/tmp/grow"}) as reply:
        assert reply.status_code == 200
        announced = int(reply.headers["content-length"])
        got = sum(len(c) for c in reply.iter_bytes())
    assert got == announced and announced >= 8 * MB


def test_a_file_cut_short_while_read_is_not_taken_for_whole(client, sid):  # noqa: F811
    _exec(client, sid, "head -c 33554432 /dev/zero > /tmp/shrink")
    with client.stream("GET", f"/v1/sandboxes/{sid}/files",
                       params={"path": "/tmp/shrink"}) as reply:
        assert reply.status_code == 200
        announced = int(reply.headers["content-length"])
        chunks = reply.iter_raw()
        got = len(next(chunks))
        _exec(client, sid, ": > /tmp/shrink")  # truncated under the reader
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in chunks:
                got += len(chunk)
    assert announced == 32 * MB and got < announced
