"""A daemon shared by a module's tenant tests: TCP with an admin token, two tenants."""

from __future__ import annotations

import re
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime
from tests.server.conftest import free_port, uds_client

ADMIN_TOKEN = "admin-" + "t" * 40
UNKNOWN = "sb-0123456789ab"  # an id nobody has


@dataclass
class Team:
    daemon: Daemon
    port: int
    tokens: dict[str, str] = field(default_factory=dict)
    grpc: str = ""  # host:port of the cwsandbox front-end, if it runs (grpc_team)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def admin(self) -> httpx.Client:
        return uds_client(self.daemon.socket)

    def tcp(self, token: str, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120,
                            headers={"Authorization": f"Bearer {token}"}, **kwargs)

    def tenant(self, name: str) -> httpx.Client:
        return self.tcp(self.tokens[name])

    def make_token(self, name: str, **quotas) -> str:
        with self.admin() as c:
            reply = c.post("/v1/tokens", json={"name": name, **quotas})
        assert reply.status_code == 201, reply.text
        self.tokens[name] = reply.json()["token"]
        return self.tokens[name]

    def cleanup(self) -> None:
        """Delete every sandbox, pool and snapshot (as the admin)."""
        with self.admin() as c:
            for p in c.get("/v1/pools").json()["pools"]:
                c.delete(f"/v1/pools/{p['name']}")
            for s in c.get("/v1/sandboxes").json()["sandboxes"]:
                c.delete(f"/v1/sandboxes/{s['id']}")
            for s in c.get("/v1/snapshots").json()["snapshots"]:
                c.delete(f"/v1/snapshots/{s['id']}")


@contextmanager
def team_daemon(*args: str) -> Iterator[Team]:
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    port = free_port()
    d = Daemon(_base_dir(), ["--tcp", f"127.0.0.1:{port}", "--token", ADMIN_TOKEN, *args])
    d.start()
    team = Team(d, port)
    try:
        team.make_token("alice", max_sandboxes=8)
        team.make_token("bob")
        yield team
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


@contextmanager
def grpc_team(*args: str) -> Iterator[Team]:
    """:func:`team_daemon` with the cwsandbox front-end (``team.grpc``: host:port); the
    daemon must log no traceback meanwhile."""
    port = free_port()
    with team_daemon("--grpc", f"127.0.0.1:{port}", *args) as team:
        team.grpc = f"127.0.0.1:{port}"
        yield team
        no_traceback(team)


def unknown_like(reply: httpx.Response, hidden_id: str, unknown: httpx.Response) -> None:
    """``reply`` (about another tenant's ``hidden_id``) is byte for byte the reply about
    an id that does not exist, but for the id itself."""
    assert reply.status_code == unknown.status_code, (reply.status_code, reply.text)
    assert reply.text.replace(hidden_id, "ID") == unknown.text.replace(UNKNOWN, "ID"), (
        reply.text, unknown.text)


def sandbox_with_secret(client: httpx.Client) -> str:
    """A new sandbox (64 MB) of ``client``'s tenant holding /workspace/secret."""
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64})
    assert reply.status_code == 201, reply.text
    sid = reply.json()["id"]
    assert client.put(f"/v1/sandboxes/{sid}/files?path=/workspace/secret",
                      content=b"alice's").status_code == 204
    return sid


def no_traceback(team: Team) -> None:
    text = team.daemon.log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]


TOKEN_RE = re.compile(r"crl_[A-Za-z0-9_-]{43}")


def read_by_peer(sock: socket.socket, limit: float = 60.0) -> None:
    """Wait until the peer of ``sock`` (a daemon on this host, over IPv4) has read all
    that was sent: nothing left in this end's send queue nor in the peer's receive
    queue (/proc/net/tcp). A fixed wait before a reset could let the reset discard what
    a loaded daemon had not read yet."""
    def key(addr: tuple[str, int]) -> str:
        return f"{socket.inet_aton(addr[0])[::-1].hex().upper()}:{addr[1]:04X}"

    mine, peer = key(sock.getsockname()), key(sock.getpeername())
    deadline = time.monotonic() + limit
    while True:
        queued = 0
        with open("/proc/net/tcp") as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                if (fields[1], fields[2]) in ((mine, peer), (peer, mine)):
                    tx, rx = (int(n, 16) for n in fields[4].split(":"))
                    queued += tx if fields[1] == mine else rx
        if not queued:
            return
        assert time.monotonic() < deadline, f"{queued} bytes still unread after {limit:g} s"
        time.sleep(0.05)
