"""The SandboxFusion endpoints take the daemon's token in their path, since their
clients (verl, ``sandbox-fusion``) send no credentials. A wrong token must never run
anything, never have its body read, and the token must never reach a log line.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.server.conftest import uds_client
from tests.server.test_compat_sandboxfusion import TOKEN, checked, leftovers, serving


@pytest.fixture(scope="module")
def sf():
    with serving("--log-level", "debug") as d:  # debug: uvicorn's access log is on
        yield d


@pytest.fixture
def sf_ok(sf):
    with checked(sf) as d:
        yield d


def pool_counts(d) -> dict[str, int]:
    with uds_client(d.socket) as c:
        return {p["name"]: p["acquires"] for p in c.get("/v1/pools").json()["pools"]}


def test_wrong_tokens_never_run(sf_ok):
    base = f"http://127.0.0.1:{sf_ok.port}/sandboxfusion/"
    before = pool_counts(sf_ok)
    body = {"code": "open('/tmp/ran', 'w')", "language": "python"}
    for token in ("", "x", TOKEN[:-1], TOKEN + "0", TOKEN.upper(), "%2e%2e", TOKEN + "%00"):
        for endpoint in ("run_code", "run_jupyter"):
            r = httpx.post(f"{base}{token}/{endpoint}", json=body, timeout=30)
            assert r.status_code in (401, 404), (token, endpoint, r.text)
            assert TOKEN not in r.text
    assert pool_counts(sf_ok) == before  # no sandbox was taken for any of them
    assert leftovers(sf_ok) == set()


def test_the_body_of_a_refused_request_is_never_read(sf_ok):
    """A wrong token is answered at once and the connection closed, although the
    request announces 100 MB it has not sent."""
    with socket.create_connection(("127.0.0.1", sf_ok.port), timeout=10) as s:
        s.sendall(b"POST /sandboxfusion/wrong/run_code HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):  # ends: the daemon closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"connection: close" in reply.lower()


def test_only_the_two_endpoints_skip_the_bearer_token(sf_ok):
    """Other paths under the prefix, even with the right token in them, are the native
    API's and need ``Authorization: Bearer``; the path never leaks the token."""
    base = f"http://127.0.0.1:{sf_ok.port}/sandboxfusion/{TOKEN}"
    for path in ("/get_prompts", "/v1/sandboxes", "/run_code/x", ""):
        r = httpx.post(base + path, json={}, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert TOKEN not in r.text
    r = httpx.get(base + "/run_code", timeout=30)  # the right path, a wrong method
    assert r.status_code == 405 and TOKEN not in r.text


def test_the_token_never_reaches_the_log(sf_ok):
    r = httpx.post(f"http://127.0.0.1:{sf_ok.port}/sandboxfusion/{TOKEN}/run_code",
                   json={"code": "print(1)", "language": "python"}, timeout=60)
    assert r.json()["status"] == "Success", r.text
    httpx.post(f"http://127.0.0.1:{sf_ok.port}/sandboxfusion/{TOKEN}/run_code",
               content=b"{bad", timeout=30)
    log = sf_ok.log.read_bytes()
    assert b"/sandboxfusion/TOKEN/run_code" in log  # the access log is on, and redacted
    assert TOKEN.encode() not in log


def test_a_cell_cannot_hand_back_fewer_results_than_cells(sf_ok):
    """run_jupyter's results come from the cells' own process (see docs/api.md): a cell
    that rewrites them at exit to drop the failing cells gets Failed, not Success."""
    forged = (  # the results file is the kernel's /tmp/kernel-<nonce>.out
        "import atexit, glob, json\n"
        "def empty():\n"
        "    for path in glob.glob('/tmp/kernel-*.out'):\n"
        "        open(path, 'w').write(json.dumps({'cells': []}))\n"
        "atexit.register(empty)\n"
    )
    r = httpx.post(f"{sf_ok.endpoint}/run_jupyter", timeout=120,
                   json={"cells": [forged, "assert 1 == 2, 'tests failed'"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] != "Success" or any(c.get("error") for c in body.get("cells", [])), body
