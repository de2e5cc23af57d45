"""The port socket (``/v1/sandboxes/{id}/ports/{port}/socket``, server/port_socket.py):
a WebSocket to a port of one's own sandbox, through the same door as every request.

Attacks: another tenant's token (and no token, and a wrong one) opens nothing, and is
refused exactly as for an id that does not exist; a tenant cannot hold more of them
than its live streams allow; a revoked token's open socket is closed. A real daemon on
TCP, two tenants, a line echo server in alice's sandbox, the real ``websockets`` client.
"""

from __future__ import annotations

import time

import pytest

import corral
from tests.security.tenants_helpers import UNKNOWN, team_daemon

websockets = pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

PORT = 8000  # inside the sandbox's own network namespace
ECHO = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('127.0.0.1', {PORT})); s.listen(8)\n"
    "import threading\n"
    "def echo(c):\n"
    "    while d := c.recv(65536):\n"
    "        c.sendall(d)\n"
    "while True:\n"
    "    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()\n"
)


@pytest.fixture(scope="module")
def team():
    with team_daemon("--max-tenant-streams", "2") as t:
        t.make_token("carol")
        with corral.Client(t.url, token=t.tokens["alice"]) as client:
            sb = corral.Sandbox.create(memory_mb=64, client=client)
            proc = sb.spawn(["python3", "-c", ECHO])
            deadline = time.monotonic() + 30
            while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
                assert time.monotonic() < deadline, "the echo server did not listen"
                time.sleep(0.1)
            t.sandbox_id = sb.id
            yield t
            proc.close()
            sb.delete()


def _open(team, token: str | None, sandbox_id: str | None = None, port: int = PORT):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    url = f"ws://127.0.0.1:{team.port}/v1/sandboxes/{sandbox_id or team.sandbox_id}/ports/{port}/socket"
    return connect(url, additional_headers=headers, open_timeout=30)


def _refused(team, token: str | None, sandbox_id: str | None = None) -> int:
    with pytest.raises(InvalidStatus) as caught:
        _open(team, token, sandbox_id)
    return caught.value.response.status_code


def test_the_owner_reaches_the_port_and_bytes_pass_both_ways(team):
    with _open(team, team.tokens["alice"]) as ws:
        ws.send(b"hello\n")
        assert ws.recv(timeout=30) == b"hello\n"
        big = bytes(range(256)) * 2048
        ws.send(big)
        got = b""
        while len(got) < len(big):
            got += ws.recv(timeout=30)
        assert got == big


def test_another_tenant_or_no_token_opens_nothing(team):
    unknown = _refused(team, team.tokens["bob"], UNKNOWN)
    assert _refused(team, team.tokens["bob"], team.sandbox_id) == unknown  # as if missing
    assert _refused(team, None) in (401, 403)
    assert _refused(team, "not-a-token") in (401, 403)
    with pytest.raises(InvalidStatus):  # a path that is not a port socket
        connect(f"ws://127.0.0.1:{team.port}/v1/sandboxes/{team.sandbox_id}/ports/x/socket",
                additional_headers={"Authorization": f"Bearer {team.tokens['alice']}"},
                open_timeout=30)


def test_a_tenants_port_sockets_are_capped_by_its_live_streams(team):
    token = team.tokens["alice"]
    with _open(team, token):
        with _open(team, token):
            assert _refused(team, token) == 403  # over --max-tenant-streams 2
        deadline = time.monotonic() + 30
        while True:  # the daemon gives the stream back once it sees the close
            try:
                with _open(team, token):
                    break
            except InvalidStatus:
                assert time.monotonic() < deadline
                time.sleep(0.1)


def test_revoking_the_token_closes_its_open_port_socket(team):
    with corral.Client(team.url, token=team.tokens["carol"]) as client:
        sb = corral.Sandbox.create(memory_mb=64, client=client)
        try:
            sb.spawn(["python3", "-c", ECHO])
            deadline = time.monotonic() + 30
            while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            with _open(team, team.tokens["carol"], sb.id) as ws:
                ws.send(b"x\n")
                assert ws.recv(timeout=30) == b"x\n"
                with team.admin() as admin:
                    assert admin.delete("/v1/tokens/carol").status_code in (200, 204)
                with pytest.raises(ConnectionClosed):
                    for _ in range(300):
                        ws.send(b"x\n")
                        ws.recv(timeout=30)
        finally:
            with team.admin() as admin:
                admin.delete(f"/v1/sandboxes/{sb.id}")


