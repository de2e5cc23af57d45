"""Attack on the output budget (runtime/output_budget.py) through the cwsandbox
front-end's unary ``ReadFile`` (up to 32 MiB a reply): the file was read into the
daemon's memory outside the budget, and the reply waited in gRPC for a client that
does not read it (HTTP/2 flow control: a stream window of 0), the gauge at 0; a client
opening many such calls made the daemon hold every file. Now the file's room is
reserved before it is read (sized by its stat) and held until the call has ended.
A raw HTTP/2 client (``h2``), as in test_cwsandbox_exec_budget.py."""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import requires_root
from tests.security.tenants_helpers import team_daemon
from tests.server.conftest import free_port

pytestmark = [requires_root, pytest.mark.root]

MiB = 1 << 20
SIZE = 8 * MiB


def _gauge(team) -> float:
    with team.admin() as admin:
        line = next(ln for ln in admin.get("/metrics").text.splitlines()
                    if ln.startswith("corral_output_held_bytes "))
    return float(line.split()[1])


def test_a_read_file_reply_not_read_keeps_its_room_in_the_output_budget():
    h2 = pytest.importorskip("h2.connection")
    from h2.events import ResponseReceived
    from h2.settings import SettingCodes

    pytest.importorskip("cwsandbox")
    from cwsandbox._proto import sandbox_pb2 as pb

    grpc_port = free_port()
    with team_daemon("--grpc", f"127.0.0.1:{grpc_port}") as team, \
            team.tenant("alice") as alice:
        team.grpc = f"127.0.0.1:{grpc_port}"
        sid = alice.post("/v1/sandboxes", json={"memory_mb": 128}).json()["id"]
        try:
            made = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": [
                "python3", "-c", f"open('/tmp/big', 'wb').write(b'x' * {SIZE})"]})
            assert made.json()["returncode"] == 0, made.text
            msg = pb.ReadFileRequest(sandbox_id=sid, path="/tmp/big").SerializeToString()
            conn = h2.H2Connection()
            conn.initiate_connection()
            conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 0})  # read nothing
            host, port = team.grpc.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=120)
            conn.send_headers(1, [
                (":method", "POST"), (":scheme", "http"), (":authority", team.grpc),
                (":path", "/coreweave.sandbox.v1.SandboxService/ReadFile"),
                ("content-type", "application/grpc"), ("te", "trailers"),
                ("authorization", f"Bearer {team.tokens['alice']}")])
            conn.send_data(1, b"\0" + len(msg).to_bytes(4, "big") + msg, end_stream=True)
            sock.sendall(conn.data_to_send())
            answered = False
            while not answered:  # the reply's headers: the file was read
                data = sock.recv(65536)
                assert data, "the daemon closed the connection"
                answered = any(isinstance(e, ResponseReceived) for e in conn.receive_data(data))
                sock.sendall(conn.data_to_send())
            time.sleep(0.2)  # its message handed to gRPC, unsent
            held = _gauge(team)
            assert held >= SIZE, held  # 0 before: the file was nobody's
            conn.reset_stream(1)  # the client gives up on it
            sock.sendall(conn.data_to_send())
            deadline = time.monotonic() + 60
            while _gauge(team) != 0:
                assert time.monotonic() < deadline, "the room never came back"
                time.sleep(0.05)
            sock.close()
        finally:
            alice.delete(f"/v1/sandboxes/{sid}")
