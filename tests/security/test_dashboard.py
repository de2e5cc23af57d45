"""Attacks on the dashboard (``/ui``) over HTTP, against a real daemon on TCP: stealing
or forging its session, cross-site requests, planted markup, oversized input."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from corral.server.evals import EvalReport, EvalStore
from corral.server.ui.render import render
from corral.server.ui.sessions import Sessions
from corral.server.ui.views import Filters
from tests.security.dashboard_daemon import HTML, PLANTED, TOKEN, login, start
from tests.server.conftest import uds_client


@pytest.fixture
def ui(make_daemon):
    """``(daemon, client on TCP without credentials)``."""
    d, url = start(make_daemon)
    with httpx.Client(base_url=url, timeout=60) as c:
        yield d, c


def test_login_gives_a_session_cookie_never_the_token(ui):
    d, c = ui
    assert c.get("/ui", headers=HTML).headers["location"] == "/ui/login"
    assert c.get("/ui/events").status_code == 401
    wrong = c.post("/ui/login", data={"token": "not-it"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert "wrong token" in wrong.text
    ok = c.post("/ui/login", data={"token": TOKEN})
    assert ok.status_code == 303 and ok.headers["location"] == "/ui"
    cookie = ok.headers["set-cookie"]
    assert TOKEN not in cookie
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/ui"} <= flags
    assert "secure" not in flags  # plain http on loopback: a Secure cookie would be lost
    page = c.get("/ui", headers=HTML)
    assert page.status_code == 200 and TOKEN not in page.text
    # the cookie opens the page only, not the API
    assert c.get("/v1/sandboxes").status_code == 401


def test_every_reply_carries_the_security_headers(ui):
    _, c = ui
    login(c)
    for path in ("/ui", "/ui/login", "/ui/static/ui.js", "/ui/static/ui.css", "/ui/nope"):
        reply = c.get(path, headers=HTML)
        csp = reply.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp, path
        assert "frame-ancestors 'none'" in csp
        assert reply.headers["x-frame-options"] == "DENY"
        assert reply.headers["x-content-type-options"] == "nosniff"
    for sneaky in ("/ui/static/../__init__.py", "/ui/static/%2e%2e/__init__.py",
                   "/ui/static/..%2fgate.py", "/ui/static/templates/login.html"):
        assert c.get(sneaky).status_code == 404, sneaky
    page = c.get("/ui", headers=HTML).text
    scripts = re.findall(r"<script[^>]*>", page)
    assert scripts == ['<script src="/ui/static/ui.js" defer>']  # no inline script
    assert not re.search(r"<[^>]+\son[a-z]+\s*=", page)  # no inline handler


def test_state_changes_need_the_csrf_token_and_this_origin(ui):
    d, c = ui
    csrf = login(c)
    origin = str(c.base_url).rstrip("/")
    with uds_client(d.socket) as admin:
        sid = admin.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        try:
            # a cross-site form post: the browser sends the cookie (if it would), no token
            forged = c.post(f"/ui/sandboxes/{sid}/delete", data={"x": "1"},
                            headers={"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"})
            assert forged.status_code == 403
            assert c.post(f"/ui/sandboxes/{sid}/delete").status_code == 403  # no token
            assert c.post(f"/ui/sandboxes/{sid}/delete",
                          headers={"X-CSRF-Token": csrf + "x"}).status_code == 403
            assert c.post(f"/ui/sandboxes/{sid}/delete", headers={
                "X-CSRF-Token": csrf, "Origin": "http://evil.example"}).status_code == 403
            assert c.post(f"/ui/sandboxes/{sid}/stop", data={"csrf": csrf}).status_code == 403
            assert admin.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
            # another session's token does not do either
            with httpx.Client(base_url=c.base_url, timeout=60) as other:
                other_csrf = login(other)
                assert other_csrf != csrf
                assert c.post(f"/ui/sandboxes/{sid}/delete",
                              headers={"X-CSRF-Token": other_csrf}).status_code == 403
            done = c.post(f"/ui/sandboxes/{sid}/delete",
                          headers={"X-CSRF-Token": csrf, "Origin": origin})
            assert done.status_code == 204, done.text
            assert admin.get(f"/v1/sandboxes/{sid}").status_code == 404
        finally:
            admin.delete(f"/v1/sandboxes/{sid}")


def test_a_login_from_another_site_is_refused(ui):
    _, c = ui
    reply = c.post("/ui/login", data={"token": TOKEN}, headers={"Origin": "http://evil.example"})
    assert reply.status_code == 403 and "set-cookie" not in reply.headers


def test_logout_ends_the_session(ui):
    _, c = ui
    csrf = login(c)
    assert c.post("/ui/logout").status_code == 403  # logging out needs the token too
    out = c.post("/ui/logout", headers={"X-CSRF-Token": csrf})
    assert out.status_code == 303 and "max-age=0" in out.headers["set-cookie"].lower()
    # the old cookie is dead on the daemon, not only forgotten by the browser
    c.cookies.clear()
    assert c.get("/ui", headers=HTML).status_code == 303


def test_a_forged_or_stale_cookie_is_no_session(ui):
    _, c = ui
    c.cookies.set("corral_session", "guess", path="/ui")
    assert c.get("/ui", headers=HTML).status_code == 303
    c.cookies.set("corral_session", TOKEN, path="/ui")  # the token itself is no cookie
    assert c.get("/ui/events").status_code == 401
    c.headers["Cookie"] = 'corral_session="\\x"; ;;=;'  # malformed
    assert c.get("/ui/events").status_code == 401


def test_credentials_sent_with_a_ui_request_are_not_used(ui):
    _, c = ui
    # a bearer token on /ui is not a session: the page needs the login
    reply = c.get("/ui/events", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 401


def test_the_login_form_is_bounded(ui):
    _, c = ui
    big = c.post("/ui/login", data={"token": "x" * 100_000})
    assert big.status_code == 400 and "set-cookie" not in big.headers
    assert c.post("/ui/login", content=b"").status_code == 400
    odd = c.post("/ui/login", content=json.dumps({"token": ["a"]}),
                 headers={"Content-Type": "application/json"})
    assert odd.status_code == 400
    assert c.post("/ui/login", data={"token": "令牌"}).status_code == 400


def test_planted_markup_is_text_on_the_page_and_in_the_live_stream(ui):
    d, c = ui
    with uds_client(d.socket) as admin:
        report = {"name": PLANTED, "env": PLANTED, "state": "failed", "error": PLANTED,
                  "done": 1, "counts": {"ok": 1}}
        assert admin.put("/v1/evals/ev-0123456789abcdef", json=report).status_code == 200
    login(c)
    page = c.get("/ui", headers=HTML, params={"tenant": PLANTED, "tag": '"><script>x()</script>'})
    assert page.status_code == 200
    assert PLANTED not in page.text and "<script>x()" not in page.text
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in page.text
    with c.stream("GET", "/ui/events") as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        for line in events.iter_lines():
            if line.startswith("data: {"):
                panels = json.loads(line[len("data: "):])
                break
    assert PLANTED not in panels["evals"] and "&lt;img" in panels["evals"]
    assert PLANTED not in panels["errors"] and "&lt;img" in panels["errors"]


def test_markup_in_any_field_is_escaped_by_the_templates():
    """Tags cannot hold markup today (the API refuses them), but the page must not rely
    on that: every field of every panel goes through autoescaping."""
    sandbox = {"id": PLANTED, "state": "running", "tenant": PLANTED, "reason": PLANTED,
               "created_at": 0, "usage": None,
               "spec": {"image": PLANTED, "tags": [PLANTED], "memory_mb": 64}}
    html = render("panel_sandboxes.html", sandboxes=[sandbox], hidden=0)
    html += render("panel_pools.html", pools=[{"name": PLANTED, "spec": {"image": PLANTED},
                                               "last_error": PLANTED}])
    html += render("panel_snapshots.html", snapshots=[
        {"id": PLANTED, "name": PLANTED, "image": PLANTED, "size_bytes": 0, "created_at": 0}])
    html += render("panel_errors.html", errors=[{"at": 0, "what": PLANTED, "message": PLANTED}])
    assert "<img" not in html and html.count("&lt;img") >= 9


def test_unknown_filters_are_refused():
    from starlette.requests import Request

    from corral.errors import InvalidArgument

    scope = {"type": "http", "query_string": b"state=%3Cb%3E", "headers": []}
    with pytest.raises(InvalidArgument):
        Filters.of(Request(scope))
    many = "&".join(f"tag=t{i}" for i in range(50)).encode()
    assert len(Filters.of(Request({**scope, "query_string": many})).tags) == 8


def test_eval_reports_are_bounded(ui):
    d, _ = ui
    with uds_client(d.socket) as admin:
        def put(eval_id: str, **body) -> httpx.Response:
            return admin.put(f"/v1/evals/{eval_id}", json={"name": "n", **body})

        assert put("ev-0123456789abcdef").status_code == 200
        assert put("../../etc").status_code in (400, 404)
        assert put("ev-" + "a" * 100).status_code == 400
        assert put("ev-0123456789abcdef", name="x" * 10_000).status_code == 400
        hist = {"low": 0, "high": 1, "counts": [1] * 51}
        assert put("ev-0123456789abcdef", histogram=hist).status_code == 400
        assert put("ev-0123456789abcdef", counts={str(i): 1 for i in range(9)}).status_code == 400
        assert put("ev-0123456789abcdef", extra=1).status_code == 400
        assert put("ev-0123456789abcdef", done=-1).status_code == 400
        runs = admin.get("/v1/evals").json()["evals"]
        assert [r["id"] for r in runs] == ["ev-0123456789abcdef"]


def test_the_eval_store_keeps_few_runs_and_owners_apart():
    store = EvalStore(max_runs=5, per_owner=3)
    report = EvalReport(name="r")
    for i in range(4):
        store.put(f"ev-{i:08x}", report, "a")
    assert [r.id for r in store.list("a", admin=False)] == ["ev-00000003", "ev-00000002",
                                                            "ev-00000001"]
    for i in range(10):
        store.put(f"ev-{i + 100:08x}", report, "b")
    assert len(store.list(None, admin=True)) == 5
    assert store.list("a", admin=False) == [] or len(store.list("a", admin=False)) <= 3
    store.put("ev-000000ff", report, "c")
    with pytest.raises(Exception) as err:
        store.put("ev-000000ff", report, "d")  # another owner's run: as if unknown
    assert getattr(err.value, "status", None) == 404
    assert [r.id for r in store.list("d", admin=False)] == []


def test_sessions_are_bounded():
    sessions = Sessions(max_sessions=3)
    ids = [sessions.open(f"t{i}")[0] for i in range(5)]
    assert len(sessions) == 3
    assert sessions.get(ids[0]) is None and sessions.get(ids[-1]).token == "t4"
    assert sessions.get(None) is None and sessions.get("") is None


async def test_a_session_whose_token_is_refused_ends_at_once():
    """A revoked token (here: the session's token no longer the daemon's) ends the
    session on its next request; it does not come back when the token would work."""
    from tests.server.test_units import TOKEN as APP_TOKEN
    from tests.server.test_units import make_client

    client = make_client()
    app = client._transport.app
    async with client:
        ok = await client.post("/ui/login", data={"token": APP_TOKEN})
        assert ok.status_code == 303
        assert (await client.get("/ui/whoami")).status_code == 204
        (session,) = list(app.state.ui_sessions._by_id.values())
        session.token = "revoked-" + APP_TOKEN
        assert (await client.get("/ui/whoami")).status_code == 401
        assert len(app.state.ui_sessions) == 0
        session.token = APP_TOKEN
        assert (await client.get("/ui/whoami")).status_code == 401
