"""Red team of the env server's ``listen`` (guest/env_server.py: SandboxEnv's port
channel, issue 30), by a process the environment ran earlier that is still there when
the server listens again (after a live fork each copy and the parent listen on a port of
their own). It sees the new port in /proc/net/tcp and connects first, then sends
nothing, or the token's length in bytes one at a time. The server read that first line
with the whole listen window as its timeout: the client with the token waited in the
backlog until the window ended, the server went back to stdin, and the client's first
step then waited for good on a socket nobody read. Now every connection that has not
presented its line is read at once with the others: a silent or slow one delays no one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import types

from corral.guest import env_server

TOKEN = b"0123456789abcdef0123456789abcdef"
WINDOW_S = 10.0  # the listen window here (the server's is longer); only ends a failure


@contextlib.contextmanager
def listening(monkeypatch, held: list[socket.socket]):
    """The server's listener (op_listen) and its ``_accept`` in a thread: yields the
    port and a function that waits for what ``_accept`` returned. ``held``: the
    test's connections, closed at the end."""
    monkeypatch.setattr(env_server, "LISTEN_WAIT_S", WINDOW_S)
    made = env_server.EnvServer(types.SimpleNamespace())
    port = made.op_listen(TOKEN.decode())["port"]
    r, w = os.pipe()
    with os.fdopen(r, "rb") as requests:
        got: list = []
        server = threading.Thread(target=lambda: got.append(
            env_server._accept(made.listener, TOKEN, requests)), daemon=True)
        server.start()

        def taken():
            server.join(WINDOW_S + 30)
            assert got and got[0] is not None, "the client with the token was not taken"
            return got[0]

        try:
            yield port, taken
        finally:
            for s in held:
                s.close()
            os.close(w)


def test_a_silent_or_slow_connection_first_does_not_keep_the_client_out(monkeypatch):
    held: list[socket.socket] = []
    with listening(monkeypatch, held) as (port, taken):
        lurkers = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        held += lurkers
        lurkers[1].sendall(TOKEN[:1])  # a slow one: the start of a line, never its end
        client = socket.create_connection(("127.0.0.1", port))
        held.append(client)
        client.sendall(TOKEN + b"\n")
        reader, writer = taken()
        lurkers[2].sendall(TOKEN[:4])  # still connected, still silent: it took nothing
        writer.write(b"reply\n")
        writer.flush()
        client.settimeout(30)
        assert client.recv(16) == b"reply\n"
        for s in lurkers:  # each hung up on once the client was taken
            s.settimeout(30)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:  # (what it sent was never read)
                pass
        reader.close()
        writer.close()


def test_many_connections_that_never_speak_are_bounded(monkeypatch):
    """Each waiting connection is held by the server: a process opening many holds at
    most MAX_PENDING of them (the oldest go), and the client still gets in."""
    held: list[socket.socket] = []
    with listening(monkeypatch, held) as (port, taken):
        for _ in range(2 * env_server.MAX_PENDING):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        held.append(client)
        client.sendall(TOKEN + b"\n")
        for f in taken():
            f.close()
