"""The HTTP API of a real daemon: sandboxes, commands and streams (see docs/api.md)."""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.server.conftest import TEST_TAG, assert_error

pytestmark = [requires_root, pytest.mark.root]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_health_info_and_openapi(client):
    assert client.get("/v1/health").json() == {"status": "ok"}
    info = client.get("/v1/info").json()
    assert info["cgroup_version"] in (1, 2)
    assert info["capacity"]["max_starting"] == 8
    assert info["capacity"]["max_sandboxes"] == 2000
    assert info["capacity"]["max_memory_mb"] > 1024
    assert set(info["counts"]) == {"pending", "running", "paused", "stopping", "stopped", "failed"}
    assert info["queued"] == 0

    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    documented = {
        (method, path.replace("{id}", "{sandbox_id}"))
        for method, path in re.findall(r"`(GET|POST|PUT|DELETE) (/[^`?]*)", DOCS.read_text())
        if path.startswith("/v1/")  # the native API (front-ends speak their clients' own)
    }
    documented |= {("POST", "/v1/sandboxes/{sandbox_id}/resume")}  # written as "/pause`, `/resume"
    served = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented <= served, documented - served
    assert ("GET", "/openapi.json") in served
    for schema in ("SandboxSpec", "SandboxInfo", "ExecRequest", "ExecResponse", "FileInfo"):
        assert schema in doc["components"]["schemas"]


def test_lifecycle_and_listing(client):
    create = {"memory_mb": 64, "tags": [TEST_TAG, "lifecycle"], "env": {"GREETING": "hi"}}
    reply = client.post("/v1/sandboxes", json=create)
    assert reply.status_code == 201, reply.text
    sb = reply.json()
    sid, base = sb["id"], f"/v1/sandboxes/{sb['id']}"
    try:
        assert sid.startswith("sb-") and sb["state"] == "running"
        assert sb["spec"]["memory_mb"] == 64 and sb["spec"]["tags"] == [TEST_TAG, "lifecycle"]

        got = client.get(base).json()
        assert got["id"] == sid and got["usage"]["memory_mb"] >= 0

        def listed(**params):
            reply = client.get("/v1/sandboxes", params=params)
            assert reply.status_code == 200, reply.text
            return [s["id"] for s in reply.json()["sandboxes"]]

        assert sid in listed(tag="lifecycle")
        assert listed(tag=["lifecycle", "no-such-tag"]) == []
        assert sid in listed(tag="lifecycle", state=["paused", "running"])
        assert sid not in listed(state="stopped")

        assert client.post(base + "/pause").json()["state"] == "paused"
        assert sid in listed(tag="lifecycle", state="paused")
        paused = client.post(base + "/exec", json={"cmd": "true"})
        assert "resume" in assert_error(paused, 409, "invalid_state")["message"]
        assert client.post(base + "/resume").json()["state"] == "running"
        ran = client.post(base + "/exec", json={"cmd": "echo $GREETING"}).json()
        assert ran["stdout"] == "hi\n"

        stopped = client.post(base + "/stop", json={"grace": 0.5})
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["state"] == "stopped"
        assert "usage" not in client.get(base).json()
        assert_error(client.post(base + "/exec", json={"cmd": "true"}), 409, "invalid_state")
    finally:
        assert client.delete(base).status_code == 204
    assert_error(client.get(base), 404, "sandbox_not_found")
    assert client.delete(base).status_code == 204  # idempotent


