"""The E2B front-end's credentials: the daemon's token as ``X-API-KEY`` for the control
API, and for envd a per-sandbox ``X-Access-Token`` that opens that sandbox only. A
wrong one never runs anything and never has its body read.
"""

from __future__ import annotations

import base64
import json
import socket
import struct

import httpx
import pytest

from tests.server.conftest import uds_client
from tests.server.test_compat_e2b import TOKEN, checked, live_sandboxes, serving


@pytest.fixture(scope="module")
def e2b():
    with serving() as d:
        yield d


@pytest.fixture
def e2b_ok(e2b):
    with checked(e2b) as d:
        yield d


def start_body(cmd: str) -> bytes:
    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}}).encode()
    return struct.pack(">BI", 0, len(msg)) + msg


def envd_start(d, sandbox_id: str, token: str | None, cmd: str) -> httpx.Response:
    headers = {"E2b-Sandbox-Id": sandbox_id, "Content-Type": "application/connect+json"}
    if token is not None:
        headers["X-Access-Token"] = token
    return httpx.post(f"{d.endpoint}/process.Process/Start", headers=headers,
                      content=start_body(cmd), timeout=30)


def created(d) -> dict:
    r = httpx.post(f"{d.endpoint}/v2/sandboxes", headers={"X-API-KEY": TOKEN},
                   json={"templateID": "base"}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()


def kill(d, sandbox_id: str) -> None:
    r = httpx.delete(f"{d.endpoint}/sandboxes/{sandbox_id}", headers={"X-API-KEY": TOKEN})
    assert r.status_code == 204


def ran(d, sandbox_id: str) -> bool:
    """Whether /tmp/ran exists in the sandbox (read over the native Unix socket)."""
    with uds_client(d.socket) as c:
        r = c.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "/tmp/ran"})
        return r.status_code == 200


def test_wrong_api_keys_are_refused(e2b_ok):
    for key in ("", "x", TOKEN[:-1], TOKEN + "0", TOKEN.upper()):
        r = httpx.post(f"{e2b_ok.endpoint}/v2/sandboxes", headers={"X-API-KEY": key},
                       json={"templateID": "base"}, timeout=30)
        assert r.status_code == 401, (key, r.text)
        assert r.json()["code"] == 401 and TOKEN not in r.text


def test_an_access_token_opens_its_own_sandbox_only(e2b_ok):
    a, b = created(e2b_ok), created(e2b_ok)
    try:
        for token in (None, "", b["envdAccessToken"][:-1], TOKEN, a["envdAccessToken"]):
            r = envd_start(e2b_ok, b["sandboxID"], token, "touch /tmp/ran")
            assert r.status_code == 401, (token, r.text)
            assert r.json()["code"] == "unauthenticated"
        assert not ran(e2b_ok, b["sandboxID"])
        r = envd_start(e2b_ok, b["sandboxID"], b["envdAccessToken"], "touch /tmp/ran")
        assert r.status_code == 200
        assert ran(e2b_ok, b["sandboxID"])  # the right one does run
    finally:
        kill(e2b_ok, a["sandboxID"])
        kill(e2b_ok, b["sandboxID"])


def test_envd_reaches_no_sandbox_made_outside_the_front_end(e2b_ok):
    """A native sandbox is not E2B's, even with a well-made token for its id."""
    import hashlib
    import hmac

    with uds_client(e2b_ok.socket) as c:
        native = c.post("/v1/sandboxes", json={}).json()["id"]
        try:
            mac = hmac.new(TOKEN.encode(), b"e2b-envd:admin\0" + native.encode(),
                           hashlib.sha256).hexdigest()
            token = f"admin.{mac}"  # as the door mints it (server/door.py)
            r = envd_start(e2b_ok, native, token, "touch /tmp/ran")
            assert b"was not found" in r.content
            assert not ran(e2b_ok, native)
            r = httpx.get(f"{e2b_ok.endpoint}/sandboxes/{native}",
                          headers={"X-API-KEY": TOKEN})
            assert r.status_code == 404
        finally:
            c.delete(f"/v1/sandboxes/{native}")


def test_the_body_of_a_refused_request_is_never_read(e2b_ok):
    for header in (b"X-API-KEY: wrong", b"E2b-Sandbox-Id: sb-x\r\nX-Access-Token: wrong"):
        with socket.create_connection(("127.0.0.1", e2b_ok.port), timeout=10) as s:
            s.sendall(b"POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\n" + header +
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
            reply = b""
            while chunk := s.recv(65536):  # ends: the daemon closes the connection
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
        assert b"connection: close" in reply.lower()


def test_user_other_than_the_sandbox_user_or_root_is_refused(e2b_ok):
    sb = created(e2b_ok)
    try:
        basic = base64.b64encode(b"nobody:").decode()
        r = httpx.post(f"{e2b_ok.endpoint}/process.Process/Start", content=start_body(
            "touch /tmp/ran"), headers={
                "E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"],
                "Content-Type": "application/connect+json", "Authorization": f"Basic {basic}"})
        assert b"permission_denied" in r.content
        assert not ran(e2b_ok, sb["sandboxID"])
    finally:
        kill(e2b_ok, sb["sandboxID"])


