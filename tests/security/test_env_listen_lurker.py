"""Red team of the env server's ``listen`` (guest/env_server.py: SandboxEnv's port
channel, issue 30), by a process the environment ran earlier that is still there when
the server listens again (after a live fork each copy and the parent listen on a port of
their own): it sees the new port in /proc/net/tcp and keeps connecting, saying nothing.
Connections are heard side by side (test_env_listen_token.py: a silent one first holds
no one up); here the flood: the listener's backlog was 1, so while the lurker's
connections filled it the client's were dropped and retried (64 connections took 13 s,
past the listen's window: the client got no port). Now the backlog is MAX_PENDING, and
the client with the token gets in among them.
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
