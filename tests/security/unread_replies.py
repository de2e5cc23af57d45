"""Clients that send a request and read none of its reply (the output budget's attacks:
a reply waiting in the daemon must hold its room until written), and the daemon's gauge
of what it holds. Helpers, not tests."""

from __future__ import annotations

import socket
from typing import Any

import pytest

PATIENCE_S = 120  # a bound on a wait, never a measure


def held_bytes(client: Any) -> float:
    """``corral_output_held_bytes`` of the daemon ``client`` (the admin's) talks to."""
    line = next(ln for ln in client.get("/metrics").text.splitlines()
                if ln.startswith("corral_output_held_bytes "))
    return float(line.split()[1])


def head_only(port: int, method: str, path: str, body: bytes = b"",
              token: str | None = None) -> tuple[socket.socket, bytes, int]:
    """Send an HTTP/1.1 request on a new connection and read its reply's head only
    (the kernel takes little of the body: a small receive buffer): ``(the socket,
    the head, its Content-Length)``. Close the socket to give the reply up."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(PATIENCE_S)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    try:
        s.connect(("127.0.0.1", port))
        s.sendall((f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}"
                   "Content-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        head = b""
        while b"\r\n\r\n" not in head and (more := s.recv(1)):
            head += more
    except BaseException:
        s.close()
        raise
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), -1)
    return s, head, length


def grpc_unread(target: str, token: str, method: str, message: bytes) -> tuple[Any, socket.socket]:
    """A unary gRPC call of ``method`` whose reply is never read (a raw HTTP/2 client
    with a stream window of 0: gRPC's own clients always read), once its headers came
    (the daemon has its answer): ``(the h2 connection, its socket)``. Give it up with
    :func:`grpc_give_up`."""
    h2 = pytest.importorskip("h2.connection")
    from h2.events import ResponseReceived
    from h2.settings import SettingCodes

    conn = h2.H2Connection()
    conn.initiate_connection()
    conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 0})  # read nothing
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=PATIENCE_S)
    conn.send_headers(1, [
        (":method", "POST"), (":scheme", "http"), (":authority", target),
        (":path", f"/coreweave.sandbox.v1.SandboxService/{method}"),
        ("content-type", "application/grpc"), ("te", "trailers"),
        ("authorization", f"Bearer {token}")])
    conn.send_data(1, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
    sock.sendall(conn.data_to_send())
    answered = False
    while not answered:
        data = sock.recv(65536)
        assert data, "the daemon closed the connection"
        answered = any(isinstance(e, ResponseReceived) for e in conn.receive_data(data))
        sock.sendall(conn.data_to_send())
    return conn, sock


def grpc_give_up(conn: Any, sock: socket.socket) -> None:
    """The client cancels the call (as gRPC's do)."""
    conn.reset_stream(1)
    sock.sendall(conn.data_to_send())
