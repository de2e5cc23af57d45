"""Processes on a pseudo-terminal through the HTTP API: ``"pty": true`` and ``/resize``."""

from __future__ import annotations

import pytest

from corral.runtime.terminal import MAX_SIDE
from tests.conftest import requires_root
from tests.server.conftest import assert_error
from tests.server.test_processes import proc_path, read_events, spawn, stdout_of

pytestmark = [requires_root, pytest.mark.root]


def test_a_terminal_process_is_sized_fed_and_resized(client, sandbox):
    proc = spawn(client, sandbox, "stty size; read line; stty size; echo got=$line >&2",
                 pty=True, rows=30, cols=90)
    assert (proc["pty"], proc["rows"], proc["cols"]) == (True, 30, 90)
    base = proc_path(proc)
    first = read_events(client, proc, lambda ev: "30 90\r\n" in stdout_of(ev))
    assert stdout_of(first) == "30 90\r\n"
    assert client.post(base + "/resize", json={"rows": 33, "cols": 101}).status_code == 204
    assert (client.get(base).json()["rows"], client.get(base).json()["cols"]) == (33, 101)
    assert client.post(base + "/stdin", content=b"hi\r").status_code == 204  # Enter is \r
    rest = read_events(client, proc, lambda ev: ev[-1]["type"] == "exit")
    # One stream: stderr comes on the terminal too; "hi" is the terminal's echo.
    assert {e["type"] for e in rest} == {"stdout", "exit"}
    assert stdout_of(rest) == "hi\r\n33 101\r\ngot=hi\r\n"
    assert rest[-1]["result"]["returncode"] == 0 and rest[-1]["result"]["stderr"] == ""
    assert_error(client.post(base + "/resize", json={"rows": 10, "cols": 10}), 409,
                 "invalid_state")  # it has exited

    plain = spawn(client, sandbox, ["tty"])
    assert (plain["pty"], plain["rows"], plain["cols"]) == (False, None, None)
    assert_error(client.post(proc_path(plain) + "/resize", json={"rows": 10, "cols": 10}), 409,
                 "invalid_state")


def test_a_default_size_and_ctrl_c(client, sandbox):
    proc = spawn(client, sandbox, "stty size; echo ready; sleep 100", pty=True)
    assert (proc["rows"], proc["cols"]) == (24, 80)
    read_events(client, proc, lambda ev: "ready\r\n" in stdout_of(ev))
    assert client.post(proc_path(proc) + "/stdin", content=b"\x03").status_code == 204
    events = read_events(client, proc, lambda ev: ev[-1]["type"] == "exit")
    assert events[-1]["result"]["returncode"] == -2  # SIGINT from the line discipline


@pytest.mark.parametrize("body", [
    {"rows": 0, "cols": 80}, {"rows": 24, "cols": MAX_SIDE + 1}, {"rows": "24", "cols": 80},
    {"rows": True, "cols": 80}, {"rows": 24}, {"rows": 24, "cols": 80, "extra": 1}, [],
])
def test_bad_resize_requests(client, sandbox, body):
    proc = spawn(client, sandbox, ["cat"], pty=True)
    assert_error(client.post(proc_path(proc) + "/resize", json=body), 400, "invalid_argument")
    assert client.get(proc_path(proc)).json()["rows"] == 24  # unchanged
    client.delete(proc_path(proc))


@pytest.mark.parametrize("extra", [
    {"rows": 24}, {"cols": 80, "pty": False}, {"pty": True, "rows": 0}, {"pty": "yes"},
    {"pty": True, "cols": MAX_SIDE + 1}, {"pty": 1},
])
def test_bad_spawn_sizes(client, sandbox, extra):
    base = f"/v1/sandboxes/{sandbox}/processes"
    assert_error(client.post(base, json={"cmd": "true", **extra}), 400, "invalid_argument")
    assert client.get(base).json() == {"processes": []}
