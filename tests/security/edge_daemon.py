"""A real daemon on loopback TCP for the pre-authentication attacks (issue 23, part 5),
and raw sockets to attack it with from many loopback addresses."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator

import httpx

from tests.conftest import Daemon, _base_dir
from tests.server.conftest import free_port

TOKEN = "edge-test-token-" + "7" * 32  # 48 characters: not the short-token warning
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HANG_GUARD_S = 120  # only keeps a broken daemon from hanging the suite


class Served:
    """A daemon with ``extra`` arguments, optionally under ``prlimit --nofile=N``."""

    def __init__(self, *extra: str, open_files: int | None = None) -> None:
        self.port = free_port()
        wrapper = ["prlimit", f"--nofile={open_files}:{open_files}", "--"] if open_files else None
        self.daemon = Daemon(_base_dir(), ["--tcp", f"127.0.0.1:{self.port}", "--token", TOKEN,
                                           *extra], wrapper=wrapper).start()
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=AUTH, timeout=HANG_GUARD_S, **kwargs)

    def log(self) -> str:
        return self.daemon.log.read_text(errors="replace")

    def stop(self) -> None:
        self.daemon.stop()


@contextlib.contextmanager
def served(*extra: str, open_files: int | None = None) -> Iterator[Served]:
    s = Served(*extra, open_files=open_files)
    try:
        yield s
    finally:
        s.stop()


def source(index: int) -> str:
    """A loopback source address of its own (Linux routes all of 127/8 to lo)."""
    return f"127.0.{2 + index // 250}.{1 + index % 250}"


def silent(port: int, src: str) -> socket.socket:
    """A connection from ``src`` that sends nothing at all."""
    s = socket.socket()
    s.settimeout(HANG_GUARD_S)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


def idle_login_page(port: int, src: str) -> socket.socket | None:
    """A connection from ``src`` that fetched ``GET /ui/login`` (no credentials) and now
    only stays open; None if the daemon refused or closed it first."""
    s = socket.socket()
    s.settimeout(HANG_GUARD_S)
    try:
        s.bind((src, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /ui/login HTTP/1.1\r\nHost: x\r\n\r\n")
    except OSError:
        s.close()
        return None
    return s


def closed_by_daemon(sockets: list[socket.socket], within: float,
                     enough: int | None = None) -> int:
    """How many of ``sockets`` the daemon closed (EOF or reset) within ``within`` s;
    it stops looking once ``enough`` are closed."""
    open_ = {s.fileno(): s for s in sockets}
    poller = select.poll()
    for fd, s in open_.items():
        s.setblocking(False)
        poller.register(fd, select.POLLIN)
    closed = 0
    deadline = time.monotonic() + within
    while open_ and (left := deadline - time.monotonic()) > 0 and (
            enough is None or closed < enough):
        for fd, _ in poller.poll(min(left, 1.0) * 1000):
            s = open_[fd]
            try:
                while s.recv(65536):
                    pass
            except BlockingIOError:
                continue
            except OSError:
                pass
            closed += 1
            poller.unregister(fd)
            del open_[fd]
            if enough is not None and closed >= enough:
                break
    return closed


def burst(port: int, sources: list[str], requests: list[bytes]) -> list[int]:
    """Send ``requests[i]`` from ``sources[i]``, all connected first and then written at
    once (so the daemon sees them together, however slow this host is); the statuses."""
    conns = []
    for src in sources:
        s = socket.socket()
        s.settimeout(HANG_GUARD_S)
        s.bind((src, 0))
        s.connect(("127.0.0.1", port))
        conns.append(s)
    for s, request in zip(conns, requests, strict=True):
        s.sendall(request)
    statuses = []
    for s in conns:
        with s:
            head = b""
            while b"\r\n" not in head and (chunk := s.recv(4096)):
                head += chunk
            statuses.append(int(head.split(b" ", 2)[1]) if head else 0)
    return statuses


def get_info(token: str) -> bytes:
    """``GET /v1/info`` with ``token`` as its bearer token, as raw bytes."""
    return (f"GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            "Connection: close\r\n\r\n").encode()


def still_open(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the daemon has not closed yet (whatever it sent is read)."""
    alive = 0
    for s in sockets:
        s.setblocking(False)
        try:
            while s.recv(65536):
                pass
        except BlockingIOError:
            alive += 1  # nothing more to read, and no EOF
        except OSError:
            pass
    return alive
