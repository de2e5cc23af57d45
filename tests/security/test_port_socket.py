"""The port socket (``/v1/sandboxes/{id}/ports/{port}/socket``, server/port_socket.py):
a WebSocket to a port of one's own sandbox, through the same door as every request.

Attacks: another tenant's token (and no token, and a wrong one) opens nothing, and is
refused exactly as for an id that does not exist; a tenant cannot hold more of them
than its live streams allow; a revoked token's open socket is closed. A real daemon on
TCP, two tenants, a line echo server in alice's sandbox, the real ``websockets`` client.
"""

from __future__ import annotations

import time

import pytest

import corral
from tests.security.tenants_helpers import UNKNOWN, team_daemon

websockets = pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

PORT = 8000  # inside the sandbox's own network namespace
ECHO = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('127.0.0.1', {PORT})); s.listen(8)\n"
    "import threading\n"
    "def echo(c):\n"
    "    while d := c.recv(65536):\n"
    "        c.sendall(d)\n"
    "while True:\n"
    "    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()\n"
)


@pytest.fixture(scope="module")
def team():
    with team_daemon("--max-tenant-streams", "2") as t:
        t.make_token("carol")
        with corral.Client(t.url, token=t.tokens["alice"]) as client:
            sb = corral.Sandbox.create(memory_mb=64, client=client)
            proc = sb.spawn(["python3", "-c", ECHO])
            deadline = time.monotonic() + 30
            while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
                assert time.monotonic() < deadline, "the echo server did not listen"
                time.sleep(0.1)
            t.sandbox_id = sb.id
            yield t
            proc.close()
            sb.delete()


def _open(team, token: str | None, sandbox_id: str | None = None, port: int = PORT):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    url = f"ws://127.0.0.1:{team.port}/v1/sandboxes/{sandbox_id or team.sandbox_id}/ports/{port}/socket"
    return connect(url, additional_headers=headers, open_timeout=30)


def _refused(team, token: str | None, sandbox_id: str | None = None) -> int:
    with pytest.raises(InvalidStatus) as caught:
        _open(team, token, sandbox_id)
    return caught.value.response.status_code


def test_the_owner_reaches_the_port_and_bytes_pass_both_ways(team):
    with _open(team, team.tokens["alice"]) as ws:
        ws.send(b"hello\n")
        assert ws.recv(timeout=30) == b"hello\n"
        big = bytes(range(256)) * 2048
        ws.send(big)
        got = b""
        while len(got) < len(big):
            got += ws.recv(timeout=30)
        assert got == big


def test_another_tenant_or_no_token_opens_nothing(team):
    unknown = _refused(team, team.tokens["bob"], UNKNOWN)
    assert _refused(team, team.tokens["bob"], team.sandbox_id) == unknown  # as if missing
    assert _refused(team, None) in (401, 403)
    assert _refused(team, "not-a-token") in (401, 403)
    with pytest.raises(InvalidStatus):  # a path that is not a port socket
        connect(f"ws://127.0.0.1:{team.port}/v1/sandboxes/{team.sandbox_id}/ports/x/socket",
                additional_headers={"Authorization": f"Bearer {team.tokens['alice']}"},
                open_timeout=30)


def test_a_tenants_port_sockets_are_capped_by_its_live_streams(team):
    token = team.tokens["alice"]
    with _open(team, token):
        with _open(team, token):
            assert _refused(team, token) == 403  # over --max-tenant-streams 2
        deadline = time.monotonic() + 30
        while True:  # the daemon gives the stream back once it sees the close
            try:
                with _open(team, token):
                    break
            except InvalidStatus:
                assert time.monotonic() < deadline
                time.sleep(0.1)


def test_revoking_the_token_closes_its_open_port_socket(team):
    with corral.Client(team.url, token=team.tokens["carol"]) as client:
        sb = corral.Sandbox.create(memory_mb=64, client=client)
        try:
            sb.spawn(["python3", "-c", ECHO])
            deadline = time.monotonic() + 30
            while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            with _open(team, team.tokens["carol"], sb.id) as ws:
                ws.send(b"x\n")
                assert ws.recv(timeout=30) == b"x\n"
                with team.admin() as admin:
                    assert admin.delete("/v1/tokens/carol").status_code in (200, 204)
                with pytest.raises(ConnectionClosed):
                    for _ in range(300):
                        ws.send(b"x\n")
                        ws.recv(timeout=30)
        finally:
            with team.admin() as admin:
                admin.delete(f"/v1/sandboxes/{sb.id}")
