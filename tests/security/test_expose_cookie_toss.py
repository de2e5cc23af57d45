"""An exposed port's pages are served from the daemon's own origin, where the
dashboard's session cookie lives (``corral_session``, ``Path=/ui``). The relay passed
the sandbox's ``Set-Cookie`` headers on as they were: a tenant's sandbox answered
``Set-Cookie: corral_session=<the tenant's own dashboard session>; Path=/``, and the
admin who opened the page in the browser they use for the dashboard was from then on
logged into the dashboard as that tenant (a browser sends the longer path's cookie
first; the daemon read the last): session fixation, the admin's next actions on
``/ui`` done in the tenant's name, on the tenant's sandboxes (a terminal typed into,
files uploaded). ``Clear-Site-Data`` logged the admin out.

A relayed ``Set-Cookie`` now keeps to the exposure's own path (``/expose/<token>/``)
and host (no ``Domain``); ``Clear-Site-Data`` is not relayed.
"""

from __future__ import annotations

import httpx
import pytest

import corral
from tests.security.tenants_helpers import team_daemon
from tests.security.test_expose import _serve, admin_page

SERVER = r"""
import http.server, sys
SID, CLEAR = sys.argv[1], sys.argv[2:] == ["clear"]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        for c in (f"corral_session={SID}; Path=/", f"corral_session={SID}; Path=/ui",
                  f"=corral_session={SID}; Path=/ui", f"own=1; Path=/ui/x",
                  "wide=1; Domain=127.0.0.1", "mine=1"):
            self.send_header("Set-Cookie", c)
        if CLEAR:
            self.send_header("Clear-Site-Data", '"cookies"')
        self.end_headers()
        self.wfile.write(b"<!doctype html><title>tossed</title>")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def _tenant_session(team, name: str) -> str:
    """A dashboard session of the tenant's own (its login, as any tenant may)."""
    with httpx.Client(base_url=team.url, timeout=60) as c:
        reply = c.post("/ui/login", data={"token": team.tokens[name]})
        assert reply.status_code == 303, reply.text
        return c.cookies["corral_session"]


def test_a_relayed_page_sets_no_cookie_outside_its_exposure(team):
    """What the relay answers: only the exposure's own cookies (checked without a
    browser, so it runs wherever the daemon does)."""
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=128, client=alice)
        try:
            sb.files.write("/workspace/srv.py", SERVER.encode())
            _serve(sb, "python3 /workspace/srv.py sid-of-alice clear", 8000)
            url = sb.expose(8000)
            reply = httpx.get(url + "page", timeout=60)
        finally:
            sb.delete()
    assert reply.status_code == 200, reply.text
    assert "clear-site-data" not in reply.headers
    cookies = reply.headers.get_list("set-cookie")
    assert cookies == ["mine=1"], cookies


@pytest.mark.parametrize("mode", ["fix", "clear"])
def test_an_exposed_page_cannot_fix_or_end_the_admins_dashboard_session(team, mode):
    """``fix``: the page sets the tenant's own session id for ``/ui``; ``clear``: it
    asks the browser to drop the origin's cookies too. The admin, back on the
    dashboard, is still logged in, as the admin."""
    with corral.Client(team.url, token=team.tokens["bob"]) as bob, \
            corral.Client(team.url, token=team.tokens["alice"]) as alice:
        other = corral.Sandbox.create(memory_mb=64, client=bob)  # only the admin sees it
        sb = corral.Sandbox.create(memory_mb=128, client=alice)
        try:
            sb.files.write("/workspace/srv.py", SERVER.encode())
            _serve(sb, f"python3 /workspace/srv.py {_tenant_session(team, 'alice')} {mode}", 8000)
            page_url = sb.expose(8000)
            with admin_page(team) as page:  # the admin, logged in to the dashboard,
                assert other.id in page.content()
                page.goto(page_url)  # ... opens a sandbox's exposed page
                assert page.title() == "tossed"
                page.goto(f"{team.url}/ui")  # ... and goes back to the dashboard
                final, html = page.url, page.content()
        finally:
            sb.delete()
            other.delete()
    assert final == f"{team.url}/ui", final  # still logged in
    assert other.id in html  # as the admin, not as alice