def _sandbox_token(tenant: str, sandbox_id: str) -> str:
    """An E2B per-sandbox (envd) token of ``tenant`` for ``sandbox_id``, as the daemon
    mints it (server/door.py: keyed on the daemon's token)."""
    import hashlib
    import hmac

    from corral.server.door import ENVD
    from tests.security.tenants_helpers import ADMIN_TOKEN

    mac = hmac.new(ADMIN_TOKEN.encode(), ENVD + tenant.encode() + b"\0" + sandbox_id.encode(),
                   hashlib.sha256).hexdigest()
    return f"{tenant}.{mac}"


def _open_e2b(team, scoped_to: str, token: str, sandbox_id: str):
    url = f"ws://127.0.0.1:{team.port}/v1/sandboxes/{sandbox_id}/ports/{PORT}/socket"
    return connect(url, open_timeout=30, additional_headers={
        "E2b-Sandbox-Id": scoped_to, "X-Access-Token": token})


def test_a_sandbox_scoped_token_opens_only_its_own_sandboxs_port(team):
    """Token confusion: a per-sandbox token (E2B's envd access token) of alice's for
    another sandbox of hers, presented with that sandbox's id in the header, opens no
    port socket of this one; the same kind of token for this sandbox does."""
    mine = _sandbox_token("alice", team.sandbox_id)
    with _open_e2b(team, team.sandbox_id, mine, team.sandbox_id) as ws:  # the control
        ws.send(b"ok\n")
        assert ws.recv(timeout=30) == b"ok\n"
    other = "sbx-" + "0" * 12
    unknown = _refused(team, team.tokens["alice"], UNKNOWN)
    with pytest.raises(InvalidStatus) as caught:
        _open_e2b(team, other, _sandbox_token("alice", other), team.sandbox_id)
    assert caught.value.response.status_code == unknown
    with pytest.raises(InvalidStatus):  # bob's token for alice's sandbox: not his to mint
        _open_e2b(team, team.sandbox_id, _sandbox_token("bob", team.sandbox_id), team.sandbox_id)


@pytest.mark.parametrize("port", [0, 65536, 99999])
def test_a_port_out_of_range_is_refused_without_a_traceback(team, port):
    from tests.security.tenants_helpers import no_traceback

    with pytest.raises(InvalidStatus):
        _open(team, team.tokens["alice"], port=port)
    no_traceback(team)


def _rss_mb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
    raise AssertionError("no VmRSS")


