"""Interactive processes through the HTTP API of a real daemon (see docs/api.md)."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import requires_root
from tests.server.conftest import TEST_TAG, assert_error

pytestmark = [requires_root, pytest.mark.root]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
UPPER = (
    "import sys\n"
    "for line in sys.stdin:\n"
    "    sys.stdout.write(line.upper())\n"
    "    sys.stdout.flush()\n"
)


def spawn(client, sid: str, cmd, **body) -> dict:
    reply = client.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": cmd, **body})
    assert reply.status_code == 201, reply.text
    return reply.json()


def proc_path(proc: dict) -> str:
    return f"/v1/sandboxes/{proc['sandbox_id']}/processes/{proc['id']}"


def read_events(client, proc: dict, until, opened: threading.Event | None = None) -> list[dict]:
    """Lines of the output stream until ``until(events)`` is true (or the stream ends);
    ``opened`` is set once the stream's reply began."""
    events: list[dict] = []
    with client.stream("GET", proc_path(proc) + "/output") as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("application/x-ndjson")
        if opened is not None:
            opened.set()
        for line in reply.iter_lines():
            if line.strip():
                events.append(json.loads(line))
                if until(events):
                    break
    return events


def stdout_of(events: list[dict]) -> str:
    return "".join(e.get("data", "") for e in events if e["type"] == "stdout")


def test_process_routes_are_served_and_documented(client):
    doc = client.get("/openapi.json").json()
    served = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops
              if p.startswith("/v1/") and "/processes" in p}
    documented = {
        (method, path.replace("{id}", "{sandbox_id}"))
        for method, path in re.findall(r"`(GET|POST|PUT|DELETE) (/[^`?]*)", DOCS.read_text())
        if "/processes" in path  # not /kill-processes, a sandbox action
    }
    assert served == documented and len(served) == 11
    for schema in ("SpawnRequest", "ProcessInfo", "ExchangeRequest", "ExchangeResponse",
                   "ResizeRequest"):
        assert schema in doc["components"]["schemas"]


def test_stdin_and_a_detachable_output_stream(client, sandbox):
    proc = spawn(client, sandbox, ["python3", "-c", UPPER], env={"A": "1"}, cwd="/tmp")
    assert proc["id"].startswith("proc-") and proc["state"] == "running" and proc["pid"] > 1
    assert proc["stdin_open"] and proc["result"] is None and proc["sandbox_id"] == sandbox
    base = proc_path(proc)
    assert client.post(base + "/stdin", content=b"hello\n").status_code == 204
    first = read_events(client, proc, lambda ev: "HELLO\n" in stdout_of(ev))
    assert stdout_of(first) == "HELLO\n"
    # Leaving the stream killed nothing: write more, read it on a new stream.
    assert client.get(base).json()["state"] == "running"
    assert client.post(base + "/stdin", content=b"\xe9\xff\n").status_code == 204
    assert client.post(base + "/stdin", params={"close": "true"}).status_code == 204
    rest = read_events(client, proc, lambda ev: ev[-1]["type"] == "exit")
    assert rest[-1]["result"]["returncode"] == 0
    data = b"".join(
        base64.b64decode(e["data_b64"]) if "data_b64" in e else e["data"].encode()
        for e in rest if e["type"] == "stdout"
    )
    assert data == b"\xe9\xff\n"  # not UTF-8 (left as is by .upper()): sent as data_b64
    got = client.get(base).json()
    assert got["state"] == "exited" and got["result"]["returncode"] == 0
    assert got["ended_at"] >= got["started_at"] and not got["stdin_open"]
    listed = client.get(f"/v1/sandboxes/{sandbox}/processes").json()["processes"]
    assert [p["id"] for p in listed] == [proc["id"]]
    assert_error(client.post(base + "/stdin", content=b"late"), 409, "invalid_state")


def test_exchange_one_line_per_request(client, sandbox):
    proc = spawn(client, sandbox, ["python3", "-c", UPPER])
    base = proc_path(proc)
    for word in ("alpha", "beta"):
        reply = client.post(base + "/exchange", content=f"{word}\n".encode())
        assert reply.status_code == 200 and reply.content == f"{word.upper()}\n".encode()
        assert reply.headers["content-type"] == "application/octet-stream"
    slow = client.post(base + "/exchange", content=b"no newline", params={"timeout": "0.2"})
    assert_error(slow, 408, "exec_timeout")
    # Nothing was lost: the late line is the next one read.
    assert client.post(base + "/exchange", content=b" yet\n").content == b"NO NEWLINE YET\n"
    assert_error(client.post(base + "/exchange", params={"timeout": "-1"}), 400, "invalid_argument")
    client.post(base + "/stdin", params={"close": "true"})
    assert client.post(base + "/exchange").content == b""  # exited: end of output
    assert_error(client.post(base + "/exchange", content=b"x\n"), 409, "invalid_state")


