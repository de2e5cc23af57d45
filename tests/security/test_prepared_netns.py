"""Attacks on the network namespaces warm slots prepare (``agent/netns.c``).

A warm launcher makes an empty network namespace while it waits, and the sandbox
without a network that takes the slot runs in it instead of one bwrap makes at
create. The namespace must be that one sandbox's only: two sandboxes never share
one (a shared namespace would be a channel between them: loopback ports, abstract
Unix sockets), no sandbox without a network ever lands in the host's, and sandboxes
that are to have the host's network (or bwrap's own namespace: checkpointable ones)
get exactly that.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path
from types import SimpleNamespace

from corral.runtime.launchargs import launch_args
from corral.schema import SandboxSpec
from tests.security.conftest import agent_host_pid, run_json

LISTEN = """
import json, socket, sys
name, port = sys.argv[1], int(sys.argv[2])
u = socket.socket(socket.AF_UNIX)
u.bind("\\0" + name)
u.listen()
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("127.0.0.1", port))
t.listen()
import os
if os.fork():
    print(json.dumps({"ok": True}))
    sys.exit(0)
os.setsid()
import time
time.sleep(120)
"""

PROBE = """
import json, socket, sys
name, port = sys.argv[1], int(sys.argv[2])
out = {}
try:
    s = socket.socket(socket.AF_UNIX); s.connect("\\0" + name); out["unix"] = "connected"
except OSError as exc:
    out["unix"] = type(exc).__name__
try:
    socket.create_connection(("127.0.0.1", port), timeout=5); out["tcp"] = "connected"
except OSError as exc:
    out["tcp"] = type(exc).__name__
print(json.dumps(out))
"""


def _netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


async def test_no_two_sandboxes_share_a_prepared_namespace(engine):
    """Sandboxes made at once (from warm slots and from slots made on the spot) each
    run in a namespace of their own, none the host's; what one listens on (a loopback
    port, an abstract Unix socket) another cannot reach, and its own loopback works."""
    infos = await asyncio.gather(*(engine.create() for _ in range(6)))
    spaces = [_netns(agent_host_pid(engine, i.id)) for i in infos]
    assert len(set(spaces)) == len(spaces), spaces
    assert _netns(os.getpid()) not in spaces
    # the prepared ones are in use: the outer bwrap is in the agent's namespace (with
    # bwrap's --unshare-net it would stay in the launcher's, the host's)
    assert any(_netns(engine._live[i.id].proc.pid) == space for i, space in zip(infos, spaces, strict=True))
    name, port = f"corral-{secrets.token_hex(6)}", 20000 + secrets.randbelow(20000)
    first, *others = infos
    assert (await run_json(engine, first.id, LISTEN, name, str(port)))["ok"]
    assert await run_json(engine, first.id, PROBE, name, str(port)) == {
        "unix": "connected", "tcp": "connected"}  # its own loopback works
    for other in others[:2]:
        assert await run_json(engine, other.id, PROBE, name, str(port)) == {
            "unix": "ConnectionRefusedError", "tcp": "ConnectionRefusedError"}


async def test_a_prepared_namespace_goes_only_to_a_sandbox_without_network(engine):
    """A host-network sandbox runs in the host's namespace (the slot's is left), a
    checkpointable one in bwrap's own, made inside the slot's user namespace."""
    host = await engine.create(network="host")
    assert _netns(agent_host_pid(engine, host.id)) == _netns(os.getpid())
    ckpt = await engine.create(checkpointable=True)
    live = engine._live[ckpt.id]
    inner = _netns(agent_host_pid(engine, ckpt.id))
    assert inner != _netns(os.getpid()) and inner != _netns(live.proc.pid)
    plain = await engine.create()
    space = _netns(agent_host_pid(engine, plain.id))
    assert space != _netns(os.getpid()) and space == _netns(engine._live[plain.id].proc.pid)


def test_without_a_prepared_namespace_bwrap_makes_one():
    """A launcher that could not make a namespace (it said "R": no CAP_SYS_ADMIN) gets
    bwrap's --unshare-net; one that made it gets none and keeps it; a host-network
    sandbox always leaves it (--host-net)."""
    spec = SandboxSpec.parse({})
    live = SimpleNamespace(
        spec=spec, program=(), netns=None, sandbox_dir=Path("/x/sb"), cpus=None,
        build_root=False, ro_binds=(), volumes=(), gpus=None)

    def args(own: bool, **changes) -> list[str]:
        slot = SimpleNamespace(own_netns=own, seccomp_fd=5, ctl_fd=6, reattach_fd=7)
        for k, v in changes.items():
            setattr(live, k, v)
        return launch_args(live, slot, [], bwrap="/usr/bin/bwrap", agent=Path("/a/agent"))

    plain = args(False)
    assert "--unshare-net" in plain and "--host-net" not in plain
    prepared = args(True)
    assert "--unshare-net" not in prepared and "--host-net" not in prepared
    host = args(True, spec=SandboxSpec.parse({"network": "host"}))
    assert "--host-net" in host and "--unshare-net" not in host
    ckpt = args(True, spec=SandboxSpec.parse({"checkpointable": True}))
    assert "--host-net" in ckpt and "--unshare-net" in ckpt


async def test_a_prepared_namespace_reaches_nothing_of_the_hosts(engine):
    """(red team 10) The host's own loopback port and abstract Unix socket (the host's
    namespace, where the launcher made the prepared one and keeps a descriptor of it
    until it becomes bwrap) are out of reach; root in the sandbox cannot change the
    prepared namespace (it is the host user namespace's: lo stays up, no interface
    can be added), nor see any interface but lo."""
    import socket

    name = f"corral-{secrets.token_hex(6)}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind("\0" + name)
    unix.listen()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    try:
        info = await engine.create()
        assert _netns(agent_host_pid(engine, info.id)) != _netns(os.getpid())
        probe = await run_json(engine, info.id, PROBE, name, str(tcp.getsockname()[1]))
        assert probe == {"unix": "ConnectionRefusedError", "tcp": "ConnectionRefusedError"}
        meddle = await engine.exec(info.id, [
            "sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1"],
            timeout=60, user="root")
        assert meddle.stdout.split() == [b"lo"], meddle.stdout
        r = await engine.exec(info.id, ["python3", "-c", CHANGE], timeout=60, user="root")
        changed = json.loads(r.stdout)
        assert changed == {"lo_down": "PermissionError", "lo_up": True}, changed
    finally:
        unix.close()
        tcp.close()


CHANGE = """
import fcntl, json, socket, struct
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
req = struct.pack("16sH", b"lo", 0)
flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, req)[:18])[1]
out = {}
try:
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags & ~IFF_UP))
    out["lo_down"] = "done"
except OSError as exc:
    out["lo_down"] = type(exc).__name__
flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, req)[:18])[1]
out["lo_up"] = bool(flags & IFF_UP)
print(json.dumps(out))
"""


async def test_a_policy_sandbox_runs_in_its_policys_namespace_not_the_slots(engine):
    """(red team 10) A warm slot's launcher made an empty namespace; a sandbox with a
    policy takes the slot and must run in its policy's namespace (its filtered link),
    bwrap and agent alike: never the prepared one (no network at all) nor the host's."""
    info = await engine.create(network={"allow": ["example.com"]})
    live = engine._live[info.id]
    assert live.netns
    policy = f"net:[{os.stat(live.netns).st_ino}]"
    assert _netns(agent_host_pid(engine, info.id)) == policy
    assert _netns(live.proc.pid) == policy
