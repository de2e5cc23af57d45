"""Revoking a token ends everything it opened (issue 23): an E2B ``get_host`` address's
traffic token dies with the token that minted it, but a native exposed port's URL
(``POST /v1/sandboxes/{id}/ports``) lived on after its token was revoked, for as long
as the sandbox ran (``--on-revoke keep``: sandboxes outlive a revoked token), and so
did a WebSocket relayed through it: whoever stole the token and exposed a port kept
that door into the tenant's sandbox past the revoke. Both end with the token now.
"""

from __future__ import annotations

import httpx
import pytest

import corral
from tests.security.tenants_helpers import team_daemon
from tests.security.test_door_revocation import END_S, revoke
from tests.security.test_expose import WS_ECHO, _serve


@pytest.fixture(scope="module")
def team():
    with team_daemon("--on-revoke", "keep") as t:
        yield t


def test_a_revoked_tokens_exposed_ports_and_their_relays_end(team):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    token = team.make_token("leaky")
    with corral.Client(team.url, token=token) as leaky:
        sb = corral.Sandbox.create(memory_mb=128, client=leaky)
        sb.files.write("/workspace/ws.py", WS_ECHO.encode())
        sb.files.write("/workspace/site/index.html", b"inside")
        _serve(sb, "python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace/site", 8000)
        _serve(sb, "python3 /workspace/ws.py", 9000)
        page, ws_url = sb.expose(8000), sb.expose(9000).replace("http://", "ws://")
    assert httpx.get(page, timeout=60).text == "inside"
    with connect(ws_url + "x", open_timeout=30, ping_interval=None) as ws:
        ws.send("before")
        assert ws.recv(timeout=30) == "echo:before"
        revoke(team, "leaky")
        try:  # relayed on, the sandbox's server would echo it
            ws.send("after")
            heard = ws.recv(timeout=END_S)
        except ConnectionClosed:
            heard = None
    after = httpx.get(page, timeout=60)
    with team.admin() as admin:  # the sandbox itself runs on (--on-revoke keep)
        assert admin.get(f"/v1/sandboxes/{sb.id}").json()["state"] == "running"
        admin.delete(f"/v1/sandboxes/{sb.id}")
    assert after.status_code in (401, 404) and "inside" not in after.text, after.text
    assert heard is None, "the relayed WebSocket outlived the revoke"