def test_code_interpreter_needs_the_sandbox_s_token(e2b_ok):
    a, b = created(e2b_ok), created(e2b_ok)
    try:
        base = {"E2b-Sandbox-Id": b["sandboxID"], "E2b-Sandbox-Port": "49999"}
        for extra in ({}, {"X-Access-Token": a["envdAccessToken"]},
                      {"E2B-Traffic-Access-Token": a["trafficAccessToken"]},
                      {"E2B-Traffic-Access-Token": b["envdAccessToken"] + "0"}):
            r = httpx.post(f"{e2b_ok.endpoint}/execute", headers={**base, **extra},
                           json={"code": "open('/tmp/ran', 'w')"}, timeout=30)
            assert r.status_code == 401, (extra, r.text)
            r = httpx.post(f"{e2b_ok.endpoint}/contexts", headers={**base, **extra}, json={})
            assert r.status_code == 401, (extra, r.text)
        assert not ran(e2b_ok, b["sandboxID"])
        r = httpx.post(f"{e2b_ok.endpoint}/contexts", json={}, headers={
            **base, "E2B-Traffic-Access-Token": b["trafficAccessToken"]})
        assert r.status_code == 200, r.text
    finally:
        kill(e2b_ok, a["sandboxID"])
        kill(e2b_ok, b["sandboxID"])


def test_the_api_key_does_not_open_the_native_api(e2b_ok):
    """A request with E2B's headers goes to E2B's routes whatever its path: the key
    is no way around the native API's bearer check (nor the reverse)."""
    r = httpx.get(f"{e2b_ok.endpoint}/v1/sandboxes", headers={"X-API-KEY": TOKEN})
    assert r.status_code == 501 and "E2B" in r.json()["message"]
    r = httpx.get(f"{e2b_ok.endpoint}/v2/sandboxes",
                  headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_e2b_is_no_way_around_allow_host_network(monkeypatch):
    """The front-end's CORRAL_COMPAT_NETWORK=host lets E2B ask for the host's network;
    the daemon's own --allow-host-network still decides (red team: it did not)."""
    monkeypatch.setenv("CORRAL_COMPAT_NETWORK", "host")
    with serving() as d:
        r = httpx.post(f"{d.endpoint}/v2/sandboxes", headers={"X-API-KEY": TOKEN},
                       json={"templateID": "base", "allow_internet_access": True}, timeout=60)
        assert r.status_code == 403, r.text
        assert "--allow-host-network" in r.text
        assert live_sandboxes(d) == set()


def test_a_run_waiting_on_a_context_its_last_client_left_gets_a_fresh_one(e2b_ok):
    """A run_code whose client timed out keeps the default context's kernel until the
    daemon sees the client gone and kills it; a run_code that came meanwhile waited for
    that kernel and got "KernelDied". Now it runs in a fresh default context."""
    import threading

    sb = created(e2b_ok)
    try:
        headers = {"E2b-Sandbox-Id": sb["sandboxID"], "E2b-Sandbox-Port": "49999",
                   "E2B-Traffic-Access-Token": sb["trafficAccessToken"]}
        url = f"{e2b_ok.endpoint}/execute"
        r = httpx.post(url, headers=headers, json={"code": "x = 41"}, timeout=60)
        assert r.status_code == 200, r.text
        second: list[str] = []
        with httpx.Client(timeout=60) as slow:
            with slow.stream("POST", url, headers=headers,
                             json={"code": "import time; time.sleep(600)"}) as first:
                lines = first.iter_lines()
                assert "number_of_executions" in next(lines)  # it holds the kernel now
                waiter = threading.Thread(target=lambda: second.append(httpx.post(
                    url, headers=headers, json={"code": "'x' in dir()"}, timeout=60).text))
                waiter.start()
                waiter.join(1.0)  # time for the second run to queue on the kernel
                assert waiter.is_alive()  # it waits for the kernel the first one holds
            # the first client left: its kernel is killed, the second run gets a new one
        waiter.join(60)
        assert second, "the second run_code did not answer"
        replies = [json.loads(line) for line in second[0].splitlines() if line]
        assert not [m for m in replies if m.get("type") == "error"], replies
        assert [m.get("text") for m in replies if m.get("type") == "result"] == ["False"]
    finally:
        kill(e2b_ok, sb["sandboxID"])
