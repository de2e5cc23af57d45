"""A hostile TCP client against /metrics and the JSON request log.

- Names a client chooses (pool names, tags) must not multiply the series a scrape
  returns: a Prometheus server fed millions of series falls over.
- /metrics without the admin token is refused like every other route.
- The JSON request log never holds a token, whatever path or header carries it, nor
  the raw path of a request no route took.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest

from corral.server.metrics import MAX_LABELLED, OTHER
from tests.conftest import Daemon
from tests.server.conftest import TEST_TAG, uds_client
from tests.server.test_metrics import scrape, tcp_daemon_with, value

TOKEN = "log-and-metrics-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def daemon_json():
    """A daemon on TCP with a token, logging JSON lines (debug: every record)."""
    with tcp_daemon_with(TOKEN, "--log-format", "json", "--log-level", "debug") as d:
        yield d


def log_lines(d: Daemon, since: int) -> list[dict]:
    with open(d.log, "rb") as f:
        f.seek(since)
        text = f.read().decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def access_lines(d: Daemon, since: int, count: int) -> list[dict]:
    """The request lines logged since ``since``, once ``count`` are there."""
    deadline = time.monotonic() + 60
    while True:
        lines = [e for e in log_lines(d, since) if e["logger"] == "corral.access"]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_hostile_pool_names_and_tags_do_not_multiply_series(daemon_json):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    pools = [f"p{i:03d}-{secrets.token_hex(4)}" for i in range(MAX_LABELLED + 20)]
    with httpx.Client(base_url=f"http://127.0.0.1:{daemon_json.port}", headers=auth,
                      timeout=60) as tcp:
        made: list[str] = []
        try:
            first = tcp.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG]})
            made.append(first.json()["id"])
            before = scrape(tcp)
            for name in pools:
                body = {"name": name, "spec": {"memory_mb": 64}, "min_ready": 0}
                assert tcp.post("/v1/pools", json=body).status_code == 201
            for _ in range(3):
                tags = [TEST_TAG, *(secrets.token_hex(8) for _ in range(5))]
                reply = tcp.post("/v1/sandboxes", json={"memory_mb": 64, "tags": tags})
                assert reply.status_code == 201, reply.text
                made.append(reply.json()["id"])
            after = scrape(tcp)
            pool_series = [dict(labels)["pool"] for name, labels in after
                           if name == "corral_pool_ready"]
            assert len(pool_series) == MAX_LABELLED and OTHER in pool_series
            assert value(after, "corral_pool_ready", pool=OTHER) == 0
            others = {k for k in after if k[0] != "corral_pool_ready"}
            assert others == {k for k in before if k[0] != "corral_pool_ready"}  # tags: none
            assert not any(tag in str(after) for tag in tags)
        finally:
            for sid in made:
                tcp.delete(f"/v1/sandboxes/{sid}")
            for name in pools:
                tcp.delete(f"/v1/pools/{name}")


def test_metrics_refuse_a_missing_or_wrong_token(daemon_json):
    with httpx.Client(base_url=f"http://127.0.0.1:{daemon_json.port}", timeout=30) as tcp:
        for headers in ({}, {"Authorization": f"Bearer {TOKEN}x"},
                        {"Authorization": f"Basic {TOKEN}"}, {"X-API-Key": TOKEN[:-1]}):
            reply = tcp.get("/metrics", headers=headers)
            assert reply.status_code == 401, headers
            assert "corral_" not in reply.text


def test_the_request_log_names_routes_never_paths_or_tokens(daemon_json):
    since = daemon_json.log.stat().st_size
    base = f"http://127.0.0.1:{daemon_json.port}"
    secret_path = "/v1/" + secrets.token_hex(12)
    with httpx.Client(base_url=base, timeout=60) as tcp:
        r = tcp.post(f"/sandboxfusion/{TOKEN}/run_code",
                     json={"code": "print(1)", "language": "python"})
        assert r.status_code == 200, r.text
        assert tcp.post("/sandboxfusion/not-the-token/run_code", json={}).status_code in (
            401, 403)
        assert tcp.get(secret_path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code \
            == 404
        assert tcp.get("/v1/sandboxes", headers={"Authorization": f"Bearer {TOKEN}x"}) \
            .status_code == 401
        sid = tcp.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG]},
                       headers={"Authorization": f"Bearer {TOKEN}"}).json()["id"]
        tcp.delete(f"/v1/sandboxes/{sid}", headers={"Authorization": f"Bearer {TOKEN}"})
    lines = access_lines(daemon_json, since, 6)
    text = daemon_json.log.read_bytes()[since:].decode()
    assert TOKEN not in text and "not-the-token" not in text
    assert secret_path not in text and sid not in json.dumps(lines)
    routes = [(e["method"], e["route"], e["status"]) for e in lines]
    assert routes[:6] == [
        ("POST", "/sandboxfusion/{token}/run_code", 200),
        ("POST", "/sandboxfusion/{token}/run_code", routes[1][2]),
        ("GET", None, 404),
        ("GET", None, 401),
        ("POST", "/v1/sandboxes", 201),
        ("DELETE", "/v1/sandboxes/{sandbox_id}", 204),
    ]
    for e in lines:
        assert set(e) >= {"time", "tenant", "method", "route", "status", "duration_ms"}
        assert isinstance(e["duration_ms"], float) and e["duration_ms"] >= 0
    assert lines[3]["tenant"] is None and lines[4]["tenant"] == "admin"


def test_every_line_of_the_daemon_log_is_json(daemon_json):
    with uds_client(daemon_json.socket) as c:
        assert c.get("/v1/info").status_code == 200
    lines = log_lines(daemon_json, 0)  # json.loads on each: raises on a plain line
    assert any(e["logger"] == "corral.server" and "listening" in e["message"] for e in lines)
    assert all(e["time"].endswith("Z") and e["level"] for e in lines)