def test_a_client_that_pings_and_never_reads_cannot_grow_the_daemons_memory(team):
    """uvicorn answers each ping at once into the write buffer: a client that sent pings
    and read nothing grew the daemon by what it sent (300 MB: +290 MB). Now the daemon
    stops reading it while the pongs wait (server/ws_flow.py)."""
    import base64
    import os
    import socket

    pid = team.daemon.proc.pid
    s = socket.create_connection(("127.0.0.1", team.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET /v1/sandboxes/{team.sandbox_id}/ports/{PORT}/socket HTTP/1.1\r\n"
                   f"Host: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                   f"Authorization: Bearer {team.tokens['alice']}\r\n\r\n").encode())
        assert s.recv(12) == b"HTTP/1.1 101"
        before = _rss_mb(pid)
        ping = bytes([0x89, 0x80 | 125]) + b"\0\0\0\0" + b"p" * 125  # masked, empty mask
        batch, sent = ping * 8192, 0
        s.settimeout(3)  # the daemon stops reading: the send blocks, then times out
        try:
            while sent < 192 << 20:
                s.sendall(batch)
                sent += len(batch)
        except TimeoutError:
            pass
        grown = _rss_mb(pid) - before
        assert grown < 64, f"the daemon grew by {grown} MB for {sent >> 20} MB of pings"
    finally:
        s.close()


def test_a_held_connection_does_not_stop_the_sandboxs_checkpoint(team):
    """CRIU dumps no connected TCP socket: whoever held a connection into a checkpointable
    sandbox (a port socket; anyone with one of its exposed URLs) made its checkpoint
    fail, so its hibernation at its timeout ended it instead. The daemon's connections
    into it are reset before the dump: the checkpoint is taken, the holder's closed."""
    from tests.security.test_live_checkpoint import _need_criu

    _need_criu()
    with corral.Client(team.url, token=team.tokens["alice"]) as client:
        sb = corral.Sandbox.create(memory_mb=64, checkpointable=True, network="none",
                                   client=client)
        try:
            sb.spawn(["python3", "-c", ECHO])
            deadline = time.monotonic() + 30
            while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
                assert time.monotonic() < deadline, "the echo server did not listen"
                time.sleep(0.1)
            with _open(team, team.tokens["alice"], sb.id) as ws:
                ws.send(b"held\n")
                assert ws.recv(timeout=30) == b"held\n"
                snap = sb.checkpoint()
                with pytest.raises(ConnectionClosed):
                    ws.recv(timeout=30)
            snap.delete()
            # a connection handed over on the Unix socket: the daemon's reference resets it
            from corral.rl._port_channel import _handed

            handed = _handed(str(team.daemon.socket), f"/v1/sandboxes/{sb.id}/ports/{PORT}/socket")
            assert handed is not None
            handed.write(b"held\n")
            assert handed.readline() == b"held\n"
            sb.checkpoint().delete()
            assert handed.readline() == b""  # reset: the holder's end, not a hang
            handed.close()
            assert sb.exec(["echo", "alive"]).stdout.strip() == "alive"
        finally:
            sb.delete()
    from tests.security.tenants_helpers import no_traceback

    no_traceback(team)


# ------------------------------------------------ the handoff (the daemon's Unix socket)

def _established(team) -> int:
    """Connections to the echo server's port that are open, as the sandbox sees them."""
    with corral.Client(team.daemon.url) as client:
        sb = corral.Sandbox.connect(team.sandbox_id, client=client)
        rows = sb.exec(["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]
    return sum(1 for r in rows if r.split()[1].endswith(f":{PORT:04X}") and r.split()[3] == "01")


def test_the_unix_socket_hands_the_connection_over_and_its_end_ends_it(team):
    """On the daemon's own socket the client gets the connection itself (bytes pass with
    no relay); when it ends the request and closes, nothing of the connection stays open
    (the daemon let its own reference go), so the server sees its end."""
    from corral.rl._port_channel import HandedChannel, _handed

    before = _established(team)
    channel = _handed(str(team.daemon.socket),
                      f"/v1/sandboxes/{team.sandbox_id}/ports/{PORT}/socket")
    assert isinstance(channel, HandedChannel)
    channel.write(b"hello\n")
    assert channel.readline() == b"hello\n"
    assert _established(team) == before + 1
    channel.close()
    deadline = time.monotonic() + 30
    while _established(team) > before:
        assert time.monotonic() < deadline, "the connection stayed open after the client's end"
        time.sleep(0.1)


def test_no_handoff_on_tcp_even_for_the_owner(team):
    """A descriptor crosses only the Unix socket: on TCP the handoff is refused (the
    WebSocket is the way there), and another tenant is refused as for a missing id."""
    path = f"/v1/sandboxes/{team.sandbox_id}/ports/{PORT}/handoff"
    with team.tenant("alice") as alice:
        r = alice.post(path)
    assert r.status_code == 400 and "Unix socket" in r.json()["error"]["message"]
    with team.tenant("bob") as bob:
        assert bob.post(path).status_code in (400, 404)


# ------------------------------------- the handoff with a tenant's token (red team 10)

def _raw_handoff(team, token: str | None, sandbox_id: str, port: int = PORT):
    """``(status, descriptor or None, lease)``: a handoff asked on the daemon's Unix
    socket with ``token`` as the bearer (the lease is the request; close it to end)."""
    import socket

    lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lease.settimeout(30)
    lease.connect(str(team.daemon.socket))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    lease.sendall(f"POST /v1/sandboxes/{sandbox_id}/ports/{port}/handoff HTTP/1.1\r\n"
                  f"Host: localhost\r\n{auth}Content-Length: 0\r\n\r\n".encode())
    first, fds, _, _ = socket.recv_fds(lease, 1, 1)
    head = first
    while b"\r\n\r\n" not in head:
        chunk = lease.recv(4096)
        assert chunk, head
        head += chunk
    head = head.lstrip(b"\0")
    status = int(head.split(b" ", 2)[1])
    sock = socket.socket(fileno=fds[0]) if fds else None
    if sock is not None:
        sock.settimeout(30)  # the daemon's side was non-blocking (one file description)
    return status, sock, lease


def test_only_the_sockets_owner_can_ask_for_a_handoff(team):
    """The handoff is the admin's (the Unix socket's owner): another host user cannot
    even connect to the socket (0600), so no tenant takes a handoff
    there; a tenant's token on TCP is refused (test above)."""
    import os
    import socket
    import stat

    path = team.daemon.socket
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another host user (nobody) tries the socket
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(str(path))
                os.write(w, b"connected")
            except OSError as exc:
                os.write(w, type(exc).__name__.encode())
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 100)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"PermissionError", got


def test_a_deleted_sandboxs_handed_connection_ends(team):
    """Deleting the sandbox ends a connection handed over to its owner (the admin, on
    the socket): nothing of the sandbox's namespace lives on in the holder's hand."""
    client = corral.Client(team.daemon.url)
    sb = corral.Sandbox.create(memory_mb=64, client=client)
    try:
        sb.spawn(["python3", "-c", ECHO])
        deadline = time.monotonic() + 30
        while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status, conn, lease = _raw_handoff(team, None, sb.id)
        assert status == 200
        conn.sendall(b"y\n")
        assert conn.recv(16) == b"y\n"
        with team.admin() as admin:
            assert admin.delete(f"/v1/sandboxes/{sb.id}").status_code in (200, 204)
        with pytest.raises(OSError):
            for _ in range(300):
                conn.sendall(b"y\n")
                if not conn.recv(16):
                    raise ConnectionResetError("ended")
                time.sleep(0.05)
        conn.close()
        lease.close()
    finally:
        with team.admin() as admin:
            admin.delete(f"/v1/sandboxes/{sb.id}")
        client.close()


def test_a_handed_socket_reconnected_after_the_delete_reaches_nothing(team):
    """The handed descriptor is a socket made in the sandbox's network namespace. Once
    the sandbox is deleted, its holder disconnecting it (``connect(AF_UNSPEC)``) and
    dialling again reaches nothing: not the deleted sandbox's port, not the same port
    of a sandbox made just after (its link may take the same number), not its address
    (red team 13)."""
    import errno

    from corral.runtime import syscalls

    def serving(network):
        sb = corral.Sandbox.create(memory_mb=64, network=network, client=client)
        sb.spawn(["python3", "-c", ECHO])
        deadline = time.monotonic() + 30
        while sb.exec(["sh", "-c", f"grep -q ':{PORT:04X} ' /proc/net/tcp"]).returncode:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        return sb

    client = corral.Client(team.daemon.url)
    made = []
    try:
        old = serving({"allow": []})
        made.append(old)
        status, conn, lease = _raw_handoff(team, None, old.id)
        assert status == 200
        old.delete()
        new = serving({"allow": []})
        made.append(new)
        new_ip = new.exec(["hostname", "-I"]).stdout.split()[0]
        for target in (("127.0.0.1", PORT), (new_ip, PORT)):
            syscalls.reset_tcp(conn.fileno())
            conn.settimeout(5)
            with pytest.raises(OSError) as caught:
                conn.connect(target)
                conn.sendall(b"z\n")
                if not conn.recv(16):
                    raise ConnectionResetError("ended")
            assert caught.value.errno != errno.EISCONN, caught.value
        conn.close()
        lease.close()
        rows = new.exec(["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]
        assert not [r for r in rows if r.split()[3] == "01"], rows  # nothing reached it
    finally:
        for sb in made:
            with team.admin() as admin:
                admin.delete(f"/v1/sandboxes/{sb.id}")
        client.close()