def exec_(client, sid, **body):
    reply = client.post(f"/v1/sandboxes/{sid}/exec", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_exec_argv_shell_stdin_env_cwd(client, sandbox):
    r = exec_(client, sandbox, cmd=["python3", "-c", "print(6 * 7)"])
    assert (r["returncode"], r["stdout"], r["stderr"]) == (0, "42\n", "")
    assert "stdout_b64" not in r and r["timed_out"] is False
    r = exec_(client, sandbox, cmd="echo out; echo err >&2; exit 3")
    assert (r["returncode"], r["stdout"], r["stderr"]) == (3, "out\n", "err\n")
    r = exec_(
        client,
        sandbox,
        cmd=["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"],
        stdin="olleh",
    )
    assert r["stdout"] == "hello\n"
    r = exec_(client, sandbox, cmd="wc -c", stdin_b64=base64.b64encode(b"\x00\x01\xff").decode())
    assert r["stdout"].strip() == "3"
    r = exec_(client, sandbox, cmd="echo $A-$B", env={"A": "1", "B": "two"})
    assert r["stdout"] == "1-two\n"
    assert exec_(client, sandbox, cmd="mkdir -p sub/dir")["returncode"] == 0
    assert exec_(client, sandbox, cmd="pwd", cwd="sub/dir")["stdout"] == "/workspace/sub/dir\n"
    missing = client.post(f"/v1/sandboxes/{sandbox}/exec", json={"cmd": "true", "cwd": "/nope"})
    assert_error(missing, 404, "file_not_found")


def test_exec_timeout_and_binary_output(client, sandbox):
    # 5 s: long enough that "before" was surely written first, even on a loaded host
    # (0.5 s could fire before the shell had run); the sleep never ends within it.
    started = time.monotonic()
    r = exec_(client, sandbox, cmd="echo before; sleep 600", timeout=5)
    assert r["timed_out"] is True and r["returncode"] < 0
    assert r["stdout"] == "before\n"
    assert time.monotonic() - started < 300  # killed, not waited out

    code = "import sys; sys.stdout.buffer.write(b'ok\\xff\\xfe'); sys.stderr.write('\u00e9')"
    r = exec_(client, sandbox, cmd=["python3", "-c", code])
    assert base64.b64decode(r["stdout_b64"]) == b"ok\xff\xfe"
    assert r["stdout"].startswith("ok") and "\ufffd" in r["stdout"]
    assert r["stderr"] == "\u00e9" and "stderr_b64" not in r


def stream(client, sid, body):
    """(seconds since the request, event) for each line of a streamed command."""
    started = time.monotonic()
    with client.stream("POST", f"/v1/sandboxes/{sid}/exec/stream", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("application/x-ndjson")
        for line in reply.iter_lines():
            if line:
                yield time.monotonic() - started, json.loads(line)


def test_exec_stream_keeps_order_and_arrives_live(client, sandbox):
    script = (
        "echo o1; sleep 0.3; echo e1 >&2; sleep 0.3; echo o2; sleep 0.3; echo e2 >&2; sleep 0.5"
    )
    events = list(stream(client, sandbox, {"cmd": script}))
    kinds = [(e["type"], e.get("data")) for _, e in events]
    assert kinds[:-1] == [
        ("stdout", "o1\n"),
        ("stderr", "e1\n"),
        ("stdout", "o2\n"),
        ("stderr", "e2\n"),
    ]
    at_exit, last = events[-1]
    assert last["type"] == "exit" and last["result"]["returncode"] == 0
    assert last["result"]["duration"] >= 1.3
    first_at = events[0][0]
    assert first_at < at_exit - 1.0  # the first chunk came while the command still ran


def test_exec_stream_text_binary_and_errors(client, sandbox):
    code = (
        "import sys, time; b = '\u00e9'.encode(); w = sys.stdout.buffer\n"
        "w.write(b[:1]); w.flush(); time.sleep(0.2); w.write(b[1:] + b'!'); w.flush()\n"
        "time.sleep(0.2); sys.stderr.buffer.write(b'\\xff'); sys.exit(4)"
    )
    events = [e for _, e in stream(client, sandbox, {"cmd": ["python3", "-c", code]})]
    out = [e for e in events if e["type"] == "stdout"]
    assert all("data_b64" not in e for e in out)  # a split character is still text
    assert "".join(e["data"] for e in out) == "\u00e9!"
    err = [e for e in events if e["type"] == "stderr"]
    assert [base64.b64decode(e["data_b64"]) for e in err] == [b"\xff"]
    assert events[-1]["type"] == "exit" and events[-1]["result"]["returncode"] == 4

    timed = [e for _, e in stream(client, sandbox, {"cmd": "sleep 10", "timeout": 0.3})]
    assert timed[-1]["result"]["timed_out"] is True
    # Errors found before the command starts get a status, not a stream.
    assert_error(
        client.post("/v1/sandboxes/sb-000000000000/exec/stream", json={"cmd": "true"}),
        404,
        "sandbox_not_found",
    )
    assert_error(
        client.post(f"/v1/sandboxes/{sandbox}/exec/stream", json={"cmd": []}),
        400,
        "invalid_argument",
    )


def test_exec_stream_disconnect_kills_the_command(client, sandbox):
    body = {"cmd": "echo $$ > /tmp/pid; echo started; exec sleep 60", "timeout": 120}
    for _, event in stream(client, sandbox, body):
        assert event == {"type": "stdout", "data": "started\n"}
        break  # leaving the with-block closes the connection mid-stream
    pid = exec_(client, sandbox, cmd="cat /tmp/pid")["stdout"].strip()
    assert pid.isdigit()
    deadline = time.monotonic() + 60  # only against a hang (a loaded host is slow)
    while exec_(client, sandbox, cmd=f"test -d /proc/{pid}")["returncode"] == 0:
        assert time.monotonic() < deadline, "the command outlived its client"
        time.sleep(0.1)


def test_exec_disconnect_kills_a_plain_exec_too(daemon, sandbox):
    import socket

    from tests.server.conftest import uds_client

    body = json.dumps({"cmd": "echo $$ > /tmp/pid2; exec sleep 60", "timeout": 120}).encode()
    with uds_client(daemon.socket) as c, socket.socket(socket.AF_UNIX) as raw:
        c.post(f"/v1/sandboxes/{sandbox}/exec", json={"cmd": "rm -f /tmp/pid2"})
        raw.connect(str(daemon.socket))
        raw.sendall(f"POST /v1/sandboxes/{sandbox}/exec HTTP/1.1\r\nHost: corral\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        # polled, not a fixed client timeout: on a loaded host the command may start late
        deadline = time.monotonic() + 60
        while not (pid := exec_(c, sandbox, cmd="cat /tmp/pid2 2>/dev/null")["stdout"].strip()):
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.1)
        raw.close()  # the client goes away while its plain exec runs
        deadline = time.monotonic() + 60  # only against a hang: the daemon sees the close
        while exec_(c, sandbox, cmd=f"test -d /proc/{pid}")["returncode"] == 0:
            assert time.monotonic() < deadline, "the command outlived its client"
            time.sleep(0.1)


def test_files(client, sandbox):
    base = f"/v1/sandboxes/{sandbox}/files"
    payload = bytes(range(256)) * 8192  # 2 MiB: more than one agent chunk
    put = client.put(base, params={"path": "data/blob.bin", "mode": "0600"}, content=payload)
    assert put.status_code == 204, put.text
    got = client.get(base, params={"path": "/workspace/data/blob.bin"})
    assert got.status_code == 200 and got.content == payload
    assert got.headers["content-type"] == "application/octet-stream"

    st = client.get(base + "/stat", params={"path": "data/blob.bin"}).json()
    assert (st["size"], st["mode"], st["is_dir"]) == (len(payload), 0o600, False)
    assert client.post(base + "/mkdir", json={"path": "data/sub/deeper"}).status_code == 204
    names = {
        e["name"]: e for e in client.get(base + "/list", params={"path": "data"}).json()["entries"]
    }
    assert set(names) == {"blob.bin", "sub"} and names["sub"]["is_dir"] is True
    assert "data" in {e["name"] for e in client.get(base + "/list").json()["entries"]}

    assert_error(client.delete(base, params={"path": "data"}), 409, "file_error")
    assert client.delete(base, params={"path": "data", "recursive": "true"}).status_code == 204
    assert_error(client.get(base, params={"path": "data/blob.bin"}), 404, "file_not_found")
    assert_error(client.get(base + "/stat", params={"path": "data"}), 404, "file_not_found")
    assert_error(client.put(base, params={"path": "/etc/passwd"}, content=b"x"), 409, "file_error")
