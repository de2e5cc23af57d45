"""The dashboard's page of one sandbox (``/ui/sandboxes/{id}``), against a real daemon
on TCP: it shows the sandbox's info, processes, files and log; every name a sandbox
chose is escaped; a tenant's session sees only its own sandboxes' pages."""

from __future__ import annotations

import html
import json

import httpx
import pytest

from tests.security.dashboard_daemon import HTML, PLANTED, login, start
from tests.server.conftest import uds_client


@pytest.fixture
def ui(make_daemon):
    """``(daemon, its TCP URL, a client of it without credentials)``."""
    d, url = start(make_daemon)
    with httpx.Client(base_url=url, timeout=60) as c:
        yield d, url, c


def test_the_page_of_a_sandbox_shows_its_processes_files_and_log(ui):
    d, _, c = ui
    with uds_client(d.socket) as api:
        sid = api.post("/v1/sandboxes", json={"memory_mb": 64, "tags": ["page"]}).json()["id"]
        run = api.post(f"/v1/sandboxes/{sid}/exec", json={
            "cmd": ["sh", "-c", f"mkdir -p /workspace/sub && touch '/workspace/{PLANTED}'"
                    " /workspace/sub/inner.txt"]})
        assert run.status_code == 200 and run.json()["returncode"] == 0, run.text
        spawned = api.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": ["sleep", "300"]})
        assert spawned.status_code in (200, 201), spawned.text
    login(c)
    assert f'href="/ui/sandboxes/{sid}"' in c.get("/ui", headers=HTML).text  # linked
    page = c.get(f"/ui/sandboxes/{sid}", headers=HTML)
    assert page.status_code == 200, page.text
    text = page.text
    assert "running" in text and "page" in text
    assert "sleep 300" in text  # its process
    # its working directory's files (the one planted: escaped), its log
    files = text[text.index("Files: /workspace"):text.index("<h2>Log")]
    assert "&lt;img src=x onerror=" in files and PLANTED not in text
    assert ">sub/<" in files
    assert "mkdir -p" in html.unescape(text)  # its log: the command it ran
    assert "'unsafe-inline'" not in page.headers["content-security-policy"]
    sub = c.get(f"/ui/sandboxes/{sid}", params={"path": "/workspace/sub"}, headers=HTML)
    assert "inner.txt" in sub.text and "sleep 300" in sub.text
    bad = c.get(f"/ui/sandboxes/{sid}", params={"path": "/nope"}, headers=HTML)
    assert bad.status_code == 200 and "/nope" in bad.text  # the error in the files' place
    assert c.get("/ui/sandboxes/sb-0123456789ab", headers=HTML).status_code == 404


def test_a_tenant_sees_only_its_own_sandboxes_pages(ui):
    d, url, _ = ui
    with uds_client(d.socket) as api:
        theirs = api.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        token = api.post("/v1/tokens", json={"name": "carol"}).json()["token"]
    with httpx.Client(base_url=url, timeout=60) as tenant:
        assert tenant.post("/ui/login", data={"token": token}).status_code == 303
        page = tenant.get(f"/ui/sandboxes/{theirs}", headers=HTML)
        assert page.status_code == 404 and theirs in page.text  # as if it did not exist
        assert "Processes" not in page.text
        mine = tenant.post("/v1/sandboxes", json={"memory_mb": 64},
                           headers={"Authorization": f"Bearer {token}"}).json()["id"]
        assert tenant.get(f"/ui/sandboxes/{mine}", headers=HTML).status_code == 200


def test_the_terminal_runs_a_shell_in_the_sandbox_behind_the_csrf_token(ui):
    d, _, c = ui
    with uds_client(d.socket) as api:
        sid = api.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
    csrf = login(c)
    page = c.get(f"/ui/sandboxes/{sid}", headers=HTML).text
    assert 'id="terminal-open"' in page and "/ui/static/terminal.js" in page
    assert c.get("/ui/static/terminal.js").status_code == 200
    # without the session's CSRF token: refused (a cross-site page cannot open one)
    assert c.post(f"/ui/sandboxes/{sid}/terminal").status_code == 403
    opened = c.post(f"/ui/sandboxes/{sid}/terminal", headers={"X-CSRF-Token": csrf})
    assert opened.status_code == 201, opened.text
    proc = opened.json()
    assert proc["pty"] is True
    at = f"/ui/sandboxes/{sid}/processes/{proc['id']}"
    assert c.post(at + "/stdin", content=b"echo $((6*7)) from $(id -u)\r").status_code == 403
    sent = c.post(at + "/stdin", content=b"echo $((6*7)) from $(id -u); exit\r",
                  headers={"X-CSRF-Token": csrf})
    assert sent.status_code == 204, sent.text
    seen = ""
    with c.stream("GET", at + "/output") as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            event = json.loads(line)
            seen += event.get("data", "")
            if event["type"] == "exit":
                break
    assert "42 from 1000" in seen  # run inside, as the sandbox's user
