"""A command's reply is larger than the output it holds room for (runtime/output_budget.py,
server/wire.py's HeldResponse).

The attack: the output budget counts ``2 × max_output`` for a command, then, while its
reply is sent, the reply's size where that is smaller. But the reply is JSON: a byte
``\\x01`` of output is the 6 bytes ``\\u0001`` in it, and output that is not UTF-8 is
sent twice (as text with U+FFFD, 3 bytes a byte, and as base64). A client printing
control characters and not reading its replies made the daemon hold ~6 times what the
budget said (the gauge said 16 MiB while 48 MiB waited), and the next commands ran at
full cap beside it. Now a reply holds its real size, past the budget if need be (the
bytes exist already): the next reservation is refused (429) instead."""

from __future__ import annotations

import json
import time

import pytest

from corral.api.models import exec_response
from corral.runtime.output_budget import OutputBudget
from corral.schema import ExecResult
from corral.server.wire import HeldJSONResponse
from tests.conftest import requires_root
from tests.security.tenants_helpers import no_traceback, team_daemon
from tests.security.unread_replies import PATIENCE_S, head_only, held_bytes

MiB = 1 << 20


def _result(stdout: bytes) -> ExecResult:
    return ExecResult(returncode=0, stdout=stdout, stderr=b"")


@pytest.mark.parametrize("byte", [b"\x01", b"\xff", b"\x00"])
def test_a_reply_holds_its_real_size_even_past_the_reservation(byte):
    budget = OutputBudget(total=4 * MiB, per_tenant=2 * MiB)
    hold = budget.reserve("mallory", 256 << 10)  # 512 KiB: both streams
    reply = HeldJSONResponse(exec_response(_result(byte * (256 << 10))), hold)
    assert len(reply.body) > 512 << 10  # the encoding grew it
    assert budget.used == budget.by_tenant["mallory"] == len(reply.body)
    hold.release()
    assert budget.used == 0 and not budget.by_tenant


def test_a_small_reply_gives_its_room_back_at_once():
    """One piece (64 KiB at most) is written whole into the connection: nothing to hold."""
    budget = OutputBudget(total=4 * MiB, per_tenant=2 * MiB)
    hold = budget.reserve(None, 256 << 10)
    HeldJSONResponse(exec_response(_result(b"\x01" * 10000)), hold)
    assert budget.used == 0


@pytest.fixture(scope="module")
def team():
    with team_daemon("--output-memory-mb", "64", "--tenant-output-memory-mb", "32") as t:
        t.make_token("mallory")
        yield t
        no_traceback(t)


def _held(team) -> float:
    with team.admin() as admin:
        return held_bytes(admin)


@requires_root
@pytest.mark.root
def test_control_characters_not_read_hold_their_whole_reply(team):
    printer = "import sys\nsys.stdout.buffer.write(b'\\x01' * (8 << 20))"
    with team.tenant("mallory") as mallory:
        reply = mallory.post("/v1/sandboxes", json={"memory_mb": 128})
        assert reply.status_code == 201, reply.text
        sid = reply.json()["id"]
        body = json.dumps({"cmd": ["python3", "-c", printer], "max_output": 8 * MiB}).encode()
        s, head, length = head_only(team.port, "POST", f"/v1/sandboxes/{sid}/exec", body,
                                    team.tokens["mallory"])
        try:
            assert head.startswith(b"HTTP/1.1 200"), head
            assert length > 40 * MiB  # 8 MiB of output, 6 bytes each in JSON
            # the reply waits in the daemon (this client reads none of it): all counted
            assert _held(team) >= length
            # so the tenant's next command finds its 32 MiB spent, and is refused typed
            more = mallory.post(f"/v1/sandboxes/{sid}/exec",
                                json={"cmd": ["true"], "max_output": 1 * MiB})
            assert more.status_code == 429, more.text
            assert more.json()["error"]["code"] == "output_budget_exceeded"
        finally:
            s.close()
            deadline = time.monotonic() + PATIENCE_S
            while _held(team) != 0:  # closing the connection gives it all back
                assert time.monotonic() < deadline, _held(team)
                time.sleep(0.05)
            mallory.delete(f"/v1/sandboxes/{sid}")


@requires_root
@pytest.mark.root
@pytest.mark.parametrize("verb", ["exchange", "consume", "exchange_many"])
def test_a_process_line_not_read_keeps_its_room(team, verb):
    """A process's unread output holds its room (``max_buffer``); a line read by
    ``exchange``/``consume`` gave that room back as it was taken, then went whole into
    the connection's buffer for a client that reads nothing: each such reply, 16 MiB
    here (96 in JSON), held by the daemon with the gauge at 0, as many as the tenant
    opened. Now the reply holds its size until written."""
    printer = ("import sys, time\nsys.stdout.buffer.write(b'\\x01' * (16 << 20) + b'\\n')\n"
               "sys.stdout.flush(); time.sleep(600)")
    token = team.tokens["mallory"]
    with team.tenant("mallory") as mallory:
        reply = mallory.post("/v1/sandboxes", json={"memory_mb": 128})
        assert reply.status_code == 201, reply.text
        sid = reply.json()["id"]
        held = []
        try:
            spawned = mallory.post(f"/v1/sandboxes/{sid}/processes", json={
                "cmd": ["python3", "-c", printer], "max_buffer": 32 * MiB})
            assert spawned.status_code == 201, spawned.text
            pid = spawned.json()["id"]
            deadline = time.monotonic() + PATIENCE_S
            while mallory.get(f"/v1/sandboxes/{sid}/processes/{pid}").json()[
                    "unread_bytes"] < (16 << 20) + 1:
                assert time.monotonic() < deadline, "the process never printed its line"
                time.sleep(0.05)
            if verb == "exchange_many":
                s, head, length = head_only(team.port, "POST", "/v1/processes/exchange",
                                            json.dumps({"items": [{"sandbox_id": sid,
                                                                   "process_id": pid}]}).encode(),
                                            token)
            else:
                query = "timeout=60&exit_timeout=0.1"
                s, head, length = head_only(
                    team.port, "POST", f"/v1/sandboxes/{sid}/processes/{pid}/{verb}?{query}",
                    token=token)
            held.append(s)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert length > 16 * MiB
            assert _held(team) >= length - 4 * MiB  # (the kernel's buffers take some)
        finally:
            for s in held:
                s.close()
            deadline = time.monotonic() + PATIENCE_S
            mallory.delete(f"/v1/sandboxes/{sid}")
            while _held(team) != 0:
                assert time.monotonic() < deadline, _held(team)
                time.sleep(0.05)
