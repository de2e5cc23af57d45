"""An unread gRPC reply is cut like an unread HTTP one (server/compat/cwsandbox_edge.py).

A unary ``Exec`` or ``ReadFile`` reply holds its room in the output budget until its
call ends; a client that took none of it (HTTP/2 lets it read its TCP connection and
hold the stream's window at 0) held that room until it gave up. Now the call's relayed
connection is closed once the reply was not taken in ``--write-stall-timeout`` plus the
time ``--write-min-rate`` would take. A real gRPC client reading at loopback speed, far
above that rate, gets the same reply whole. Real daemon; the raw HTTP/2 client of
tests/security/unread_replies.py; waits are bounded polls.
"""

from __future__ import annotations

import pytest

from tests.conftest import have_root_runtime
from tests.security.edge_daemon import TOKEN, served
from tests.security.test_write_stall import _held, _wait_for
from tests.security.unread_replies import grpc_unread
from tests.server.conftest import free_port

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason="needs root (a real daemon)")
grpc = pytest.importorskip("grpc")
pytest.importorskip("h2.connection")
pytest.importorskip("cwsandbox")
from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc  # noqa: E402

STALL_S = 8
MIN_RATE = 1 << 20  # 1 MiB/s here: an 8 MiB reply must be taken within 8 + 8 s
PRINT = 8 << 20


@pytest.fixture(scope="module")
def daemon():
    port = free_port()
    with served("--write-stall-timeout", str(STALL_S), "--write-min-rate", str(MIN_RATE),
                "--grpc", f"127.0.0.1:{port}") as d:
        d.grpc = f"127.0.0.1:{port}"
        with d.client() as admin:
            made = admin.post("/v1/sandboxes", json={"memory_mb": 128})
            assert made.status_code == 201, made.text
            d.sid = made.json()["id"]
        yield d


def _exec(daemon) -> sandbox_pb2.ExecRequest:
    return sandbox_pb2.ExecRequest(sandbox_id=daemon.sid, max_output_bytes=PRINT, command=[
        "python3", "-c", f"import sys; sys.stdout.buffer.write(b'x' * {PRINT})"])


def test_an_unread_grpc_reply_is_cut_off_and_its_room_goes_back(daemon):
    baseline = _held(daemon)
    _, sock = grpc_unread(daemon.grpc, TOKEN, "Exec", _exec(daemon).SerializeToString())
    try:
        _wait_for(lambda: _held(daemon) >= baseline + PRINT, "the reply never held room")
        # the client never gives up: the daemon ends the call
        _wait_for(lambda: _held(daemon) <= baseline, "the unread reply's room never came back")
    finally:
        sock.close()
    assert "closed a gRPC connection from 127.0.0.1" in daemon.log()


def test_a_grpc_client_that_reads_gets_its_whole_reply(daemon):
    with grpc.insecure_channel(daemon.grpc, options=[
            ("grpc.max_receive_message_length", 2 * PRINT)]) as channel:
        reply = sandbox_pb2_grpc.SandboxServiceStub(channel).Exec(
            _exec(daemon), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=120)
    assert reply.stdout == b"x" * PRINT and reply.exit_code == 0
