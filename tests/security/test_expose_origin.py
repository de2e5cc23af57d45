"""An exposed port's pages are served from the daemon's own origin
(``http://DAEMON/expose/<token>/``). A hostile sandbox's page, opened by someone
logged into the dashboard in the same browser (``/ui``, a session cookie for that
origin), ran its scripts on the dashboard's origin: ``fetch("/ui")`` carried the
session cookie and read the answer, so the page could act as that user (the admin).

The relay now sends every relayed page with ``Content-Security-Policy: sandbox ...``:
the browser gives the page an opaque origin of its own (scripts, forms and the page's
WebSockets still work), so the dashboard is another origin to it.
"""

from __future__ import annotations

import pytest

import corral
from tests.security.tenants_helpers import team_daemon
from tests.security.test_expose import _serve, admin_page

STEAL = """<!doctype html><title>waiting</title><script>
fetch("/ui", {credentials: "include"}).then(r => r.text().then(t => {
  document.title = r.url.endsWith("/ui/login") ? "anonymous"
                 : (t.includes("data-id") ? "stolen" : "read:" + r.status);
})).catch(e => { document.title = "blocked"; });
</script>"""


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def test_an_exposed_page_cannot_read_the_dashboard(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=256, client=alice)
        try:
            sb.files.write("/workspace/app/index.html", STEAL.encode())
            _serve(sb, "python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace/app", 8000)
            page_url = sb.expose(8000)
            with admin_page(team) as page:  # the admin, logged in to the dashboard,
                page.goto(page_url)  # ... opens a sandbox's exposed page
                page.wait_for_function("document.title !== 'waiting'")
                title = page.title()
        finally:
            sb.delete()
    assert title == "blocked", title
