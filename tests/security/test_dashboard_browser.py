"""The dashboard in a real browser: Debian's chromium driven by Playwright.

Logs in with the form, finds a sandbox made through the SDK, deletes it with its
button (checked through the SDK), sees a new sandbox and an evaluation run of
``corral.rl.evaluate`` appear without a reload, and never runs markup an API client
planted (an evaluation's name, a filter in the URL). A screenshot is kept in
``$CORRAL_TEST_ARTIFACTS`` (default ``tests/artifacts/``).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest

import corral
from corral.rl import evaluate
from tests.conftest import have_root_runtime
from tests.security.dashboard_daemon import TOKEN, start
from tests.server.conftest import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("CORRAL_TEST_ARTIFACTS") or Path(__file__).parents[1] / "artifacts")
PLANTED = "<img src=x onerror=\"window.__pwned=1;alert('pwned')\">"
POLICY = "def act(obs):\n    return int(obs[3] > 0)\n"
WAIT_MS = 60_000

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/install.sh "
                       "installs it)"),
    pytest.mark.skipif(not have_root_runtime(), reason="needs root, bubblewrap and cgroups"),
]


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        # Debian's chromium, never a downloaded one; as root it needs --no-sandbox
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        b = p.chromium.launch(executable_path=CHROMIUM, args=args, headless=True)
        try:
            yield b
        finally:
            b.close()


def test_dashboard_in_chromium(make_daemon, browser):
    d, url = start(make_daemon)
    dialogs: list[str] = []
    requested: list[str] = []
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.on("request", lambda request: requested.append(request.url))
    page.set_default_timeout(WAIT_MS)
    with corral.Client(f"{url}", token=TOKEN) as client:
        first = corral.Sandbox.create(memory_mb=64, tags=["ui-first"], client=client)
        try:
            # log in through the form
            page.goto(f"{url}/ui")
            assert page.url.endswith("/ui/login")
            page.fill("#token", TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url(f"{url}/ui")
            row = page.locator(f"tr[data-id='{first.id}']")
            row.wait_for()
            assert "ui-first" in row.inner_text()
            page.locator("#live.on").wait_for()  # the event stream is open

            # a sandbox made now shows up without a reload
            second = corral.Sandbox.create(memory_mb=64, tags=["ui-second"], client=client)
            page.locator(f"tr[data-id='{second.id}']").wait_for()

            # its delete button deletes it (as the SDK sees)
            page.click(f"tr[data-id='{first.id}'] button[data-action=delete]")
            page.locator(f"tr[data-id='{first.id}']").wait_for(state="detached")
            assert first.id not in {sb.id for sb in corral.Sandbox.list(client=client)}
            # and the stop button stops the other
            page.click(f"tr[data-id='{second.id}'] button[data-action=stop]")
            page.locator(f"tr[data-id='{second.id}'].state-stopped").wait_for()
            assert client.request("GET", f"/v1/sandboxes/{second.id}").json()["state"] == "stopped"

            # an evaluation run through corral.rl appears, with its progress and mean, live;
            # its name is markup an API client chose
            result: dict = {}

            def run() -> None:
                result["r"] = evaluate(
                    POLICY, "CartPole-v1", seeds=range(8), client=client, cache=False,
                    label=PLANTED, concurrency=2)

            worker = threading.Thread(target=run)
            worker.start()
            page.locator("article.eval").first.wait_for()  # while it runs, or once done
            worker.join(600)
            assert "r" in result, "the evaluation did not finish"
            run_box = page.locator("article.eval.state-done")
            run_box.wait_for()
            text = run_box.inner_text()
            assert PLANTED in text  # shown as text, not as an element
            assert "8 / 8 episodes" in text and f"{result['r'].mean:.4g}" in text
            assert run_box.locator("svg.histogram rect").count() >= 1
            assert page.locator("article.eval img").count() == 0

            # a planted filter in the URL is text too
            page.goto(f"{url}/ui?tenant=" + PLANTED.replace(" ", "%20"))
            page.locator("#live.on").wait_for()
            page.goto(f"{url}/ui")
            page.locator("article.eval.state-done").wait_for()
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            second.delete()
        finally:
            first.delete()

    assert page.evaluate("window.__pwned") is None  # no planted script ran
    assert dialogs == []
    assert requested and not [u for u in requested if TOKEN in u]  # no token in any URL
    cookies = page.context.cookies()
    session = [c for c in cookies if c["name"] == "corral_session"]
    assert session and session[0]["httpOnly"] and session[0]["sameSite"] == "Strict"
    assert TOKEN not in session[0]["value"]
    assert page.evaluate("document.cookie") == ""  # invisible to scripts


def test_a_sandboxs_page_and_its_terminal_in_chromium(make_daemon, browser):
    d, url = start(make_daemon)
    dialogs: list[str] = []
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.set_default_timeout(WAIT_MS)
    with corral.Client(f"{url}", token=TOKEN) as client:
        sb = corral.Sandbox.create(memory_mb=64, client=client)
        try:
            sb.files.write(f"/workspace/{PLANTED}", b"planted")
            page.goto(f"{url}/ui")
            page.fill("#token", TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url(f"{url}/ui")
            page.click(f"a[href='/ui/sandboxes/{sb.id}']")  # from the list to its page
            page.wait_for_url(f"{url}/ui/sandboxes/{sb.id}")
            assert PLANTED in page.locator("table.files").inner_text()  # shown as text
            page.click("#terminal-open")
            terminal = page.locator("#terminal")
            terminal.wait_for()
            page.wait_for_selector("#terminal:not(:empty)")  # the shell's prompt
            terminal.press_sequentially("echo $((6*7)) in the sandbox")
            terminal.press("Enter")
            page.locator("#terminal", has_text="42 in the sandbox").wait_for()
            page.screenshot(path=str(ARTIFACTS / "dashboard-sandbox-page.png"), full_page=True)
            assert not dialogs and page.evaluate("window.__pwned") is None
        finally:
            sb.delete()


def test_logout_and_revoke_end_the_pages_live_stream_in_chromium(make_daemon, browser):
    """Attack 2 of issue 23 in a real browser: a tenant's dashboard tab keeps watching
    while the same session logs out in another tab, or while the admin revokes the
    token of another session; its live stream ends (the browser's reconnect is refused)
    and its next action shows it is logged out. Before, the stream kept pushing for up
    to 600 s."""
    port = free_port()
    make_daemon("--tcp", f"127.0.0.1:{port}", "--token", TOKEN, "--on-revoke", "keep")
    url = f"http://127.0.0.1:{port}"
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    made = admin.post("/v1/tokens", json={"name": "watcher"})
    assert made.status_code == 201, made.text
    tenant = made.json()["token"]
    with corral.Client(url, token=tenant) as client:
        sb = corral.Sandbox.create(memory_mb=64, client=client)

    def watching(context):
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(f"{url}/ui")
        if page.url.endswith("/ui/login"):
            page.fill("#token", tenant)
            page.click("button[type=submit]")
            page.wait_for_url(f"{url}/ui")
        page.locator(f"tr[data-id='{sb.id}']").wait_for()
        page.locator("#live.on").wait_for()
        return page

    def ended_and_logged_out(page, refused) -> None:
        # the stream ended, and the browser's reconnect was refused (no new stream)
        page.locator("#live.off").wait_for()
        assert refused.value.status != 200
        # its next action shows it is logged out: the button fails, a reload lands on login
        page.click(f"tr[data-id='{sb.id}'] button[data-action=stop]")
        page.locator("#action-error:not([hidden])").wait_for()
        page.reload()
        assert page.url.endswith("/ui/login")

    def reconnect(page):
        return page.expect_response(lambda r: "/ui/events" in r.url and r.status != 200,
                                    timeout=WAIT_MS)

    try:
        # logout: two tabs of one session; the first logs out, the second was watching
        first = browser.new_context()
        leaving, watcher = watching(first), watching(first)
        with reconnect(watcher) as refused:
            leaving.click("#logout")
            leaving.wait_for_url(f"{url}/ui/login")
        ended_and_logged_out(watcher, refused)
        # revoke: another session of the same token, the admin revokes it
        second = browser.new_context()
        watcher = watching(second)
        with reconnect(watcher) as refused:
            assert admin.delete("/v1/tokens/watcher").status_code == 204
        ended_and_logged_out(watcher, refused)
        # nothing it clicked after reached the sandbox (kept: --on-revoke keep)
        assert admin.get(f"/v1/sandboxes/{sb.id}").json()["state"] == "running"
    finally:
        admin.delete(f"/v1/sandboxes/{sb.id}")
        admin.close()
