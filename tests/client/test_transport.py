"""Configuration and error translation, with a swapped transport: no daemon needed."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

import corral
from corral.client._config import Endpoint, exec_http_timeout
from corral.client._models import exec_body, parse_exec, parse_stream_item, spec_body


def mock_client(handler, **kwargs) -> corral.Client:
    return corral.Client("http://corral.test:7070", transport=httpx.MockTransport(handler), **kwargs)


def error_reply(status: int, code: str, message: str = "boom", **details) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message, "details": details}})


# ------------------------------------------------------------------ configuration


def test_endpoint_from_arguments_and_environment(monkeypatch):
    for var in ("CORRAL_URL", "CORRAL_TOKEN", "CORRAL_SOCKET", "CORRAL_NO_EMBED"):
        monkeypatch.delenv(var, raising=False)
    default = Endpoint.resolve()
    assert (default.uds, default.embed, default.token) == ("/run/corral/corral.sock", True, None)

    monkeypatch.setenv("CORRAL_SOCKET", "/tmp/x/c.sock")
    monkeypatch.setenv("CORRAL_NO_EMBED", "1")
    assert (Endpoint.resolve().uds, Endpoint.resolve().embed) == ("/tmp/x/c.sock", False)

    monkeypatch.setenv("CORRAL_URL", "http://10.1.2.3:7070/")
    monkeypatch.setenv("CORRAL_TOKEN", "s3cret")
    tcp = Endpoint.resolve()
    assert (tcp.base_url, tcp.uds, tcp.embed) == ("http://10.1.2.3:7070", None, False)
    assert tcp.headers() == {"Authorization": "Bearer s3cret"}

    explicit = Endpoint.resolve("unix:///var/run/other.sock", token="t")
    assert (explicit.uds, explicit.embed, explicit.token) == ("/var/run/other.sock", False, "t")

    for bad in ("ftp://x", "unix://relative.sock", "localhost:7070"):
        with pytest.raises(corral.InvalidArgument, match="invalid daemon URL"):
            Endpoint.resolve(bad)


def test_token_is_sent_as_bearer():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, json={"status": "ok"})

    with mock_client(handler, token="s3cret") as c:
        assert c.health() == {"status": "ok"}
    assert seen["auth"] == "Bearer s3cret"


def test_exec_http_timeout_exceeds_the_command_timeout():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["timeout"] = request.extensions["timeout"]
        return httpx.Response(200, json={"returncode": 0, "stdout": "hi\n"})

    assert exec_http_timeout(None) is None
    with mock_client(handler, timeout=5) as c:
        sb = corral.Sandbox(_info("sb-1"), client=c)
        assert sb.exec("echo hi", timeout=300).stdout == "hi\n"
        assert seen["timeout"]["read"] > 300
        sb.exec("sleep infinity", timeout=None)
        assert seen["timeout"]["read"] is None


# ------------------------------------------------------------------------- errors


def _info(sid: str) -> corral.SandboxInfo:
    return corral.SandboxInfo(id=sid, state="running", spec=corral.SandboxSpec(), created_at=0.0)


@pytest.mark.parametrize(
    ("status", "code", "exc_type", "builtin"),
    [
        (404, "sandbox_not_found", corral.SandboxNotFound, LookupError),
        (404, "file_not_found", corral.FileNotFound, FileNotFoundError),
        (400, "path_outside_sandbox", corral.PathOutsideSandbox, ValueError),
        (401, "unauthorized", corral.Unauthorized, PermissionError),
        (503, "capacity_exceeded", corral.CapacityExceeded, corral.CorralError),
        (413, "file_too_large", corral.FileTooLarge, OSError),
        (507, "sandbox_disk_full", corral.SandboxDiskFull, OSError),
    ],
)
def test_error_replies_become_typed_exceptions(status, code, exc_type, builtin):
    with mock_client(lambda r: error_reply(status, code, "what failed", path="/x")) as c:
        with pytest.raises(exc_type, match="what failed") as info:
            c.request("GET", "/v1/sandboxes/sb-1")
    assert isinstance(info.value, builtin)
    assert info.value.details["path"] == "/x"


def test_a_reply_without_an_error_body_still_raises_by_status():
    with mock_client(lambda r: httpx.Response(404, text="nope")) as c:
        with pytest.raises(corral.NotFound, match="HTTP 404: nope"):
            c.request("GET", "/v1/whatever")
    with mock_client(lambda r: httpx.Response(502, text="<html>bad gateway</html>")) as c:
        with pytest.raises(corral.CorralError, match="HTTP 502"):
            c.info()


def test_a_streamed_error_reply_is_read_and_raised():
    with mock_client(lambda r: error_reply(404, "sandbox_not_found", "no sandbox sb-9")) as c:
        sb = corral.Sandbox(_info("sb-9"), client=c)
        with pytest.raises(corral.SandboxNotFound, match="no sandbox sb-9"):
            list(sb.exec_stream("true"))


def test_an_error_in_the_middle_of_a_stream_raises_after_the_output():
    lines = [
        {"type": "stdout", "data": "partial\n"},
        {"type": "error", "error": {"code": "sandbox_lost", "message": "agent died"}},
    ]
    body = "".join(json.dumps(x) + "\n" for x in lines)
    with mock_client(lambda r: httpx.Response(200, text=body)) as c:
        stream = corral.Sandbox(_info("sb-1"), client=c).exec_stream("true")
        it = iter(stream)
        assert next(it).text == "partial\n"
        with pytest.raises(corral.SandboxLost, match="agent died"):
            next(it)
        with pytest.raises(corral.InvalidState, match="has not finished"):
            _ = stream.result


def test_transport_failures_become_daemon_unavailable():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection reset", request=request)

    with mock_client(handler) as c:
        with pytest.raises(corral.DaemonUnavailable, match="lost the connection") as info:
            c.health()
    assert isinstance(info.value, ConnectionError)
    assert isinstance(info.value.__cause__, httpx.ReadError)


def test_dead_socket_is_daemon_unavailable_with_a_hint(tmp_path):
    with corral.Client(f"unix://{tmp_path}/nothing.sock") as c:
        with pytest.raises(corral.DaemonUnavailable) as info:
            corral.Sandbox.list(client=c)
    message = str(info.value)
    assert "corral serve" in message and "CORRAL_URL" in message
    assert f"{tmp_path}/nothing.sock" in message


async def test_async_dead_socket_is_daemon_unavailable(tmp_path):
    async with corral.AsyncClient(f"unix://{tmp_path}/nothing.sock") as c:
        with pytest.raises(corral.DaemonUnavailable, match="corral serve"):
            await corral.AsyncSandbox.connect("sb-1", client=c)


# ------------------------------------------------------------------- wire models


def test_exec_body_and_result_round_trip_binary_data():
    body = exec_body(["cat"], timeout=5, env={"A": "1"}, cwd="/tmp", stdin=b"\xff\x00", max_output=10)
    assert body == {"cmd": ["cat"], "timeout": 5, "env": {"A": "1"}, "cwd": "/tmp",
                    "stdin_b64": base64.b64encode(b"\xff\x00").decode(), "max_output": 10}
    assert exec_body("echo hi", timeout=None, env=None, cwd=None, stdin="x", max_output=None) == {
        "cmd": "echo hi", "timeout": None, "stdin": "x"}
    with pytest.raises(corral.InvalidArgument, match="list of strings"):
        exec_body(["echo", 1], timeout=1, env=None, cwd=None, stdin=None, max_output=None)

    wire = {"returncode": 1, "stdout": "\ufffd", "stdout_b64": base64.b64encode(b"\xff").decode(),
            "stderr": "oops\n", "stderr_truncated": True, "duration": 0.5}
    r = parse_exec(wire, args=["x"], sandbox_id="sb-1", timeout=5)
    assert (r.stdout_bytes, r.stdout, r.stderr, r.truncated, r.ok) == (b"\xff", "\ufffd", "oops\n", True, False)


def test_check_returncode_raises_like_subprocess():
    import subprocess

    failed = parse_exec({"returncode": 3, "stderr": "bad\n"}, args=["false"], sandbox_id="sb-1", timeout=1)
    with pytest.raises(subprocess.CalledProcessError) as info:
        failed.check_returncode()
    assert (info.value.returncode, info.value.stderr, info.value.result) == (3, "bad\n", failed)

    slow = parse_exec({"returncode": -9, "timed_out": True}, args="sleep 9", sandbox_id="sb-1", timeout=1)
    with pytest.raises(corral.ExecTimeout, match="sb-1.*'sleep 9' timed out after 1s") as info:
        slow.check_returncode()
    assert isinstance(info.value, TimeoutError)
    parse_exec({"returncode": 0}, args="true", sandbox_id="s", timeout=1).check_returncode()


def test_stream_items_and_spec_validation():
    chunk = parse_stream_item({"type": "stderr", "data_b64": base64.b64encode(b"\xffa").decode()})
    assert (chunk.stream, chunk.data, chunk.text) == ("stderr", b"\xffa", "\ufffda")
    assert parse_stream_item({"type": "exit", "result": {"returncode": 0}}) == {"returncode": 0}
    assert parse_stream_item({"type": "progress"}) is None
    assert spec_body({"image": "python", "memory_mb": 512, "cpus": None}) == {"image": "python", "memory_mb": 512}
    with pytest.raises(corral.InvalidArgument, match="memory_mb"):
        spec_body({"memory_mb": 1})
