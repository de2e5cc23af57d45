"""Clients for the real daemons of tests/conftest.py, and a sandbox to work in."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

TEST_TAG = "test-server"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a load test (hundreds of sandboxes)")


def uds_client(path: Path, **kwargs) -> httpx.Client:
    """A client for a daemon's Unix socket."""
    transport = httpx.HTTPTransport(uds=str(path))
    return httpx.Client(transport=transport, base_url="http://corral", timeout=60, **kwargs)


def async_uds_client(path: Path, **kwargs) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(
        uds=str(path), limits=kwargs.pop("limits", None) or httpx.Limits()
    )
    return httpx.AsyncClient(transport=transport, base_url="http://corral", timeout=120, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sandbox_ids(client: httpx.Client) -> set[str]:
    reply = client.get("/v1/sandboxes")
    assert reply.status_code == 200, reply.text
    return {s["id"] for s in reply.json()["sandboxes"]}


def assert_error(reply: httpx.Response, status: int, code: str) -> dict:
    """The reply is the error ``code`` with ``status``, in the one error shape."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and isinstance(error["details"], dict)
    return error


@pytest.fixture
def client(daemon):
    """A client of the shared daemon; the daemon must log no traceback meanwhile."""
    logged = daemon.log.stat().st_size
    with uds_client(daemon.socket) as c:
        yield c
    with open(daemon.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: see {daemon.log}"


@pytest.fixture
def sandbox(client):
    """A running sandbox (64 MB), deleted afterwards; its id."""
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG]})
    assert reply.status_code == 201, reply.text
    sid = reply.json()["id"]
    yield sid
    client.delete(f"/v1/sandboxes/{sid}")
