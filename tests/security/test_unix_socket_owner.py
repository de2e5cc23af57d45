"""Red team of the SDK's Unix-socket path (issue 30: no TLS context on a Unix socket, so
nothing but the socket's path says who answers). Another local user who can put a
socket at the path the SDK uses (a directory it may write: a ``CORRAL_SOCKET`` under a
shared /tmp directory, the socket of a daemon that died) would be the daemon to a root
SDK: sent every request (code, files, secrets, a ``CORRAL_TOKEN``) and trusted for every
answer (an exec's output, a reward's verdict). Before, the SDK talked to it.

Now the SDK asks the kernel who serves a Unix socket (``SO_PEERCRED``) on every
connection and refuses anyone but root and its own user before it sends a byte
(``DaemonUnavailable``, which says so), blocking and asyncio alike; and the daemon will
not bind its socket in a directory other users may write (they could swap it). Real
sockets; the squatter really runs as another user (nobody), so root is needed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

import pytest

import corral
from corral.errors import DaemonUnavailable, InvalidArgument
from tests.conftest import _base_dir, requires_root

pytestmark = requires_root
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # the squatter's: one any user may run (stdlib only)
SQUATTER = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        data = c.recv(65536)
    except OSError:
        data = b""
    with open(sys.argv[2], "ab") as log:
        log.write(data)
    with open(sys.argv[2] + ".ended", "ab") as ended:  # one byte a connection it saw end
        ended.write(b".")
    body = b'{"status": "ok", "stdout": "forged"}'
    try:
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                  b"\r\n\r\n%s" % (len(body), body))
    except OSError:
        pass
    c.close()
"""


@pytest.fixture
def squatter():
    base = _base_dir()  # 0711: the squatter may reach its directory inside
    shared = base / "shared"
    shared.mkdir()
    os.chown(shared, NOBODY, NOBODY)  # a directory another user may write
    sock, log = shared / "corral.sock", shared / "received"
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", SQUATTER, str(sock), str(log)],
                            user=NOBODY, group=NOBODY, stdout=subprocess.PIPE, cwd="/")
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert os.stat(sock).st_uid == NOBODY
        yield sock, log
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def _received(log, connections: int = 1) -> bytes:
    """What the squatter got, once it saw ``connections`` connections end (it writes
    what each sent as it ends: a fixed wait read nothing yet on a loaded host)."""
    ended = log.with_name(log.name + ".ended")
    deadline = time.monotonic() + 60
    while not (ended.exists() and len(ended.read_bytes()) >= connections):
        assert time.monotonic() < deadline, f"the squatter saw no {connections} connections end"
        time.sleep(0.05)
    return log.read_bytes() if log.exists() else b""


def test_the_blocking_sdk_refuses_a_socket_another_user_serves(squatter):
    sock, log = squatter
    with corral.Client(f"unix://{sock}", token="crl_secret-of-the-caller") as client:
        with pytest.raises(DaemonUnavailable) as caught:
            client.health()
    assert f"uid {NOBODY}" in str(caught.value)
    assert _received(log) == b"", "the SDK sent its request to another user's socket"


def test_the_async_sdk_refuses_a_socket_another_user_serves(squatter):
    sock, log = squatter

    async def main() -> None:
        async with corral.AsyncClient(f"unix://{sock}", token="crl_secret") as client:
            with pytest.raises(DaemonUnavailable) as caught:
                await client.health()
        assert f"uid {NOBODY}" in str(caught.value)

    asyncio.run(main())
    assert _received(log) == b"", "the SDK sent its request to another user's socket"


def test_the_daemon_binds_no_socket_where_others_could_swap_it(tmp_path):
    from corral.server.daemon import bind_unix

    shared = tmp_path / "shared"
    shared.mkdir()
    for owner, mode in ((0, 0o777), (NOBODY, 0o700)):  # writable by all; another's
        os.chown(shared, owner, owner)
        os.chmod(shared, mode)
        with pytest.raises(InvalidArgument, match="other users"):
            bind_unix(shared / "corral.sock")
        assert not (shared / "corral.sock").exists()
    os.chown(shared, 0, 0)
    os.chmod(shared, 0o1777)  # sticky, like /tmp: nobody else may rename or remove it
    bind_unix(shared / "corral.sock").close()
    os.chmod(shared, 0o700)  # the control: its own directory
    (shared / "corral.sock").unlink()
    bind_unix(shared / "corral.sock").close()


def test_the_sdk_starts_no_daemon_where_others_could_swap_its_files(tmp_path):
    """The embedded default: the SDK writes its lock and log files next to the socket
    (a symlink planted there would have root append to any file) and starts a daemon."""
    from corral.client._embed import ensure_daemon

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(DaemonUnavailable, match="other users"):
        ensure_daemon(str(shared / "corral.sock"), start_timeout=5)
    assert list(shared.iterdir()) == []  # no lock, no log, no socket


def test_the_gym_port_channel_refuses_a_socket_another_user_serves(squatter):
    """SandboxEnv's port channel speaks its WebSocket on a socket of its own (not the
    SDK's transport): it refuses the same socket, sending nothing (and the env stays on
    its process's stdin and stdout)."""
    import types

    from corral.rl._port_channel import open_channel

    sock, log = squatter
    client = types.SimpleNamespace(url=f"unix://{sock}", connect_args={"token": "crl_secret"})
    sandbox = types.SimpleNamespace(id="sb-0123456789ab", client=client)
    assert open_channel(sandbox, 8000, b"token\n") is None
    assert _received(log) == b"", "the port channel wrote to another user's socket"


def test_no_socket_below_a_directory_another_user_may_rename_in(tmp_path):
    """Red team: the socket's own directory is root's (mode 0700), but the one above
    it is another user's: that user renames the whole directory away and puts one of
    their own (a socket, symlinks for the lock, log and pid files) in its place. Before,
    only the socket's own directory was looked at."""
    from corral.client._embed import ensure_daemon
    from corral.server.daemon import bind_unix

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    ours = theirs / "run"
    ours.mkdir(mode=0o700)  # root's
    with pytest.raises(InvalidArgument, match="belongs to uid"):
        bind_unix(ours / "corral.sock")
    with pytest.raises(DaemonUnavailable, match="belongs to uid"):
        ensure_daemon(str(ours / "corral.sock"), start_timeout=5)
    assert list(ours.iterdir()) == []  # no lock, no log, no socket
    via = tmp_path / "via"  # the same directory reached through a symlink: no way around
    via.symlink_to(ours)
    with pytest.raises(InvalidArgument, match="belongs to uid"):
        bind_unix(via / "corral.sock")
    os.chown(theirs, 0, 0)  # the control: root's all the way up
    bind_unix(ours / "corral.sock").close()


def test_a_lease_heartbeat_sends_nothing_to_a_socket_another_user_serves(squatter):
    """Red team: the lease's renewals run on a client of their own (a thread, a plain
    httpx transport): they sent the token every ``ttl / 3`` to whoever served the
    socket, past the SDK's check. Now they go through the same checked transport."""
    from corral.client._lease import Heartbeat

    sock, log = squatter
    beat = Heartbeat(f"unix://{sock}", "crl_secret-of-the-heartbeat", "lease-x", ttl=0.3)
    try:  # several renewals (a fixed 0.5 s could see none on a loaded host)
        got = _received(log, connections=3)
    finally:
        beat.stop()
    assert b"secret" not in got, "the heartbeat sent its token to another user"