def make_sandbox(client) -> str:
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG]})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def test_consume_replies_with_the_line_and_the_exit_and_deletes_the_sandbox(client):
    """One request: the line, how the process ended, the sandbox gone, whatever happened
    (an answer, no answer in time, a client that hangs up); a bad query deletes nothing."""
    once = "import sys\nsys.stdout.write(sys.stdin.readline().upper()); sys.stderr.write('bye')\n"
    silent = "import sys, time\nsys.stdin.readline(); time.sleep(60)\n"
    answered, mute, left = (make_sandbox(client) for _ in range(3))
    proc = spawn(client, answered, ["python3", "-c", once])
    assert_error(client.post(proc_path(proc) + "/consume", params={"exit_timeout": "0"}),
                 400, "invalid_argument")
    assert client.get(f"/v1/sandboxes/{answered}").status_code == 200  # refused: kept
    reply = client.post(proc_path(proc) + "/consume", content=b"hi\n")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["data"] == "HI\n" and body["deleted"] is True
    assert body["result"]["returncode"] == 0 and body["result"]["stderr"] == "bye"
    assert client.get(f"/v1/sandboxes/{answered}").status_code == 404
    proc = spawn(client, mute, ["python3", "-c", silent])
    body = client.post(proc_path(proc) + "/consume", content=b"x\n",
                       params={"timeout": "0.3"}).json()
    assert "data" not in body and "data_b64" not in body  # no line: killed
    assert body["result"]["returncode"] != 0
    assert client.get(f"/v1/sandboxes/{mute}").status_code == 404
    proc = spawn(client, left, ["python3", "-c", silent])
    with pytest.raises(httpx.ReadTimeout):  # the client hangs up while it waits
        client.post(proc_path(proc) + "/consume", content=b"x\n", params={"timeout": "1"},
                    timeout=0.3)
    deadline = time.monotonic() + 30
    while client.get(f"/v1/sandboxes/{left}").status_code != 404:
        assert time.monotonic() < deadline, "a consume left behind kept its sandbox"
        time.sleep(0.1)


def test_consume_with_delete_after_replies_first_then_the_sandbox_goes(client):
    """``?delete=after``: the same line and exit, the reply not waiting for the deletion
    (``deleted`` false), and the sandbox gone moments later. A bad value deletes
    nothing."""
    once = "import sys\nsys.stdout.write(sys.stdin.readline().upper())\n"
    sid = make_sandbox(client)
    proc = spawn(client, sid, ["python3", "-c", once])
    assert_error(client.post(proc_path(proc) + "/consume", content=b"x\n",
                             params={"delete": "later"}), 400, "invalid_argument")
    assert client.get(f"/v1/sandboxes/{sid}").status_code == 200  # refused: kept
    reply = client.post(proc_path(proc) + "/consume", content=b"hi\n",
                        params={"delete": "after", "timeout": "30"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["data"] == "HI\n" and body["deleted"] is False
    assert body["result"]["returncode"] == 0
    deadline = time.monotonic() + 30
    while client.get(f"/v1/sandboxes/{sid}").status_code != 404:
        assert time.monotonic() < deadline, "a consume with delete=after kept its sandbox"
        time.sleep(0.05)
    assert sid not in [s["id"] for s in client.get("/v1/sandboxes").json()["sandboxes"]]


def test_exchange_many_across_sandboxes(client, sandbox):
    other = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG]}).json()["id"]
    try:
        a = spawn(client, sandbox, ["python3", "-c", UPPER])
        b = spawn(client, other, ["python3", "-c", UPPER])
        items = [
            {"sandbox_id": sandbox, "process_id": a["id"], "data": "from a\n"},
            {"sandbox_id": other, "process_id": b["id"],
             "data_b64": base64.b64encode(b"from b\n").decode()},
            {"sandbox_id": other, "process_id": "proc-000000000000", "data": "x\n"},
        ]
        reply = client.post("/v1/processes/exchange", json={"items": items})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert results[:2] == [{"data": "FROM A\n"}, {"data": "FROM B\n"}]
        assert results[2]["error"]["code"] == "not_found"
        assert results[2]["error"]["details"]["process_id"] == "proc-000000000000"

        timed = client.post("/v1/processes/exchange", json={
            "items": [{"sandbox_id": sandbox, "process_id": a["id"], "data": "part"}],
            "timeout": 0.2,
        }).json()["results"]
        assert timed[0]["error"]["code"] == "exec_timeout"
        again = client.post("/v1/processes/exchange", json={
            "items": [{"sandbox_id": sandbox, "process_id": a["id"], "data": "ial\n"}],
        }).json()["results"]
        assert again == [{"data": "PARTIAL\n"}]

        twice = [items[0], {**items[0], "data": "y\n"}]
        assert_error(client.post("/v1/processes/exchange", json={"items": twice}), 400,
                     "invalid_argument")
        for bad in ({"items": []}, {"items": [{"sandbox_id": sandbox}]},
                    {"items": [items[0]], "extra": 1}):
            assert_error(client.post("/v1/processes/exchange", json=bad), 400, "invalid_argument")
        bad_b64 = client.post("/v1/processes/exchange", json={
            "items": [{"sandbox_id": sandbox, "process_id": a["id"], "data_b64": "%%%"}],
        }).json()["results"]
        assert bad_b64[0]["error"]["code"] == "invalid_argument"
    finally:
        client.delete(f"/v1/sandboxes/{other}")


