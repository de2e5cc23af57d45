"""Red team: the env server's ``listen`` (guest/env_server.py), which moves an
environment's conversation to a loopback port of its sandbox. Another process there
(code the environment runs) that connects first takes nothing: a wrong or overlong
first line is hung up on and the client with the token still gets the conversation;
once it has it, the port is closed, so the token cannot be used again. One that
connects and says nothing (or dribbles) holds nothing up: connections are heard side
by side (before, the first was read alone, for up to 30 s, while the client waited)."""

from __future__ import annotations

import os
import socket
import threading

from corral.guest import env_server

TOKEN = b"0123456789abcdef0123456789abcdef"


def _hung_up(sock: socket.socket) -> bool:
    """Closed by the server: an end of file, or a reset (it hung up with bytes unread)."""
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_process_that_connects_first_without_the_token_takes_nothing():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    r, w = os.pipe()
    requests = os.fdopen(r, "rb")
    got: list = []
    server = threading.Thread(target=lambda: got.append(
        env_server._accept(listener, TOKEN, requests)), daemon=True)
    server.start()
    try:
        hostile = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        hostile[0].sendall(b"f" * len(TOKEN) + b"\n")
        hostile[1].sendall(TOKEN + b"X" * 64 + b"\n")  # the token, and more, on its line
        for h in hostile:
            assert _hung_up(h)
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(TOKEN + b"\n")
        server.join(30)
        assert got and got[0] is not None, "the client with the token was not taken"
        reader, writer = got[0]
        writer.write(b"reply\n")
        writer.flush()
        client.settimeout(30)
        assert client.recv(16) == b"reply\n"
        try:  # the port is gone: the token opens nothing more
            again = socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            again = None
        assert again is None
        reader.close()
        writer.close()
        client.close()
    finally:
        os.close(w)
        requests.close()


def test_a_silent_or_slow_connection_does_not_hold_up_the_client():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    r, w = os.pipe()
    requests = os.fdopen(r, "rb")
    got: list = []
    server = threading.Thread(target=lambda: got.append(
        env_server._accept(listener, TOKEN, requests)), daemon=True)
    server.start()
    silent = socket.create_connection(("127.0.0.1", port))  # connects, says nothing
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(TOKEN[:5])  # the start of a line, and no more
    try:
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(TOKEN[:7])  # its line in two pieces, then its first request
        client.sendall(TOKEN[7:] + b"\n" + b'{"op": "ping"}\n')
        # before: the silent one was read alone until the listen's 30 s ran out, then
        # the port closed and the client got nothing (None here)
        server.join(env_server.LISTEN_WAIT_S * 2)
        assert got and got[0] is not None, "a silent connection held up the client"
        reader, writer = got[0]
        assert reader.readline() == b'{"op": "ping"}\n'  # nothing past its line was lost
        writer.write(b"reply\n")
        writer.flush()
        client.settimeout(30)
        assert client.recv(16) == b"reply\n"
        for other in (silent, slow):  # hung up on once the client was taken
            assert _hung_up(other)
        reader.close()
        writer.close()
        client.close()
    finally:
        silent.close()
        slow.close()
        os.close(w)
        requests.close()


def test_a_reset_connection_ends_as_its_eof_not_the_server():
    """A checkpoint resets the daemon's connections into the sandbox (a port socket's
    among them, runtime/engine_live.py): the server reading one took the reset as an
    error and died. Now it ends that conversation as at EOF (here, its only one: it
    returns)."""
    import struct
    import types

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    peer = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    listener.close()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # a reset
    with conn, conn.makefile("rb") as requests, conn.makefile("wb") as replies:
        env_server.serve(requests, replies, types.SimpleNamespace())
