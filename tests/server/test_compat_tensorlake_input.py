"""What the Tensorlake front-end accepts: strict types, bounded sizes, any file name.

Before, its request models coerced like pydantic's lax mode (``"512"`` became 512,
``true`` became 1, ``0`` became false) and bounded nothing but the JSON itself; now a
mistyped or oversized field is a 400 ``invalid_argument`` in Tensorlake's flat error
shape, naming the field. Fields the models do not know are ignored, as Tensorlake's
server does (a newer client may send more).
"""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.server.test_compat_tensorlake import TOKEN, checked, run_script, serving

pytest.importorskip("tensorlake.sandbox", reason="the compat extra (tensorlake) is not installed")

LONG = "x" * 5000


@pytest.fixture(scope="module")
def tl():
    with serving() as d:
        yield d


@pytest.fixture
def http(tl):
    """A client of the daemon; afterwards no traceback in its log and no sandbox left
    (a create that should have been refused leaves one)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with checked(tl), httpx.Client(base_url=tl.api_url, headers=auth, timeout=120) as c:
        yield c


def assert_invalid(reply: httpx.Response, field: str) -> None:
    """A 400 ``invalid_argument`` in Tensorlake's flat shape, naming ``field``."""
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["code"] == "invalid_argument", body
    fields = [e["field"] for e in body["details"]["errors"]]
    assert any(f == field or f.startswith(field + ".") for f in fields), (field, body)


CREATE_CASES = [
    ({"resources": {"memory_mb": "512"}}, "resources.memory_mb"),
    ({"resources": {"memory_mb": 512.0}}, "resources.memory_mb"),
    ({"resources": {"disk_mb": True}}, "resources.disk_mb"),
    ({"resources": {"cpus": "1"}}, "resources.cpus"),
    ({"resources": {"cpus": True}}, "resources.cpus"),
    ({"timeout_secs": "600"}, "timeout_secs"),
    ({"timeout_secs": True}, "timeout_secs"),
    ({"timeout_secs": 10**30}, "timeout_secs"),
    ({"network": {"allow_internet_access": 0}}, "network.allow_internet_access"),
    ({"network": {"allow_internet_access": "false"}}, "network.allow_internet_access"),
    ({"wait": "false"}, "wait"),
    ({"wait": 0}, "wait"),
    ({"auto_resume": 1}, "auto_resume"),
    ({"image": 5}, "image"),
    ({"image": LONG}, "image"),
    ({"name": LONG}, "name"),
    ({"snapshot_id": LONG}, "snapshot_id"),
    ({"entrypoint": ["sh"] * 300}, "entrypoint"),
    ({"exposed_ports": ["8080"]}, "exposed_ports"),
    ({"network": {"allow_out": ["10.0.0.0/8"] * 300}}, "network.allow_out"),
]


@pytest.mark.parametrize(("body", "field"), CREATE_CASES, ids=[c[1] + "=" + repr(c[0])[:40]
                                                            for c in CREATE_CASES])
def test_create_fields_are_strict_and_bounded(http, body, field):
    body = {"resources": {"memory_mb": 64}, **body} if "resources" not in body else body
    for prefix in ("", "/v1/namespaces/default"):
        assert_invalid(http.post(prefix + "/sandboxes", json=body), field)


@pytest.mark.parametrize(("body", "field"), [
    ({"warm_containers": "1"}, "warm_containers"),
    ({"warm_containers": True}, "warm_containers"),
    ({"max_containers": "2"}, "max_containers"),
    ({"resources": {"memory_mb": "64"}}, "resources.memory_mb"),
])
def test_pool_fields_are_strict(http, body, field):
    body = {"image": "python", "resources": {"memory_mb": 64}, **body}
    assert_invalid(http.post("/sandbox-pools", json=body), field)
    assert http.get("/sandbox-pools").json()["pools"] == []


def test_unknown_fields_are_ignored_like_tensorlakes_server(http):
    made = http.post("/sandboxes", json={"resources": {"memory_mb": 64, "future": 1},
                                         "from_a_newer_client": {"x": True}})
    assert made.status_code == 200, made.text
    assert http.delete(f"/sandboxes/{made.json()['sandbox_id']}").status_code == 200


def test_in_sandbox_bodies_are_strict_and_bounded(http):
    made = http.post("/sandboxes", json={"resources": {"memory_mb": 64}})
    sid = made.json()["sandbox_id"]
    host = {"Host": f"{sid}.local"}
    try:
        started = http.post("/api/v1/processes", headers=host,
                            json={"command": "sleep", "args": ["300"]})
        pid = started.json()["pid"]
        for body, field in (
            ({"command": "echo", "timeout": "5"}, "timeout"),
            ({"command": "echo", "timeout": True}, "timeout"),
            ({"command": "echo", "args": [1]}, "args.0"),
            ({"command": "echo", "args": ["a"] * 5000}, "args"),
            ({"command": LONG}, "command"),
            ({"command": "echo", "env": {"A": 1}}, "env"),
            ({"command": "echo", "working_dir": 7}, "working_dir"),
        ):
            for path in ("/api/v1/processes/run", "/api/v1/processes"):
                assert_invalid(http.post(path, headers=host, json=body), field)
        for bad in ("15", True, 15.0):
            reply = http.post(f"/api/v1/processes/{pid}/signal", headers=host,
                              json={"signal": bad})
            assert_invalid(reply, "signal")
        listed = http.get("/api/v1/processes", headers=host).json()["processes"]
        assert [(p["pid"], p["status"]) for p in listed] == [(pid, "running")]
        snap = http.post(f"/sandboxes/{sid}/snapshot", json={"snapshot_type": 1})
        assert_invalid(snap, "snapshot_type")
    finally:
        assert http.delete(f"/sandboxes/{sid}").status_code == 200


def test_listing_a_name_that_is_not_utf8(tl, http):
    """Any bytes may name a file. The entry comes back with U+FFFD for the bad bytes
    and ``name_b64`` with the exact ones, as on the native API; the client lists it."""
    out = run_script(
        tl,
        """
        sb = Sandbox.create(memory_mb=64)
        r = sb.run("python3", ["-c", "import os; os.makedirs(b'/workspace/d');"
                                     "open(b'/workspace/d/bad\\\\xff.txt', 'w').write('x');"
                                     "open(b'/workspace/d/ok.txt', 'w').write('y')"])
        out["made"] = r.exit_code
        out["names"] = sorted(e.name for e in sb.list_directory("/workspace/d").entries)
        out["sid"] = sb.sandbox_id
        """,
    )
    assert out["made"] == 0
    assert out["names"] == ["bad\ufffd.txt", "ok.txt"]
    sid = out["sid"]
    try:
        reply = http.get("/api/v1/files/list", headers={"Host": f"{sid}.local"},
                         params={"path": "/workspace/d"})
        assert reply.status_code == 200, reply.text
        entries = {e["name"]: e for e in reply.json()["entries"]}
        assert base64.b64decode(entries["bad\ufffd.txt"]["name_b64"]) == b"bad\xff.txt"
        assert "name_b64" not in entries["ok.txt"]
    finally:
        assert http.delete(f"/sandboxes/{sid}").status_code == 200
