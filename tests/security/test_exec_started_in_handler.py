"""Attacks on the exec route that starts its command in the HTTP handler
(``Engine.start_exec``, ``StartedExec``, ``RunningCommand``; server/context.py's race
against the client's hang-up): the EXEC frame is sent and the deadline armed before
anything is awaited, so every way a client can leave is a chance to leave a command
running with nobody to kill it, or an output hold nobody gives back.

A hostile tenant over TCP hangs up at each point (headers only, the whole request then
a close, a reset, a half-close, and after the command is seen running), deletes the
sandbox or kills its processes under a running exec, and runs more commands at once
than the sandbox allows. Afterwards no command is left in the sandbox, the daemon's
``corral_output_held_bytes`` is back to 0, and the sandbox still runs commands. Kept as
failed attacks: none left anything behind. Real daemon, real sandboxes, tenants over TCP.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import httpx
import pytest

from tests.conftest import requires_root
from tests.security.tenants_helpers import no_traceback, team_daemon

pytestmark = [requires_root, pytest.mark.root]

PATIENCE_S = 120  # a bound on the polls below, never a measure
MARK = "3007"  # the sleeping commands' argument: counted in the sandbox's /proc
COUNT = ("import os\nn = 0\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
         "        try:\n            c = open('/proc/' + p + '/cmdline', 'rb').read()\n"
         "        except OSError:\n            continue\n"
         "        n += c == b'sleep\\x00" + MARK + "\\x00'\nprint(n)")


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        t.make_token("mallory")
        yield t
        no_traceback(t)


def _sandbox(client: httpx.Client, **spec) -> str:
    reply = client.post("/v1/sandboxes", json={"memory_mb": 128, **spec})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def _sleepers(client: httpx.Client, sid: str) -> int:
    reply = client.post(f"/v1/sandboxes/{sid}/exec",
                        json={"cmd": ["python3", "-c", COUNT], "timeout": 60})
    assert reply.status_code == 200, reply.text
    assert reply.json()["returncode"] == 0, reply.text
    return int(reply.json()["stdout"])


def _wait_sleepers(client: httpx.Client, sid: str, want: int) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while (n := _sleepers(client, sid)) != want:
        assert time.monotonic() < deadline, f"{n} sleeping commands, not {want}"
        time.sleep(0.05)


def _held(team) -> float:
    with team.admin() as admin:
        line = next(ln for ln in admin.get("/metrics").text.splitlines()
                    if ln.startswith("corral_output_held_bytes "))
    return float(line.split()[1])


def _nothing_held(team) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while (held := _held(team)) != 0:
        assert time.monotonic() < deadline, f"{held} output bytes still held"
        time.sleep(0.05)


def _request(team, sid: str, body: dict, route: str = "exec") -> tuple[bytes, bytes]:
    data = json.dumps(body).encode()
    head = (f"POST /v1/sandboxes/{sid}/{route} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {team.tokens['mallory']}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head, data


def _connect(team) -> socket.socket:
    return socket.create_connection(("127.0.0.1", team.port), timeout=PATIENCE_S)


def _reset(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


SLEEP = {"cmd": ["sleep", MARK], "timeout": 600, "max_output": 4 << 20}


def _headers_only(team, head: bytes, data: bytes) -> None:
    s = _connect(team)  # the handler never gets its body
    s.sendall(head)
    s.close()


def _close_at_once(team, head: bytes, data: bytes) -> None:
    s = _connect(team)
    s.sendall(head + data)
    s.close()


def _reset_at_once(team, head: bytes, data: bytes) -> None:
    s = _connect(team)
    s.sendall(head + data)
    _reset(s)


def _half_close(team, head: bytes, data: bytes) -> None:
    s = _connect(team)  # EOF, no reset: the client reads on
    s.sendall(head + data)
    s.shutdown(socket.SHUT_WR)
    s.close()


@pytest.mark.parametrize("route", ["exec", "exec/stream"])
@pytest.mark.parametrize("leave", [_headers_only, _close_at_once, _reset_at_once, _half_close])
def test_a_client_leaving_as_it_asks_leaves_no_command_and_no_hold(team, leave, route):
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        try:
            head, data = _request(team, sid, SLEEP, route)
            for _ in range(3):
                leave(team, head, data)
            _wait_sleepers(mallory, sid, 0)
            _nothing_held(team)
            done = mallory.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "ok"]})
            assert done.status_code == 200 and done.json()["stdout"] == "ok\n", done.text
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


@pytest.mark.parametrize("route", ["exec", "exec/stream"])
@pytest.mark.parametrize("leave", [socket.socket.close, _reset], ids=["close", "reset"])
def test_a_client_leaving_once_its_command_runs_leaves_no_command_and_no_hold(team, leave, route):
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        try:
            head, data = _request(team, sid, SLEEP, route)
            s = _connect(team)
            s.sendall(head + data)
            _wait_sleepers(mallory, sid, 1)
            leave(s)
            _wait_sleepers(mallory, sid, 0)
            _nothing_held(team)
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


def _exec_in_thread(team, sid: str, body: dict) -> tuple[threading.Thread, list]:
    got: list = []

    def run() -> None:
        with team.tenant("mallory") as c:
            try:
                got.append(c.post(f"/v1/sandboxes/{sid}/exec", json=body))
            except httpx.HTTPError as exc:  # pragma: no cover - reported below
                got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_a_sandbox_deleted_under_its_running_exec_answers_it_and_gives_the_room_back(team):
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        t, got = _exec_in_thread(team, sid, SLEEP)
        _wait_sleepers(mallory, sid, 1)
        assert mallory.delete(f"/v1/sandboxes/{sid}").status_code in (200, 204)
        t.join(PATIENCE_S)
        assert not t.is_alive(), "the exec was never answered"
        reply = got[0]
        assert isinstance(reply, httpx.Response), reply
        assert reply.status_code < 500 or reply.json()["error"]["code"] != "internal", reply.text
    _nothing_held(team)


def test_processes_killed_under_running_execs_end_them_and_give_the_room_back(team):
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        try:
            runs = [_exec_in_thread(team, sid, SLEEP) for _ in range(4)]
            _wait_sleepers(mallory, sid, 4)
            killed = mallory.post(f"/v1/sandboxes/{sid}/kill-processes")
            assert killed.status_code == 200 and killed.json()["killed"] >= 4, killed.text
            for t, got in runs:
                t.join(PATIENCE_S)
                assert not t.is_alive(), "an exec was never answered"
                assert isinstance(got[0], httpx.Response), got[0]
                assert got[0].status_code != 500, got[0].text
            _wait_sleepers(mallory, sid, 0)
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


def test_more_execs_at_once_than_allowed_are_refused_typed_and_leave_nothing(team):
    """Many clients start commands on one sandbox at once and all leave: every one is
    either refused (a typed error) or killed; nothing is held and nothing left running."""
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        try:
            head, data = _request(team, sid, SLEEP)
            socks = []
            for _ in range(80):
                s = _connect(team)
                s.sendall(head + data)
                socks.append(s)
            # each is refused at once (its reply comes) or running (no reply yet)
            for s in socks:
                s.settimeout(0.2)
                try:
                    status = s.recv(12)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    continue  # the door's cap on connections: refused before any exec
                assert status == b"" or status.startswith(b"HTTP/1.1 4"), status
            for s in socks:
                s.close()
            _wait_sleepers(mallory, sid, 0)
            _nothing_held(team)
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


def test_exec_on_another_tenants_sandbox_starts_nothing_and_holds_nothing(team):
    with team.tenant("alice") as alice, team.tenant("mallory") as mallory:
        sid = _sandbox(alice)
        try:
            for _ in range(5):
                reply = mallory.post(f"/v1/sandboxes/{sid}/exec", json=SLEEP)
                assert reply.status_code == 404, reply.text
            assert _sleepers(alice, sid) == 0
            _nothing_held(team)
        finally:
            alice.delete(f"/v1/sandboxes/{sid}")


def test_a_sandbox_paused_under_its_running_exec_times_it_out_and_gives_the_room_back(team):
    """Its deadline was armed in the handler: a pause past it ends the command there
    (a timed-out result), and after the resume nothing of it runs on."""
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        try:
            t, got = _exec_in_thread(team, sid, {**SLEEP, "timeout": 3})
            _wait_sleepers(mallory, sid, 1)
            assert mallory.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
            t.join(PATIENCE_S)
            assert not t.is_alive(), "the paused sandbox's exec was never answered"
            assert isinstance(got[0], httpx.Response), got[0]
            assert got[0].status_code == 200 and got[0].json()["timed_out"], got[0].text
            _nothing_held(team)
            assert mallory.post(f"/v1/sandboxes/{sid}/resume").status_code == 200
            _wait_sleepers(mallory, sid, 0)
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


def test_a_sandbox_hibernated_under_its_running_exec_answers_it_and_gives_the_room_back(team):
    with team.tenant("mallory") as mallory:
        reply = mallory.post("/v1/sandboxes", json={"memory_mb": 128, "checkpointable": True})
        if reply.status_code != 201:
            pytest.skip(f"no checkpointable sandbox here: {reply.text[:200]}")
        sid = reply.json()["id"]
        try:
            t, got = _exec_in_thread(team, sid, SLEEP)
            _wait_sleepers(mallory, sid, 1)
            hib = mallory.post(f"/v1/sandboxes/{sid}/hibernate")
            if hib.status_code != 200:
                assert hib.status_code < 500, hib.text  # (no CRIU here: refused, typed)
                pytest.skip(f"hibernate refused here: {hib.text[:200]}")
            t.join(PATIENCE_S)
            assert not t.is_alive(), "the hibernated sandbox's exec was never answered"
            assert isinstance(got[0], httpx.Response), got[0]
            assert got[0].status_code != 500, got[0].text
            _nothing_held(team)
            # its next command restores it; the restored agent was told which requests
            # it keeps (spawned processes): the exec's is not one of them
            left = _sleepers(mallory, sid)
            assert left == 0, (f"{left} command(s) of an exec answered {got[0].status_code} "
                               f"({got[0].text[:200]}) run on in the restored sandbox")
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


def test_a_live_fork_under_a_running_exec_copies_no_command_nobody_owns(team):
    """A live fork copies the sandbox's processes: the copy of a running exec's command
    is nobody's (its request is the parent's; only spawned processes are adopted), so
    the copy's agent kills it at its restore; the parent's runs on until its client
    leaves, then ends."""
    with team.tenant("mallory") as mallory:
        reply = mallory.post("/v1/sandboxes", json={"memory_mb": 128, "checkpointable": True})
        if reply.status_code != 201:
            pytest.skip(f"no checkpointable sandbox here: {reply.text[:200]}")
        sid, copies = reply.json()["id"], []
        try:
            head, data = _request(team, sid, SLEEP)
            s = _connect(team)
            s.sendall(head + data)
            _wait_sleepers(mallory, sid, 1)
            fork = mallory.post(f"/v1/sandboxes/{sid}/fork", json={"n": 1, "live": True})
            assert fork.status_code in (200, 201), fork.text
            got = fork.json()
            copies = [c["id"] for c in (got["sandboxes"] if isinstance(got, dict) else got)]
            assert len(copies) == 1, got
            assert _sleepers(mallory, copies[0]) == 0, "the copy runs the parent's command"
            assert _sleepers(mallory, sid) == 1  # (the parent's still runs: its client waits)
            s.close()
            _wait_sleepers(mallory, sid, 0)
            _nothing_held(team)
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
            for c in copies:
                mallory.delete(f"/v1/sandboxes/{c}")
    _nothing_held(team)
