"""What a sandbox can reach around its limits: /dev, address families, the OOM killer.

Each attack worked before (red-team pass of issue 24): ``/dev`` and ``/dev/shm`` were
bubblewrap's own host-sized tmpfs, owned by the sandbox user, so a sandbox of
``disk_mb=16, inodes=2000`` wrote 64 MB and 20 000 files there; ``socket(AF_VSOCK)``
worked from a ``network="none"`` sandbox (vsock ignores network namespaces); and the
agent's ``oom_score_adj`` was 0, like every command's, not what ``launch.c`` said.
Real engine, real sandboxes.
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.security.conftest import agent_host_pid, assert_honest, run_json

pytestmark = [requires_root, pytest.mark.root]

# argv[1]: a directory. Writes up to 64 MB, then up to 20 000 files, into it; says how
# far each got and why it stopped.
FILL = r"""
import json, os, sys
d = sys.argv[1]
out = {}
written = 0
try:
    with open(os.path.join(d, "big"), "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1 << 20
    out["write"] = "ok"
except OSError as e:
    out["write"] = e.errno
out["written"] = written
try:
    os.unlink(os.path.join(d, "big"))
except OSError:
    pass
files = 0
try:
    for i in range(20000):
        open(os.path.join(d, f"f{i}"), "w").close()
        files += 1
    out["files"] = "ok"
except OSError as e:
    out["files"] = e.errno
out["made"] = files
for i in range(files):
    os.unlink(os.path.join(d, f"f{i}"))
print(json.dumps(out))
"""

DEV = r"""
import json, os
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return e.errno
out = {
    "touch": attempt(lambda: open("/dev/x", "w").close()),
    "mkdir": attempt(lambda: os.mkdir("/dev/d")),
    "symlink": attempt(lambda: os.symlink("/tmp", "/dev/l")),
    "chmod": attempt(lambda: os.chmod("/dev", 0o777)),
    "null": attempt(lambda: open("/dev/null", "w").write("x")),
    "zero": len(open("/dev/zero", "rb").read(10)),
    "urandom": len(open("/dev/urandom", "rb").read(10)),
    "shm_mode": oct(os.stat("/dev/shm").st_mode & 0o7777),
}
import multiprocessing
lock = multiprocessing.Lock()  # a POSIX semaphore: a file in /dev/shm
with lock:
    out["semaphore"] = "ok"
print(json.dumps(out))
"""


async def test_dev_and_dev_shm_are_bounded_by_the_sandboxs_disk_and_inodes(engine):
    sid = (await engine.create(disk_mb=16, inodes=2000)).id
    shm = await run_json(engine, sid, FILL, "/dev/shm")
    assert shm["write"] == errno.ENOSPC and shm["written"] <= 16 << 20, shm
    # inodes=2000 counts files the sandbox makes; a few more are the layer's own slack
    assert shm["files"] == errno.ENOSPC and shm["made"] <= 2000 + 16, shm
    dev = await run_json(engine, sid, DEV)
    for name in ("touch", "mkdir", "symlink", "chmod"):
        assert dev[name] == errno.EROFS, (name, dev)
    # what /dev is for still works
    assert (dev["null"], dev["zero"], dev["urandom"], dev["shm_mode"]) == ("ok", 10, 10, "0o1777")
    assert dev["semaphore"] == "ok"
    # the control: the same fill in /tmp (the writable layer) stops at the same limits
    tmp = await run_json(engine, sid, FILL, "/tmp")
    assert tmp["write"] == errno.ENOSPC and tmp["files"] == errno.ENOSPC, tmp
    await assert_honest(engine, sid)


# argv[1]: JSON list of [family, type, protocol]. Says what socket() gave for each.
SOCKETS = r"""
import json, socket, sys
out = []
for fam, typ, proto in json.loads(sys.argv[1]):
    try:
        socket.socket(fam, typ, proto).close()
        out.append("ok")
    except OSError as e:
        out.append(e.errno)
try:
    a, b = socket.socketpair()
    a.sendall(b"x")
    out.append(b.recv(1).decode())
except OSError as e:
    out.append(e.errno)
print(json.dumps(out))
"""

AF_VSOCK, AF_PACKET, AF_ALG, AF_BLUETOOTH, AF_XDP, AF_TIPC, AF_KEY = 40, 17, 38, 31, 44, 30, 15
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET = 1, 2, 3, 5
NETLINK_ROUTE, NETLINK_AUDIT, NETLINK_KOBJECT_UEVENT, NETLINK_NETFILTER = 0, 9, 15, 12


async def test_address_families_a_sandbox_has_no_use_for_are_refused(engine):
    sid = (await engine.create(network="none")).id
    import json

    denied = [[AF_VSOCK, SOCK_STREAM, 0], [AF_VSOCK, SOCK_DGRAM, 0], [AF_PACKET, SOCK_RAW, 0],
              [AF_ALG, SOCK_SEQPACKET, 0], [AF_BLUETOOTH, SOCK_RAW, 0], [AF_XDP, SOCK_RAW, 0],
              [AF_TIPC, SOCK_STREAM, 0], [AF_KEY, SOCK_RAW, 2]]
    netlink_denied = [[16, SOCK_RAW, NETLINK_AUDIT], [16, SOCK_RAW, NETLINK_KOBJECT_UEVENT],
                      [16, SOCK_RAW, NETLINK_NETFILTER]]
    allowed = [[1, SOCK_STREAM, 0], [1, SOCK_DGRAM, 0], [2, SOCK_STREAM, 0], [2, SOCK_DGRAM, 0],
               [10, SOCK_STREAM, 0], [16, SOCK_RAW, NETLINK_ROUTE]]
    res = await run_json(engine, sid, SOCKETS, json.dumps(denied + netlink_denied + allowed))
    assert res[: len(denied)] == [errno.EAFNOSUPPORT] * len(denied), res
    res = res[len(denied):]
    assert res[: len(netlink_denied)] == [errno.EPROTONOSUPPORT] * len(netlink_denied), res
    assert res[len(netlink_denied):] == ["ok"] * len(allowed) + ["x"], res
    # loopback and name lookup (getaddrinfo's AI_ADDRCONFIG asks route netlink) still work
    r = await engine.exec(sid, ["python3", "-c", """
import socket, threading
s = socket.create_server(("127.0.0.1", 0))
threading.Thread(target=lambda: s.accept()[0].sendall(b"pong")).start()
c = socket.create_connection(s.getsockname())
print(c.recv(4).decode(), socket.getaddrinfo("localhost", 80, flags=socket.AI_ADDRCONFIG)[0][4][1])
"""], timeout=60)
    assert (r.returncode, r.stdout) == (0, b"pong 80\n"), r.stderr
    await assert_honest(engine, sid)


def _has_cap_sys_resource() -> bool:
    status = Path("/proc/self/status").read_text()
    eff = int(next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16)
    return bool(eff & (1 << 24))


LOWER = r"""
import json
out = {"self": int(open("/proc/self/oom_score_adj").read()),
       "agent": int(open("/proc/1/oom_score_adj").read())}
for value in ("500", "499", "-998"):
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(value)
        out[value] = "ok"
    except OSError as e:
        out[value] = e.errno
print(json.dumps(out))
"""


async def test_sandbox_code_is_killed_first_and_cannot_lower_its_oom_score(engine):
    sid = (await engine.create()).id
    pid = agent_host_pid(engine, sid)
    # seen from the host: the agent above every host process of the same size, and
    # every command above the agent (the cgroup's OOM killer picks a command)
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "500"
    res = await run_json(engine, sid, LOWER)
    assert (res["self"], res["agent"], res["500"]) == (1000, 500, "ok"), res
    if _has_cap_sys_resource():
        # the launcher pinned the floor: nothing in the sandbox goes below the agent
        assert res["499"] == res["-998"] == errno.EACCES, res
    else:
        # without CAP_SYS_RESOURCE (some containers) no floor can be pinned: the
        # engine's own floor holds, exactly what a host process beside it gets
        host = subprocess.run(["sh", "-c", "echo -998 > /proc/self/oom_score_adj"],
                              capture_output=True)
        assert (res["-998"] == "ok") == (host.returncode == 0), (res, host.stderr)
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "500"  # unchanged
    # a memory hog is killed, and the agent survives to say so
    hog = await engine.create(memory_mb=64)
    r = await engine.exec(hog.id, ["python3", "-c", "b = []\nwhile True: b.append(b'x' * (1 << 20))"],
                          timeout=120)
    assert r.oom_killed, r
    await assert_honest(engine, hog.id)
