"""A real daemon on TCP for the dashboard's tests, and logging in to its ``/ui``."""

from __future__ import annotations

import re

import httpx

from tests.server.conftest import free_port

TOKEN = "dashboard-test-token-5f1c"
PLANTED = '<img src=x onerror="alert(1)">'  # markup a sandbox or client plants
HTML = {"Accept": "text/html"}


def start(make_daemon):
    """``(daemon, base_url)``: a daemon listening on loopback TCP with :data:`TOKEN`."""
    port = free_port()
    d = make_daemon("--tcp", f"127.0.0.1:{port}", "--token", TOKEN)
    return d, f"http://127.0.0.1:{port}"


def login(client: httpx.Client) -> str:
    """Log ``client`` in with the form; the page's CSRF token."""
    reply = client.post("/ui/login", data={"token": TOKEN})
    assert reply.status_code == 303, reply.text
    page = client.get("/ui", headers={"Accept": "text/html"})
    assert page.status_code == 200, page.text
    return re.search(r'name="csrf-token" content="([^"]+)"', page.text).group(1)
