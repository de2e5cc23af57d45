"""Warm pools through the HTTP API of a real daemon (see docs/api.md)."""

from __future__ import annotations

import secrets
import time

import pytest

from tests.conftest import requires_root
from tests.server.conftest import TEST_TAG, assert_error, uds_client

pytestmark = [requires_root, pytest.mark.root]

POLLS = 600  # x 0.05 s: the bound of every "until" below


def until(predicate, what: str):
    for _ in range(POLLS):
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never reached: {what}")


@pytest.fixture
def pool(client):
    """A fresh pool name; the pool is deleted after the test whatever happened."""
    name = f"srv-{secrets.token_hex(3)}"
    yield name
    client.delete(f"/v1/pools/{name}")


def make_pool(client, name: str, **fields) -> dict:
    body = {"name": name, "spec": {"memory_mb": 64, "tags": [TEST_TAG]}, **fields}
    reply = client.post("/v1/pools", json=body)
    assert reply.status_code == 201, reply.text
    return reply.json()


def pool_ids(client, name: str) -> set[str]:
    reply = client.get("/v1/sandboxes", params={"tag": f"pool={name}"})
    return {s["id"] for s in reply.json()["sandboxes"]}


def stats(client, name: str) -> dict:
    reply = client.get(f"/v1/pools/{name}")
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_pool_lifecycle_acquire_info_and_delete(client, pool):
    made = make_pool(client, pool, min_ready=2, max_size=4)
    assert made["name"] == pool and made["min_ready"] == 2 and made["max_size"] == 4
    assert made["spec"]["tags"] == [TEST_TAG, f"pool={pool}"]
    until(lambda: stats(client, pool)["ready"] == 2, "two ready")
    assert pool in [p["name"] for p in client.get("/v1/pools").json()["pools"]]

    handed = []
    for _ in range(3):
        reply = client.post(f"/v1/pools/{pool}/acquire", json={"timeout": 30})
        assert reply.status_code == 200, reply.text
        sb = reply.json()
        assert sb["state"] == "running" and f"pool={pool}" in sb["spec"]["tags"]
        assert sb["id"] not in handed
        assert sb["id"] in stats(client, pool)["acquired_ids"]
        ran = client.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "echo ok"}).json()
        assert ran["stdout"] == "ok\n"
        assert client.delete(f"/v1/sandboxes/{sb['id']}").status_code == 204
        handed.append(sb["id"])
    assert stats(client, pool)["acquired_ids"] == []  # deleting freed their places

    ready = until(
        lambda: (s := stats(client, pool))["ready"] == 2 and s["starting"] == 0 and s, "refilled"
    )
    assert not set(handed) & set(ready["ready_ids"]), "a used sandbox came back"
    assert ready["acquires"] == 3 and ready["acquire_wait_ms_p50"] > 0
    info = client.get("/v1/info").json()
    listed = {p["name"]: p for p in info["pools"]}
    assert listed[pool]["ready"] == 2 and listed[pool]["max_size"] == 4
    assert pool_ids(client, pool) == set(ready["ready_ids"])

    assert client.delete(f"/v1/pools/{pool}").status_code == 204
    assert pool_ids(client, pool) == set(), "deleting the pool left sandboxes behind"
    assert client.delete(f"/v1/pools/{pool}").status_code == 204  # idempotent
    error = assert_error(client.get(f"/v1/pools/{pool}"), 404, "not_found")
    assert error["details"] == {"pool": pool} and "create it again" in error["message"]
    assert_error(client.post(f"/v1/pools/{pool}/acquire", json={}), 404, "not_found")
    assert pool not in [p["name"] for p in client.get("/v1/info").json()["pools"]]


def test_acquire_beyond_max_size_waits_then_fails(client, pool):
    make_pool(client, pool, min_ready=0, max_size=1)
    held = client.post(f"/v1/pools/{pool}/acquire", json={"timeout": 30})
    assert held.status_code == 200, held.text
    try:
        late = client.post(f"/v1/pools/{pool}/acquire", json={"timeout": 0.3})
        error = assert_error(late, 503, "capacity_exceeded")
        assert error["details"]["pool"] == pool and error["details"]["limit"] == "max_size"
        assert error["details"]["value"] == 1
    finally:
        client.delete(f"/v1/sandboxes/{held.json()['id']}")
    again = client.post(f"/v1/pools/{pool}/acquire", json={"timeout": 30})
    assert again.status_code == 200, again.text
    client.delete(f"/v1/sandboxes/{again.json()['id']}")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"min_ready": 3, "max_size": 2}, 400, "invalid_argument"),
        ({"max_size": 0}, 400, "invalid_argument"),
        ({"spec": {"memory_mb": 1}}, 400, "invalid_argument"),
        ({"surprise": 1}, 400, "invalid_argument"),
        ({"name": "has space"}, 400, "invalid_argument"),
        ({"spec": {"image": "no-such-image"}}, 404, "image_not_found"),
    ],
)
def test_bad_pools_are_refused(client, body, status, code):
    before = client.get("/v1/pools").json()["pools"]
    assert_error(client.post("/v1/pools", json=body), status, code)
    assert client.get("/v1/pools").json()["pools"] == before


def test_pool_names_are_unique_and_acquire_requests_checked(client, pool):
    make_pool(client, pool, min_ready=0, max_size=1)
    error = assert_error(client.post("/v1/pools", json={"name": pool}), 409, "invalid_state")
    assert error["details"] == {"pool": pool}
    for body in ({"timeout": 0}, {"timeout": "soon"}, {"wait": 1}):
        assert_error(client.post(f"/v1/pools/{pool}/acquire", json=body), 400, "invalid_argument")
    named = client.post("/v1/pools", json={"min_ready": 0, "max_size": 1})
    assert named.status_code == 201 and named.json()["name"].startswith("pool-")
    assert client.delete(f"/v1/pools/{named.json()['name']}").status_code == 204


def test_refills_pass_admission_control(make_daemon):
    d = make_daemon("--max-sandboxes", "2", "--queue-timeout", "0.2")
    with uds_client(d.socket) as c:
        reply = c.post(
            "/v1/pools", json={"name": "capped", "spec": {"memory_mb": 64}, "min_ready": 4}
        )
        assert reply.status_code == 201, reply.text
        s = until(
            lambda: (s := stats(c, "capped"))["ready"] == 2 and s["last_error"] and s,
            "two ready, then a refill refused",
        )
        assert "max_sandboxes" in s["last_error"] and s["failed"] >= 1
        info = c.get("/v1/info").json()
        assert info["counts"]["running"] <= 2
        # A ready sandbox is handed out without waiting for room: it already exists.
        got = c.post("/v1/pools/capped/acquire", json={"timeout": 30})
        assert got.status_code == 200, got.text
        assert c.delete("/v1/pools/capped").status_code == 204
        c.delete(f"/v1/sandboxes/{got.json()['id']}")
        assert c.get("/v1/info").json()["counts"]["running"] == 0


def test_daemon_shutdown_deletes_pools_ready_sandboxes(make_daemon):
    d = make_daemon()
    with uds_client(d.socket) as c:
        c.post("/v1/pools", json={"name": "p", "spec": {"memory_mb": 64}, "min_ready": 2})
        until(lambda: stats(c, "p")["ready"] == 2, "two ready")
    d.stop()
    assert d.proc.returncode == 0 and "Traceback" not in d.log.read_text()
    d.start()  # the same state directory: deleted, not merely stopped, and no pool
    with uds_client(d.socket) as c:
        assert pool_ids(c, "p") == set()
        assert_error(c.get("/v1/pools/p"), 404, "not_found")
