"""Attack on the output budget (runtime/output_budget.py) through the cwsandbox
front-end's unary calls, whose replies wait in gRPC for a client that does not read
them (HTTP/2 flow control: a stream window of 0); a client opening many such calls made
the daemon hold every reply, the budget's gauge at 0:

- ``Exec`` (up to 25 MiB of output a reply): its command's room in the budget was given
  back as the command returned. Now the room is held until the call has ended.
- ``ReadFile`` (up to 32 MiB a reply): the file was read into the daemon outside the
  budget. Now its room is reserved before it is read (sized by its stat), and held
  until the call has ended.

A raw HTTP/2 client (``h2``) is the only way to leave a reply unread: gRPC's own
clients always read."""

from __future__ import annotations

import time

import pytest

from tests.conftest import requires_root
from tests.security.tenants_helpers import team_daemon
from tests.security.unread_replies import grpc_give_up, grpc_unread, held_bytes
from tests.server.conftest import free_port

pytestmark = [requires_root, pytest.mark.root]

MiB = 1 << 20
PRINT = 8 * MiB


@pytest.fixture(scope="module")
def team():
    pytest.importorskip("h2.connection")
    pytest.importorskip("cwsandbox")
    # Not grpc_team: gRPC itself logs an error (ExecuteBatchError) for a reply cancelled
    # while it was being sent, whatever corral does.
    grpc_port = free_port()
    with team_daemon("--grpc", f"127.0.0.1:{grpc_port}") as t:
        t.grpc = f"127.0.0.1:{grpc_port}"
        yield t


@pytest.fixture
def sandbox(team):
    with team.tenant("alice") as alice:
        sid = alice.post("/v1/sandboxes", json={"memory_mb": 128}).json()["id"]
        try:
            yield alice, sid
        finally:
            alice.delete(f"/v1/sandboxes/{sid}")


def _held_until_given_up(team, method: str, message: bytes, least: int) -> None:
    """Call ``method`` and read nothing: the daemon's gauge counts its reply, and the
    room comes back once the client gives it up."""
    conn, sock = grpc_unread(team.grpc, team.tokens["alice"], method, message)
    try:
        time.sleep(0.2)  # its message handed to gRPC, unsent
        with team.admin() as admin:
            held = held_bytes(admin)
            assert held >= least, held  # 0 before: the reply was nobody's
            grpc_give_up(conn, sock)
            deadline = time.monotonic() + 60
            while held_bytes(admin) != 0:
                assert time.monotonic() < deadline, "the room never came back"
                time.sleep(0.05)
    finally:
        sock.close()


def test_an_exec_reply_not_read_keeps_its_room_in_the_output_budget(team, sandbox):
    from cwsandbox._proto import sandbox_pb2 as pb

    _, sid = sandbox
    req = pb.ExecRequest(sandbox_id=sid, max_output_bytes=PRINT, command=[
        "python3", "-c", f"import sys; sys.stdout.buffer.write(b'x' * {PRINT})"])
    _held_until_given_up(team, "Exec", req.SerializeToString(), PRINT)


def test_a_read_file_reply_not_read_keeps_its_room_in_the_output_budget(team, sandbox):
    from cwsandbox._proto import sandbox_pb2 as pb

    alice, sid = sandbox
    made = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": [
        "python3", "-c", f"open('/tmp/big', 'wb').write(b'x' * {PRINT})"]})
    assert made.json()["returncode"] == 0, made.text
    req = pb.ReadFileRequest(sandbox_id=sid, path="/tmp/big")
    _held_until_given_up(team, "ReadFile", req.SerializeToString(), PRINT)