def test_signal_kill_and_forget(client, sandbox):
    proc = spawn(client, sandbox, ["sleep", "60"])
    base = proc_path(proc)
    assert client.post(base + "/signal", json={"signal": "TERM"}).status_code == 204
    events = read_events(client, proc, lambda ev: ev[-1]["type"] == "exit")
    assert events[-1]["result"]["returncode"] == -15
    assert client.post(base + "/signal", json={"signal": 9}).status_code == 204  # ended: no-op
    assert_error(client.post(base + "/signal", json={"signal": "SIGNOPE"}), 400,
                 "invalid_argument")
    assert_error(client.post(base + "/signal", json={}), 400, "invalid_argument")

    proc = spawn(client, sandbox, "sleep 60", timeout=30)
    base = proc_path(proc)
    assert client.delete(base).status_code == 204
    assert_error(client.get(base), 404, "not_found")
    assert client.delete(base).status_code == 204  # idempotent
    count = client.post(f"/v1/sandboxes/{sandbox}/exec",
                        json={"cmd": "cat /proc/[0-9]*/comm | grep -c '^sleep$' || true"})
    assert count.json()["stdout"] == "0\n"


def test_bad_requests(client, sandbox):
    base = f"/v1/sandboxes/{sandbox}/processes"
    assert_error(client.post(base, json={"cmd": []}), 400, "invalid_argument")
    assert_error(client.post(base, json={"cmd": "true", "nope": 1}), 400, "invalid_argument")
    assert_error(client.post(base, json={"cmd": "true", "max_buffer": -1}), 400,
                 "invalid_argument")
    assert_error(client.post(base, json={"cmd": "true", "cwd": "/no/such"}), 404,
                 "file_not_found")
    assert_error(client.post("/v1/sandboxes/sb-000000000000/processes", json={"cmd": "true"}),
                 404, "sandbox_not_found")
    assert client.get(base).json() == {"processes": []}  # nothing half-made
    assert_error(client.get(base + "/proc-000000000000"), 404, "not_found")
    assert_error(client.get(base + "/proc-000000000000/output"), 404, "not_found")

    proc = spawn(client, sandbox, ["cat"])
    client.post(f"/v1/sandboxes/{sandbox}/pause")
    assert_error(client.post(proc_path(proc) + "/stdin", content=b"x"), 409, "invalid_state")
    client.post(f"/v1/sandboxes/{sandbox}/resume")
    assert client.post(proc_path(proc) + "/exchange", content=b"back\n").content == b"back\n"


def test_open_stream_ends_when_the_sandbox_does(client):
    sid = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG]}).json()["id"]
    proc = spawn(client, sid, ["sleep", "60"])
    events: list[dict] = []
    opened = threading.Event()
    reader = threading.Thread(
        target=lambda: events.extend(read_events(client, proc, lambda e: False, opened)))
    reader.start()
    assert opened.wait(60), "the output stream never opened"  # (a fixed wait: the
    # delete could come first under load, and the stream then is a 404)
    assert client.delete(f"/v1/sandboxes/{sid}").status_code == 204
    reader.join(30)
    assert not reader.is_alive()
    assert events and events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "sandbox_lost"
    assert_error(client.get(proc_path(proc)), 404, "sandbox_not_found")
