"""A squatter: whoever binds a daemon's old port after it died, recording what it is sent
(issue 23, must-do 7)."""

from __future__ import annotations

import contextlib
import socket
import threading


class Squatter:
    """A listener on loopback that records every byte it is sent. ``answer``: what it
    replies to each connection (``relay_to``: pipe the connection to that port instead,
    as a squatter relaying the proof exchange to the real daemon would)."""

    def __init__(self, answer: bytes = b"", relay_to: int | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = socket.create_server((host, port))  # SO_REUSEADDR, as any user's
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.answer, self.relay_to = answer, relay_to
        self.received = bytearray()
        self.connections = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        upstream = (socket.create_connection(("127.0.0.1", self.relay_to), timeout=10)
                    if self.relay_to else None)
        if upstream is not None:
            threading.Thread(target=_pump, args=(upstream, conn), daemon=True).start()
        with conn, (upstream or contextlib.nullcontext()):
            try:
                while data := conn.recv(65536):
                    self.received += data
                    if upstream is not None:
                        upstream.sendall(data)
                    elif self.answer:
                        conn.sendall(self.answer)
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
