"""Bad requests get a typed error in the one error shape, and leave nothing behind."""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import requires_root
from tests.server.conftest import assert_error, sandbox_ids

pytestmark = [requires_root, pytest.mark.root]

UNKNOWN = "/v1/sandboxes/sb-0123456789ab"
GIB = 1 << 30


@pytest.fixture
def unchanged(client):
    """No request of the test may leave a sandbox behind (or remove one)."""
    before = sandbox_ids(client)
    yield
    assert sandbox_ids(client) == before


# (method, path, keyword arguments for httpx, status, code, fields named in details)
CASES = [
    ("GET", UNKNOWN, {}, 404, "sandbox_not_found", ()),
    ("POST", UNKNOWN + "/pause", {}, 404, "sandbox_not_found", ()),
    ("POST", UNKNOWN + "/stop", {}, 404, "sandbox_not_found", ()),
    ("POST", UNKNOWN + "/exec", {"json": {"cmd": "true"}}, 404, "sandbox_not_found", ()),
    ("GET", UNKNOWN + "/files", {"params": {"path": "x"}}, 404, "sandbox_not_found", ()),
    (
        "PUT",
        UNKNOWN + "/files",
        {"params": {"path": "x"}, "content": b"1"},
        404,
        "sandbox_not_found",
        (),
    ),
    (
        "POST",
        "/v1/sandboxes",
        {"json": {"memory_mb": -5, "cpus": 0, "pids": "many"}},
        400,
        "invalid_argument",
        ("memory_mb", "cpus", "pids"),
    ),
    (
        "POST",
        "/v1/sandboxes",
        {"json": {"timeout": -1, "disk_mb": 0}},
        400,
        "invalid_argument",
        ("timeout", "disk_mb"),
    ),
    ("POST", "/v1/sandboxes", {"json": {"memroy_mb": 64}}, 400, "invalid_argument", ("memroy_mb",)),
    (
        "POST",
        "/v1/sandboxes",
        {"json": {"tags": ["has space"]}},
        400,
        "invalid_argument",
        ("tags",),
    ),
    ("POST", "/v1/sandboxes", {"json": {"image": "no-such-image"}}, 404, "image_not_found", ()),
    ("POST", "/v1/sandboxes", {"content": b"{not json"}, 400, "invalid_argument", ()),
    ("POST", "/v1/sandboxes", {"content": b"[1, 2]"}, 400, "invalid_argument", ()),
    ("POST", "/v1/sandboxes", {"content": b"\xff\xfe"}, 400, "invalid_argument", ()),
    ("GET", "/v1/sandboxes", {"params": {"state": "sleeping"}}, 400, "invalid_argument", ()),
    ("GET", "/v1/nothing-here", {}, 404, "not_found", ()),
    ("PATCH", "/v1/sandboxes", {}, 405, "method_not_allowed", ()),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code", "fields"),
    CASES,
    ids=[f"{c[0]} {c[1]} {c[4]}" for c in CASES],
)
def test_bad_request(client, unchanged, method, path, kwargs, status, code, fields):
    error = assert_error(client.request(method, path, **kwargs), status, code)
    named = {e["field"].split(".")[0] for e in error["details"].get("errors", [])}
    assert set(fields) <= named, error
    for field in fields:
        assert field in error["message"]


EXEC_CASES = [
    ({}, ("cmd",)),
    ({"cmd": "true", "timeout": -1}, ("timeout",)),
    ({"cmd": "true", "max_output": -1}, ("max_output",)),
    ({"cmd": "true", "output_tail": -1}, ("output_tail",)),
    ({"cmd": "true", "max_output": 10, "output_tail": 11}, ()),
    ({"cmd": "true", "output_tail": "5"}, ("output_tail",)),
    ({"cmd": 5}, ("cmd",)),
    ({"cmd": "true", "stdin": "a", "stdin_b64": "YQ=="}, ()),
    ({"cmd": "true", "stdin_b64": "***"}, ("stdin_b64",)),
    ({"cmd": "true", "env": {"A": 1}}, ("env",)),
    ({"cmd": "true", "shell": True}, ("shell",)),
    ({"cmd": []}, ()),
    ({"cmd": "true", "env": {"BAD=NAME": "x"}}, ()),
]


