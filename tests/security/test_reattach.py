"""Attacks on live restore (docs/restart.md): who may take a sandbox over after its
daemon restarted.

The next daemon reattaches an agent only through the agent's reattach socket, a
descriptor the warden keeps and hands over on a root-only Unix socket in the state
directory. So:

- sandbox code that prepares for the restart (listening on every socket name it can
  think of, inside its own view of the filesystem and in the abstract namespace) is
  never contacted, and what answers the new daemon is still the agent (pid 1);
- sandbox code has no descriptor of the agent's (not in its own table, not through
  ``/proc/1/fd``, not through ``pidfd_getfd``) to forge a reattach with;
- a host process that is not root gets nothing from the warden, even with the socket
  file opened to everyone, and the real takeover still works afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

import corral
from tests.conftest import requires_root
from tests.faults.host import Host

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(600)]

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"

# Listens, inside the sandbox, wherever a careless design might look for the agent
# during a restart, and records every connection it gets.
SQUATTER = r"""
import os, socket, select, sys
names = ["/tmp/handover.sock", "/tmp/agent.sock", "/.corral/handover.sock",
         "/home/sandbox/handover.sock", sys.argv[1]]
socks = []
for name in names:
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            os.makedirs(os.path.dirname(name), exist_ok=True)
            if os.path.exists(name): os.unlink(name)
            s.bind(name); s.listen(8); socks.append(s)
        except OSError:
            s.close()
for abstract in (b"\0corral", b"\0corral-handover", b"\0corral-agent"):
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.bind(abstract); s.listen(8); socks.append(s)
        except OSError:
            s.close()
open("/tmp/squatting", "w").write(str(len(socks)))
while True:
    ready, _, _ = select.select(socks, [], [])
    for s in ready:
        conn, _ = s.accept()
        with open("/tmp/contacted", "a") as f:
            f.write(repr(s.getsockname()) + "\n")
        conn.close()
"""

# What sandbox code can find of the agent's descriptors.
PROBE = r"""
import ctypes, json, os, socket
found = {"own_sockets": [], "proc1_fd": None, "pidfd_getfd": []}
for fd in range(3, 1024):
    try:
        s = socket.socket(fileno=os.dup(fd))
        found["own_sockets"].append([fd, s.type])
        s.detach()
    except OSError:
        pass
try:
    found["proc1_fd"] = os.listdir("/proc/1/fd")
except OSError as e:
    found["proc1_fd"] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
pidfd = libc.syscall(434, 1, 0)  # pidfd_open(1)
for target in range(0, 64):
    got = libc.syscall(438, pidfd, target, 0) if pidfd >= 0 else -1  # pidfd_getfd
    if got >= 0:
        found["pidfd_getfd"].append(target)
print(json.dumps(found))
"""


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host.make("--restore-grace", "120", "--shutdown-grace", "0.5")
    h.start()
    yield h
    h.stop()
    h.remove()


def _client(h: Host) -> corral.Client:
    return corral.Client(f"unix://{h.socket}")


def _wait(check, what: str, limit: float = 60.0):  # noqa: ANN001, ANN202 - a test helper
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {limit:g} s: {what}")


def test_sandbox_code_has_no_descriptor_to_reattach_with(host: Host) -> None:
    with _client(host) as c:
        sb = corral.Sandbox.create(client=c, memory_mb=128)
        r = sb.exec(["python3", "-c", PROBE], timeout=60)
        assert r.returncode == 0, r.stderr
        found = json.loads(r.stdout)
        assert found["own_sockets"] == [], found  # nothing inherited from the agent
        assert isinstance(found["proc1_fd"], int), found  # EACCES: not dumpable
        assert found["pidfd_getfd"] == [], found
        sb.delete()


def test_sandbox_code_squatting_socket_names_is_never_contacted(host: Host) -> None:
    with _client(host) as c:
        sb = corral.Sandbox.create(client=c, memory_mb=128, timeout=600)
        sid = sb.id
        # the state directory's own path too, inside the sandbox's filesystem
        sb.spawn(["python3", "-c", SQUATTER, str(host.state / "handover.sock")])
        _wait(lambda: sb.exec("cat /tmp/squatting 2>/dev/null").stdout.strip(), "squatting")
        agent_before = sb.exec("cat /proc/1/cmdline | tr '\\0' ' '").stdout
    host.kill9()
    host.start()
    with _client(host) as c:
        sb = corral.Sandbox.connect(sid, client=c)
        assert sb.state == corral.SandboxState.RUNNING
        assert sb.exec("cat /tmp/contacted 2>/dev/null").stdout == ""  # never contacted
        # what answers is still the agent (pid 1), with its own reply to a fresh command
        assert sb.exec("cat /proc/1/cmdline | tr '\\0' ' '").stdout == agent_before
        assert agent_before.startswith("/.corral/agent serve")
        token = os.urandom(8).hex()
        assert sb.exec(["sh", "-c", f"echo {token}"]).stdout.strip() == token
        sb.delete()


def _take_over_as(uid: int, path: str) -> dict[str, object]:
    """Try the handover protocol on ``path`` as ``uid``: what it got."""
    code = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.settimeout(10)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "    msg, fds, _, _ = socket.recv_fds(s, 4096, 8)\n"
        "    print(json.dumps({'msg': msg.decode(errors='replace'), 'fds': len(fds)}))\n"
        "except OSError as e:\n"
        "    print(json.dumps({'error': e.errno}))\n"
    )
    # the system's python: this test's own may live under /root, which nobody can reach
    out = subprocess.run([SYSTEM_PYTHON, "-I", "-c", code, path], user=uid, group=uid,
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs /usr/bin/python3")
def test_a_host_user_that_is_not_root_cannot_take_over(host: Host) -> None:
    with _client(host) as c:
        sid = corral.Sandbox.create(client=c, memory_mb=64, timeout=600).id
    host.kill9()
    path = host.state / "handover.sock"
    _wait(path.exists, "the warden offers the handover")
    # the file is root's, 0600
    assert _take_over_as(NOBODY, str(path)) == {"error": 13}
    # even opened to everyone (an operator's mistake), the warden checks who connects
    os.chmod(path, 0o666)
    got = _take_over_as(NOBODY, str(path))
    assert got.get("fds", 0) == 0 and got.get("msg", "") == "", got
    # the warden still waits, and the real next daemon takes everything over
    assert path.exists()
    host.start()
    with _client(host) as c:
        sb = corral.Sandbox.connect(sid, client=c)
        assert sb.state == corral.SandboxState.RUNNING
        assert sb.exec("echo ok").stdout.strip() == "ok"
        sb.delete()
    assert not path.exists()
