"""Exposed ports (server/expose.py): a server inside a sandbox reached through the
daemon by whoever holds the port's URL, and by nobody else; the sandbox gains no way
out (``network="none"`` stays none)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import time

import httpx
import pytest

import corral
from corral.errors import InvalidArgument, InvalidState, PortClosed, SandboxNotFound
from tests.security.tenants_helpers import ADMIN_TOKEN, no_traceback, team_daemon

# A WebSocket echo server in the standard library (the image has no websockets package):
# one connection at a time, text frames up to 125 bytes, enough for the test.
WS_ECHO = r"""
import base64, hashlib, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000)); s.listen()
while True:
    c, _ = s.accept()
    head = b""
    while b"\r\n\r\n" not in head and (chunk := c.recv(4096)):
        head += chunk
    if b"\r\n\r\n" not in head:  # a probe that connected and left
        c.close()
        continue
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
           if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    while True:
        h = c.recv(2)
        if len(h) < 2 or h[0] & 0x0F == 8:
            break
        n = h[1] & 0x7F; mask = c.recv(4); data = c.recv(n)
        text = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        reply = b"echo:" + text
        c.sendall(bytes([0x81, len(reply)]) + reply)
    c.close()
"""


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def _serve(sb: corral.Sandbox, command: str, port: int) -> None:
    sb.exec(f"nohup {command} >/dev/null 2>&1 &", timeout=30)
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    for _ in range(200):
        if sb.exec(["python3", "-c", probe], timeout=30).returncode == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def test_http_server_in_a_sandbox_without_network(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=128, client=alice)  # network="none"
        try:
            sb.files.write("/workspace/hello.txt", b"hello from the sandbox")
            sb.files.write("/workspace/a b?.txt", b"encoded")
            _serve(sb, "python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace", 8000)
            url = sb.expose(8000)
            assert url.startswith(team.url + "/expose/")
            assert sb.expose(8000) == url  # one token per port
            got = httpx.get(url + "hello.txt", timeout=30)  # no credential but the URL's
            assert got.status_code == 200 and got.text == "hello from the sandbox"
            assert httpx.get(url + "a%20b%3F.txt", timeout=30).text == "encoded"  # as sent
            listing = httpx.get(url, timeout=30)
            assert "hello.txt" in listing.text
            assert httpx.get(url + "missing", timeout=30).status_code == 404
            # the token is the only key: a changed one opens nothing
            forged = url.replace("/expose/", "/expose/x")
            assert httpx.get(forged, timeout=30).status_code in (401, 404)
            closed = httpx.get(sb.expose(8001), timeout=30)  # nothing listens there
            assert closed.status_code == 502 and PortClosed.code in closed.text
            r = sb.exec(["python3", "-c", "import socket; socket.create_connection("
                         "('198.51.100.2', 80), timeout=2)"], timeout=30)
            assert r.returncode != 0  # still no network at all
            with pytest.raises(InvalidArgument):
                sb.expose(0)
            with corral.Client(team.url, token=team.tokens["bob"]) as bob:
                with pytest.raises(SandboxNotFound):
                    corral.Sandbox.connect(sb.id, client=bob).expose(8000)
            sb.stop()
            with pytest.raises(InvalidState):
                sb.expose(8000)
        finally:
            sb.delete()
        dead = httpx.get(url, timeout=30)
        assert dead.status_code in (401, 404)  # its token died with it
    team.cleanup()
    no_traceback(team)


def test_websocket_echo(team):
    from websockets.sync.client import connect

    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=128, client=alice)
        try:
            sb.files.write("/workspace/ws.py", WS_ECHO.encode())
            _serve(sb, "python3 /workspace/ws.py", 9000)
            url = sb.expose(9000).replace("http://", "ws://")
            with connect(url + "chat", open_timeout=30) as ws:
                ws.send("ping")
                assert ws.recv(timeout=30) == "echo:ping"
                ws.send("again")
                assert ws.recv(timeout=30) == "echo:again"
            from websockets.exceptions import InvalidStatus

            base = team.url.replace("http", "ws")
            for path in ("/expose/nope/", "/v1/health", "/v1/sandboxes"):
                with pytest.raises(InvalidStatus):  # WebSocket only to an exposed port
                    with connect(base + path, open_timeout=30) as ws:
                        ws.recv(timeout=5)
        finally:
            sb.delete()
    team.cleanup()
    no_traceback(team)


# An upload server in the standard library: HTTP/1.1, so it answers ``Expect:
# 100-continue`` with a 100 itself; on /hints it sends a 103 Early Hints first too.
UPLOADS = r"""
import hashlib, http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_PUT(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/hints":
            self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
        body = b"%d %s %s" % (len(data), hashlib.sha256(data).hexdigest().encode(),
                              (self.headers["Expect"] or "-").encode())
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("127.0.0.1", 8002), H).serve_forever()
"""


def _upload_expecting_100(url: str, path: str, body: bytes) -> tuple[bytes, bytes]:
    """PUT ``body`` to ``url + path`` as curl does past 1 KiB: ``Expect: 100-continue``,
    the body only once a 100 came. (the interim head, the final reply)"""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    target = "/" + url.split("//")[1].split("/", 1)[1] + path
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(f"PUT {target} HTTP/1.1\r\nHost: {host}\r\nExpect: 100-continue\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got and (chunk := s.recv(4096)):  # (a timeout: a hang)
            got += chunk
        interim, _, got = got.partition(b"\r\n\r\n")
        if interim.startswith(b"HTTP/1.1 100"):
            s.sendall(body)
        while chunk := s.recv(1 << 16):  # (the relay's replies end with Connection: close)
            got += chunk
    return interim, got


def _dechunk(data: bytes) -> bytes:
    out = b""
    while (size := int(data.split(b"\r\n", 1)[0], 16)) > 0:
        at = data.index(b"\r\n") + 2
        out, data = out + data[at:at + size], data[at + size + 2:]
    return out


def test_an_upload_that_expects_100_continue_reaches_the_sandbox(team):
    body = os.urandom(256 << 10)
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=128, client=alice)
        try:
            sb.files.write("/workspace/up.py", UPLOADS.encode())
            _serve(sb, "python3 /workspace/up.py", 8002)
            url = sb.expose(8002)
            want = b"%d %s -" % (len(body), hashlib.sha256(body).hexdigest().encode())
            for path in ("up", "hints"):  # a 1xx from the sandbox's server is skipped
                interim, reply = _upload_expecting_100(url, path, body)
                assert interim.startswith(b"HTTP/1.1 100"), interim
                head, _, chunked = reply.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), reply[:300]
                assert _dechunk(chunked) == want  # the whole body, and no Expect relayed
        finally:
            sb.delete()
    team.cleanup()
    no_traceback(team)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def admin_page(team):
    """A chromium page logged into the daemon's dashboard (``/ui``) as the admin."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("no chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox"] if os.geteuid() == 0 else [])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{team.url}/ui")
            page.fill("#token", ADMIN_TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url(f"{team.url}/ui")
            yield page
        finally:
            browser.close()
PAGE = """<!doctype html><title>waiting</title><script>
const ws = new WebSocket(new URLSearchParams(location.search).get("ws") + "chat");
ws.onopen = () => ws.send("hi");
ws.onmessage = (e) => { document.title = e.data; };
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/install.sh)")
def test_chromium_loads_a_page_that_talks_websocket(team):
    """A browser (Debian's chromium via Playwright) opens the sandbox's web app through
    its exposed URL, and the page's own WebSocket reaches the sandbox's echo server."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        try:
            sb.files.write("/workspace/app/index.html", PAGE.encode())
            sb.files.write("/workspace/ws.py", WS_ECHO.encode())
            _serve(sb, "python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace/app", 8000)
            _serve(sb, "python3 /workspace/ws.py", 9000)
            page_url = sb.expose(8000)
            ws_url = sb.expose(9000).replace("http://", "ws://")
            with sync_api.sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                            args=["--no-sandbox"] if os.geteuid() == 0 else [])
                try:
                    page = browser.new_page()
                    page.goto(f"{page_url}?ws={ws_url}", timeout=60_000)
                    page.wait_for_function("document.title === 'echo:hi'", timeout=60_000)
                finally:
                    browser.close()
        finally:
            sb.delete()
    team.cleanup()
    no_traceback(team)


def test_a_tenants_relays_count_as_its_live_streams():
    """Red team: relays to an exposed port were counted nowhere (a WebSocket even left
    the connection book), so one tenant's sandbox could hold the daemon's descriptors
    through its URL. Each relay is now a live stream of the sandbox's tenant."""
    import socket
    from urllib.parse import urlsplit

    with team_daemon("--max-tenant-streams", "2") as t, \
            corral.Client(t.url, token=t.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=128, client=alice)
        try:
            sb.exec("mkfifo /workspace/slow && echo ok > /workspace/ok", timeout=30)
            _serve(sb, "python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace", 8000)
            url = sb.expose(8000)
            path = urlsplit(url).path
            held = []
            for _ in range(2):  # the server's thread waits on the FIFO: the relay stays
                s = socket.create_connection(("127.0.0.1", t.port), timeout=60)
                s.sendall(f"GET {path}slow HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                held.append(s)
            for _ in range(600):  # until both relays hold their place (hang guard only)
                third = httpx.get(url + "ok", timeout=60)
                if third.status_code == 429:
                    break
                time.sleep(0.05)
            assert third.status_code == 429, third.text  # was: relayed, without bound
            assert "--max-tenant-streams" in third.json()["error"]["message"]
            for s in held:
                s.close()
        finally:
            sb.delete()  # the FIFO's readers end with it
        no_traceback(t)
