"""A port socket's messages to a sandbox's server (server/port_socket.py): held in the
output budget of the tenant, as an exposed port's WebSocket's are.

A tenant opened port sockets (up to ``--max-tenant-streams``) to a server in its own
sandbox that reads nothing and sent each a 16 MiB message (uvicorn's ``ws_max_size``):
the daemon held every one, ~16 MiB a socket, outside any budget. Now, with room for
two such messages in the tenant's budget (``--tenant-output-memory-mb 40``): two
sockets each hold the one they were sent (the daemon's gauge says so), a third is
closed with 1013 (try again later) and the exposed relay's reason (its message was not
relayed), and once the clients have gone, every byte comes back, though the sandbox's
server still reads nothing (the daemon's keepalive ping finds they left).
"""

from __future__ import annotations

import base64
import os
import socket

import pytest

import corral
from tests.security.tenants_helpers import no_traceback, team_daemon
from tests.security.test_expose import _serve
from tests.security.test_expose_ws_inbound import spend_and_refuse
from tests.security.test_port_socket import ECHO

PORT = 9003  # inside the sandbox: a TCP server that accepts and never reads
DEAF = ECHO.replace("8000", str(PORT)).replace(
    "threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()",
    "held.append(s.accept()[0])").replace("while True", "held = []\nwhile True")


@pytest.fixture(scope="module")
def team():
    with team_daemon("--tenant-output-memory-mb", "40") as t:
        yield t


def _open(team, sandbox_id: str) -> socket.socket:
    """alice's port socket to the deaf server, reading nothing past the handshake."""
    s = socket.create_connection(("127.0.0.1", team.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /v1/sandboxes/{sandbox_id}/ports/{PORT}/socket HTTP/1.1\r\nHost: x\r\n"
               f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
               f"Sec-WebSocket-Version: 13\r\n"
               f"Authorization: Bearer {team.tokens['alice']}\r\n\r\n").encode())
    s.settimeout(60)
    assert s.recv(12) == b"HTTP/1.1 101"
    return s


def test_port_sockets_to_a_deaf_server_spend_the_tenant_budget_and_get_1013(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        sb.files.write("/workspace/deaf.py", DEAF.encode())
        _serve(sb, "python3 /workspace/deaf.py", PORT)
        spend_and_refuse(team, lambda: _open(team, sb.id))
        sb.delete()
    no_traceback(team)
