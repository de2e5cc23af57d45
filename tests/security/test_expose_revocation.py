"""Revoking a token ends everything it opened (issue 23): an E2B ``get_host`` address's
traffic token dies with the token that minted it, but a native exposed port's URL
(``POST /v1/sandboxes/{id}/ports``) lived on after its token was revoked, for as long
as the sandbox ran (``--on-revoke keep``: sandboxes outlive a revoked token), and so
did a WebSocket relayed through it: whoever stole the token and exposed a port kept
that door into the tenant's sandbox past the revoke. Both end with the token now. And a
``get_host`` relay opened before the revoke (a WebSocket, a streamed reply) went on after
it, held under nobody: it is held under the token that minted the traffic token now.
"""

from __future__ import annotations

import time

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


def _echo_across_revoke(ws, team, name: str) -> str | None:
    """What a relayed echo server answers to a message sent after ``name``'s revoke
    (None: the relay ended)."""
    from websockets.exceptions import ConnectionClosed

    ws.send("before")
    assert ws.recv(timeout=30) == "echo:before"
    revoke(team, name)
    try:  # relayed on, the sandbox's server would echo it
        ws.send("after")
        return ws.recv(timeout=END_S)
    except ConnectionClosed:
        return None


def test_a_revoked_tokens_exposed_ports_and_their_relays_end(team):
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
        heard = _echo_across_revoke(ws, team, "leaky")
    after = httpx.get(page, timeout=60)
    with team.admin() as admin:  # the sandbox itself runs on (--on-revoke keep)
        assert admin.get(f"/v1/sandboxes/{sb.id}").json()["state"] == "running"
        admin.delete(f"/v1/sandboxes/{sb.id}")
    assert after.status_code in (401, 404) and "inside" not in after.text, after.text
    assert heard is None, "the relayed WebSocket outlived the revoke"


def test_a_revoked_tokens_e2b_get_host_relays_end(team, monkeypatch):
    """E2B's ``get_host(port)`` address, reached with the create reply's traffic token:
    a new request was refused once the minting token was revoked, but a WebSocket and a
    streamed reply relayed through it before the revoke went on (they were held under
    nobody). They are held under the minting token now, and end at its revoke."""
    pytest.importorskip("e2b")
    import socket

    from e2b import Sandbox
    from websockets.sync.client import connect

    for name in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.setenv(name, team.url)
    token = team.make_token("e2b-host")
    sb = Sandbox.create(api_key=token, timeout=600)
    sb.files.write("/workspace/ws.py", WS_ECHO)
    sb.files.write("/workspace/tick.py", TICKER)
    sb.commands.run("python3 /workspace/ws.py", background=True)
    sb.commands.run("python3 /workspace/tick.py", background=True)
    traffic = {"e2b-traffic-access-token": sb.traffic_access_token}

    def dial() -> socket.socket:  # get_host's name, at the daemon's address
        return socket.create_connection(("127.0.0.1", team.port), timeout=60)

    ws_url = f"ws://{sb.get_host(9000)}/x"
    with httpx.Client(base_url=team.url, timeout=None) as http:
        for _ in range(300):  # both servers listen
            try:
                with connect(ws_url, sock=dial(), additional_headers=traffic,
                             open_timeout=30, ping_interval=None):
                    pass
                ticks = http.stream("GET", "/", headers={"Host": sb.get_host(8001), **traffic})
                reply = ticks.__enter__()
                if reply.status_code == 200:
                    break
                ticks.__exit__(None, None, None)
            except Exception:  # not listening yet (a 502, a refused upgrade)
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("the sandbox's servers never answered through get_host")
        chunks = reply.iter_raw()
        assert b"tick" in next(chunks)
        with connect(ws_url, sock=dial(), additional_headers=traffic,
                     open_timeout=30, ping_interval=None) as ws:
            heard = _echo_across_revoke(ws, team, "e2b-host")
        streamed_on = _reads_on(chunks)
        ticks.__exit__(None, None, None)
        late = http.get("/", headers={"Host": sb.get_host(8001), **traffic})
    with team.admin() as admin:  # the sandbox itself runs on (--on-revoke keep)
        assert admin.get(f"/v1/sandboxes/{sb.sandbox_id}").json()["state"] == "running"
        admin.delete(f"/v1/sandboxes/{sb.sandbox_id}")
    assert late.status_code == 401, late.text
    assert heard is None, "the get_host WebSocket outlived the revoke"
    assert not streamed_on, "the get_host streamed reply outlived the revoke"


# An HTTP server that streams "tick" forever (chunked), standard library only.
TICKER = r"""
import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            self.wfile.write(b"5\r\ntick\n\r\n"); self.wfile.flush(); time.sleep(0.2)
http.server.ThreadingHTTPServer(("127.0.0.1", 8001), H).serve_forever()
"""


def _reads_on(chunks) -> bool:
    """Whether a streamed reply still delivers after the revoke (it should end: bounded
    by END_S, the stream either ends or errors long before)."""
    deadline = time.monotonic() + END_S
    try:
        for _ in chunks:
            if time.monotonic() > deadline:
                return True
    except httpx.HTTPError:
        pass
    return False
