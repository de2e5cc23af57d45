"""Attack 8 of issue 23: wrong credentials were never throttled (13-15 guesses a second
on the login form and on bearer auth), and a 9-character admin token was accepted
without a word. Now failures are counted per client address and per name
(:mod:`corral.server.auth_throttle`): past a few, a blocked guesser gets 429 before its
credential is even checked, while the admin (another address, one that used the token
before, or the Unix socket) keeps working. Real daemon, real sockets, loopback sources
of their own; counts are asserted, never times.
"""

from __future__ import annotations

import httpx
import pytest

from corral.server.auth_throttle import FREE_FAILURES, NAME_FREE_FAILURES
from tests.conftest import have_root_runtime
from tests.security.edge_daemon import (
    AUTH,
    HANG_GUARD_S,
    TOKEN,
    burst,
    get_info,
    served,
    source,
)
from tests.server.conftest import uds_client

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason="needs root (a real daemon)")

GUESSES = 60
# each block doubles (1, 2, 4, ... s) and a failure leaks away every 2 s: a burst of
# GUESSES could pass at most this many more checks even if each request took a second
MAX_CHECKED = FREE_FAILURES + 10


def _from(daemon, src: str, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=daemon.base, timeout=HANG_GUARD_S,
                        transport=httpx.HTTPTransport(local_address=src), **kwargs)


def test_bearer_guesses_from_one_address_are_refused_unchecked():
    with served() as daemon:
        with _from(daemon, source(0)) as guesser:
            first = [guesser.get("/v1/info", headers={
                "Authorization": f"Bearer guess-{i:04d}-" + "x" * 40}).status_code
                for i in range(FREE_FAILURES)]
            assert first == [401] * FREE_FAILURES
            statuses = first + burst(daemon.port, [source(0)] * (GUESSES - FREE_FAILURES), [
                get_info(f"guess-{i:04d}-" + "y" * 40) for i in range(GUESSES - FREE_FAILURES)])
            print("statuses:", statuses)
            assert statuses.count(401) <= MAX_CHECKED
            assert statuses.count(429) >= GUESSES - MAX_CHECKED
            # refused before the check: even the right token gets no answer from there
            blocked = guesser.get("/v1/info", headers=AUTH)
            assert blocked.status_code == 429 and int(blocked.headers["retry-after"]) >= 1
            assert blocked.json()["error"]["code"] == "too_many_requests"
        with _from(daemon, source(1), headers=AUTH) as admin:  # another address
            assert admin.get("/v1/info").status_code == 200
        with uds_client(daemon.daemon.socket) as local:  # the Unix socket: never throttled
            assert local.get("/v1/info").status_code == 200


def test_guesses_spread_over_addresses_do_not_lock_out_the_admin():
    with served() as daemon:
        with _from(daemon, source(0), headers=AUTH) as admin:
            assert admin.get("/v1/info").status_code == 200  # this address knows the token
            guesses = NAME_FREE_FAILURES + 40  # one guess per fresh address, all at once
            statuses = burst(daemon.port, [source(10 + i) for i in range(guesses)],
                             [get_info(f"{i:04d}" * 10) for i in range(guesses)])
            print("statuses:", statuses)
            assert statuses.count(401) <= NAME_FREE_FAILURES + 10
            assert statuses.count(429) >= 30  # the admin token's name: blocked for strangers
            assert admin.get("/v1/info").status_code == 200  # not for the admin's machine


def _login_form(token: str) -> bytes:
    body = f"token={token}".encode()
    return (b"POST /ui/login HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_the_login_form_is_throttled_too():
    with served() as daemon:
        statuses = burst(daemon.port, [source(0)] * GUESSES,
                         [_login_form(f"wrong-{i:04d}") for i in range(GUESSES)])
        print("statuses:", statuses)
        assert statuses.count(401) <= MAX_CHECKED
        assert statuses.count(429) >= GUESSES - MAX_CHECKED
        with _from(daemon, source(0), follow_redirects=False) as browser:
            page = browser.post("/ui/login", data={"token": TOKEN})
            assert page.status_code == 429 and "too many failed logins" in page.text
        with _from(daemon, source(1), follow_redirects=False) as other:
            assert other.post("/ui/login", data={"token": TOKEN}).status_code == 303


def test_requests_without_credentials_and_good_ones_are_not_counted():
    with served() as daemon:
        with _from(daemon, source(0)) as client:
            for _ in range(GUESSES):
                assert client.get("/v1/info").status_code == 401  # no credential: no guess
                assert client.get("/v1/info", headers=AUTH).status_code == 200


def test_a_short_admin_token_is_warned_about():
    with served("--token", "nine-char") as daemon:
        assert "is only 9 characters" in daemon.log()
    with served() as daemon:
        assert "characters: anyone who reaches" not in daemon.log()


def test_a_decoy_credential_header_does_not_dodge_the_name_block():
    """Red team (after issue 23): the throttle named a request's guess by the first
    credential header it found, while the door checked the ``Authorization`` bearer:
    each guess at the admin token sent with a fresh decoy ``X-Access-Token: N.x`` counted
    against "the sandbox tokens of N", so the admin token's name was never blocked, from
    any number of addresses. Now the throttle counts what the door checks."""
    with served() as daemon:
        guesses = NAME_FREE_FAILURES + 40  # one guess per fresh address, all at once
        requests = [(f"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Access-Token: decoy{i}.x\r\n"
                     f"Authorization: Bearer {i:04d}{'z' * 40}\r\nConnection: close\r\n\r\n"
                     ).encode() for i in range(guesses)]
        statuses = burst(daemon.port, [source(10 + i) for i in range(guesses)], requests)
        print("statuses:", statuses)
        assert statuses.count(401) <= NAME_FREE_FAILURES + 10
        assert statuses.count(429) >= 30  # was: 0 (every guess checked)


def test_a_forwarded_for_header_does_not_make_a_guesser_someone_else():
    """uvicorn's defaults trusted ``X-Forwarded-For`` from 127.0.0.1 (its
    ``proxy_headers``): a guesser on the host's loopback named a new address in each
    request and was never throttled. The daemon sits behind no proxy it knows of: the
    connection's own address counts."""
    with served() as daemon:
        requests = [
            (f"GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer guess-{i:04d}-"
             + "z" * 40 + f"\r\nX-Forwarded-For: 203.0.113.{1 + i}\r\n"
             "Connection: close\r\n\r\n").encode() for i in range(GUESSES)]
        statuses = []
        for start in range(0, GUESSES, 10):  # one source, a new claimed address each
            statuses += burst(daemon.port, ["127.0.0.1"] * 10, requests[start:start + 10])
        print("statuses:", statuses)
        assert statuses.count(401) <= MAX_CHECKED
        assert statuses.count(429) >= GUESSES - MAX_CHECKED