@pytest.mark.parametrize(("body", "fields"), EXEC_CASES, ids=[str(b) for b, _ in EXEC_CASES])
def test_bad_exec(client, sandbox, unchanged, body, fields):
    error = assert_error(
        client.post(f"/v1/sandboxes/{sandbox}/exec", json=body), 400, "invalid_argument"
    )
    named = {e.get("field", "").split(".")[0] for e in error["details"].get("errors", [])}
    assert set(fields) <= named, error


@pytest.mark.parametrize(
    ("method", "suffix", "kwargs"),
    [
        ("GET", "/files", {}),
        ("PUT", "/files", {"content": b"x"}),
        ("DELETE", "/files", {}),
        ("GET", "/files/stat", {}),
        ("GET", "/files/list", {}),
        ("POST", "/exec", {"json": {"cmd": "true", "cwd": "../../.."}}),
        ("POST", "/files/mkdir", {"json": {"path": "../../../x"}}),
    ],
)
def test_paths_cannot_escape_the_sandbox(client, sandbox, unchanged, method, suffix, kwargs):
    params = {"path": "../../../etc/passwd"} if "json" not in kwargs else None
    reply = client.request(method, f"/v1/sandboxes/{sandbox}{suffix}", params=params, **kwargs)
    assert_error(reply, 400, "path_outside_sandbox")


def test_bad_file_parameters(client, sandbox, unchanged):
    base = f"/v1/sandboxes/{sandbox}/files"
    assert "path" in assert_error(client.get(base), 400, "invalid_argument")["message"]
    assert_error(
        client.put(base, params={"path": "f", "mode": "rwx"}, content=b""), 400, "invalid_argument"
    )
    assert_error(
        client.put(base, params={"path": "f", "mode": "17777"}, content=b""),
        400,
        "invalid_argument",
    )
    assert_error(
        client.delete(base, params={"path": "f", "recursive": "maybe"}), 400, "invalid_argument"
    )
    assert_error(
        client.post(base + "/mkdir", json={"path": "d", "mode": -1}), 400, "invalid_argument"
    )
    assert_error(
        client.post(f"/v1/sandboxes/{sandbox}/stop", json={"grace": -1}), 400, "invalid_argument"
    )


def raw_request(sock_path, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send a hand-made request on the daemon's socket; (status, whole reply)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock_path))
        s.sendall(head + body)
        reply = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
            if b"\r\n\r\n" in reply and b'"error"' in reply:
                break
    return int(reply.split(b" ", 2)[1]), reply


def test_declared_1gib_upload_is_refused_before_anything_is_written(
    daemon, client, sandbox, unchanged
):
    started = time.monotonic()
    head = (
        f"PUT /v1/sandboxes/{sandbox}/files?path=big.bin HTTP/1.1\r\nHost: corral\r\n"
        f"Content-Length: {GIB}\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    status, reply = raw_request(daemon.socket, head, b"x" * 65536)
    assert status == 413 and b"file_too_large" in reply
    assert time.monotonic() - started < 10
    stat = client.get(f"/v1/sandboxes/{sandbox}/files/stat", params={"path": "big.bin"})
    assert_error(stat, 404, "file_not_found")


def test_streamed_upload_over_the_cap_is_cut_and_nothing_stays(make_daemon):
    from tests.server.conftest import uds_client

    d = make_daemon("--max-upload-bytes", str(1 << 20))
    with uds_client(d.socket) as client:
        sid = client.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        base = f"/v1/sandboxes/{sid}/files"
        sent = 0

        def body():  # chunked: the daemon cannot know the size in advance
            nonlocal sent
            for _ in range(64):
                sent += 256 << 10
                yield b"y" * (256 << 10)

        reply = client.put(base, params={"path": "big.bin"}, content=body())
        assert_error(reply, 413, "file_too_large")
        assert sent < 64 * (256 << 10)  # the daemon hung up instead of reading it all
        assert_error(client.get(base + "/stat", params={"path": "big.bin"}), 404, "file_not_found")
        # under the cap it works, and an existing file is replaced whole
        assert (
            client.put(base, params={"path": "ok.bin"}, content=b"z" * (1 << 20)).status_code == 204
        )
        assert_error(
            client.post("/v1/sandboxes", content=b"{" + b" " * (2 << 20) + b"}"),
            413,
            "file_too_large",
        )
        assert sandbox_ids(client) == {sid}
