"""The request limits leave every legitimate request alone (docs/api.md, "Request
limits"); the attacks themselves are in tests/security/test_request_bounds.py."""

from __future__ import annotations

import base64
import resource

import pytest

import corral
from tests.conftest import requires_root
from tests.server.conftest import TEST_TAG, assert_error

pytestmark = [requires_root, pytest.mark.root]


def test_64_tags_and_integer_numbers_are_accepted(client):
    """The tag cap is 64; a JSON integer is a valid number (``cpus: 1``)."""
    tags = [TEST_TAG, *(f"limit-{i}" for i in range(63))]
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "cpus": 1, "timeout": 600,
                                               "tags": tags})
    assert reply.status_code == 201, reply.text
    try:
        assert reply.json()["spec"]["tags"] == tags
        assert reply.json()["spec"]["cpus"] == 1.0
    finally:
        client.delete(f"/v1/sandboxes/{reply.json()['id']}")
    reply = client.post("/v1/sandboxes", json={"tags": [*tags, "one-more"]})
    assert_error(reply, 400, "invalid_argument")  # 65 tags: before, any number passed


def test_open_files_above_the_daemons_hard_limit_is_a_typed_400(client):
    """Before: validation allowed up to 65536 and the sandbox failed to start (500)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # the daemon inherits ours
    if hard == resource.RLIM_INFINITY or hard >= 1 << 16:
        pytest.skip("the hard limit is not below the spec's own maximum")
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "open_files": hard + 1})
    error = assert_error(reply, 400, "invalid_argument")
    assert error["details"]["limit"] == hard
    assert error["details"]["errors"][0]["field"] == "open_files"


def test_a_non_utf8_file_name_is_listed_with_its_exact_bytes(client, sandbox, daemon):
    """Before: 500 (the JSON encoder met the surrogate-escaped name)."""
    made = client.post(f"/v1/sandboxes/{sandbox}/exec", json={
        "cmd": ["python3", "-c", "open(b'/workspace/bad\\xff.txt', 'w').write('x')"]})
    assert made.json()["returncode"] == 0, made.text
    reply = client.get(f"/v1/sandboxes/{sandbox}/files/list", params={"path": "/workspace"})
    assert reply.status_code == 200, reply.text
    (entry,) = [e for e in reply.json()["entries"] if "name_b64" in e]
    assert base64.b64decode(entry["name_b64"]) == b"bad\xff.txt"
    assert base64.b64decode(entry["path_b64"]) == b"/workspace/bad\xff.txt"
    assert entry["name"] == "bad\ufffd.txt"
    with corral.Client(f"unix://{daemon.socket}") as sdk:  # the SDK still parses it
        names = [f.name for f in corral.Sandbox.connect(sandbox, client=sdk).files.list(
            "/workspace")]
    assert "bad\ufffd.txt" in names


def test_the_largest_exchange_fits_the_json_limits(client):
    """4096 items (the exchange maximum) stay under the 65 536-value JSON cap."""
    items = [{"sandbox_id": "sb-0123456789ab", "process_id": f"proc-{i}", "data": "x\n"}
             for i in range(4096)]
    reply = client.post("/v1/processes/exchange", json={"items": items, "timeout": 1})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert len(results) == 4096 and all(r.get("error") for r in results)


def test_more_cpus_than_the_host_has_is_a_typed_400(client):
    import os

    cores = os.cpu_count() or 1
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "cpus": cores + 1})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["details"]["errors"][0]["field"] == "cpus" and error["details"]["limit"] == cores
    assert f"{cores} CPUs" in error["message"]
