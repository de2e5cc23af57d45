"""What a sandbox can see and do: nothing of the host, nothing of its neighbours."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import pytest

from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

PROJECT = Path(__file__).resolve().parents[2]


async def sh(engine, sid, cmd, **kw):
    r = await engine.exec(sid, cmd, **kw)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


async def test_host_paths_and_env_are_invisible(engine, state_dir):
    marker = f"corral-secret-{uuid.uuid4().hex}"
    root_marker = Path("/root") / marker
    home_marker = Path("/home") / marker
    root_marker.write_text("host secret")
    home_marker.mkdir()
    os.environ["CORRAL_TEST_HOST_SECRET"] = marker
    try:
        info = await engine.create()
        for path in (root_marker, home_marker, PROJECT, state_dir, engine.layout.cache_dir):
            code, _, _ = await sh(engine, info.id, ["test", "-e", str(path)])
            assert code == 1, f"{path} is visible inside the sandbox"
        code, out, _ = await sh(engine, info.id, "env; ls -A /home /root 2>&1 || true")
        assert marker not in out
        assert "CORRAL_TEST_HOST_SECRET" not in out
        _, out, _ = await sh(engine, info.id, "cat /proc/1/cmdline | tr '\\0' ' '; echo; ls /proc")
        pids = [p for p in out.split() if p.isdigit()]
        assert len(pids) < 10, f"sandbox sees foreign processes: {pids}"
    finally:
        del os.environ["CORRAL_TEST_HOST_SECRET"]
        root_marker.unlink()
        home_marker.rmdir()


async def test_unprivileged_user_without_capabilities(engine):
    info = await engine.create()
    code, out, _ = await sh(engine, info.id, "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    lines = out.split()
    assert code == 0
    assert lines[0] == "1000"
    assert "0000000000000000" in out and "NoNewPrivs:\t1" in out.replace(" ", "\t")


async def test_image_is_read_only_but_own_dirs_are_writable(engine):
    info = await engine.create()
    for target in ("/usr/bin/evil", "/etc/passwd", "/usr/lib/x"):
        code, _, err = await sh(engine, info.id, f"echo x > {target}")
        assert code != 0, f"could write {target}"
        assert "Permission denied" in err
    code, _, _ = await sh(engine, info.id, "echo x > /workspace/a && echo y > /tmp/b && mkdir -p /app/c && echo z > ~/d")
    assert code == 0


async def test_neighbours_files_and_processes_are_invisible(engine):
    a = await engine.create()
    b = await engine.create()
    await engine.write_file(a.id, "/workspace/secret.txt", "only for a")
    await engine.exec(a.id, "sleep 30 >/dev/null 2>&1 &")
    code, out, _ = await sh(engine, b.id, "cat /workspace/secret.txt; ps -e 2>/dev/null || ls /proc")
    assert code != 0 or "only for a" not in out
    assert "only for a" not in out
    assert "sleep" not in out
    assert await engine.read_file(a.id, "/workspace/secret.txt") == b"only for a"


async def test_network_is_loopback_only(engine):
    info = await engine.create()
    probe = (
        "import socket, json\n"
        "res = {}\n"
        "for host in ('1.1.1.1', '10.0.0.1', '8.8.8.8'):\n"
        "    s = socket.socket(); s.settimeout(1)\n"
        "    try: s.connect((host, 53)); res[host] = 'connected'\n"
        "    except OSError as e: res[host] = e.errno\n"
        "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()\n"
        "c = socket.create_connection(srv.getsockname()); res['loopback'] = 'ok'\n"
        "res['ifaces'] = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"
        "print(json.dumps(res))\n"
    )
    code, out, err = await sh(engine, info.id, ["python3", "-c", probe])
    assert code == 0, err
    res = json.loads(out)
    assert res["loopback"] == "ok"
    assert res["ifaces"] == ["lo"]
    for host in ("1.1.1.1", "10.0.0.1", "8.8.8.8"):
        assert res[host] != "connected"


SYSCALL_PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    rc = libc.syscall(nr, *args)
    return 0 if rc >= 0 else ctypes.get_errno()
NR = dict(mount=165, ptrace=101, unshare=272, init_module=175, finit_module=313,
          keyctl=250, bpf=321, kexec_load=246, perf_event_open=298, reboot=169,
          swapon=167, setns=308)
res = {
    "mount": call(NR["mount"], b"none", b"/tmp", b"tmpfs", 0, None),
    "ptrace": call(NR["ptrace"], 0, 0, 0, 0),
    "unshare_user": call(NR["unshare"], 0x10000000),
    "unshare_ns": call(NR["unshare"], 0x00020000),
    "finit_module": call(NR["finit_module"], 0, b"", 0),
    "keyctl": call(NR["keyctl"], 0, 0, 0, 0),
}
print(json.dumps(res))
"""


async def test_dangerous_syscalls_are_denied(engine):
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    info = await engine.create()
    code, out, err = await sh(engine, info.id, ["python3", "-c", SYSCALL_PROBE])
    assert code == 0, err
    res = json.loads(out)
    for name, errno_ in res.items():
        assert errno_ == 1, f"{name} was not denied with EPERM (got errno {errno_})"
    code, _, _ = await sh(engine, info.id, "unshare -U true || unshare -m true")
    assert code != 0


async def test_symlinks_and_dotdot_cannot_reach_the_host(engine):
    from corral.errors import FileError, FileNotFound, PathOutsideSandbox

    marker = Path("/root") / f"corral-link-{uuid.uuid4().hex}"
    marker.write_text("host only")
    try:
        info = await engine.create()
        await engine.exec(info.id, ["ln", "-s", str(marker), "/workspace/link"])
        await engine.exec(info.id, ["ln", "-s", "/", "/workspace/rootlink"])
        with pytest.raises((FileNotFound, FileError)):
            await engine.read_file(info.id, "/workspace/link")
        with pytest.raises((FileNotFound, FileError)):
            await engine.read_file(info.id, f"/workspace/rootlink{marker}")
        with pytest.raises(PathOutsideSandbox):
            await engine.read_file(info.id, "../../../etc/passwd")
        with pytest.raises(PathOutsideSandbox):
            await engine.write_file(info.id, "/workspace/../../x", b"")
        # '..' that stays inside is fine and resolves normally
        await engine.write_file(info.id, "/workspace/sub/../ok.txt", b"fine")
        assert await engine.read_file(info.id, "/workspace/ok.txt") == b"fine"
    finally:
        marker.unlink()


async def test_neighbour_and_host_survive_a_memory_bomb(engine):
    bomb = await engine.create(memory_mb=64)
    calm = await engine.create(memory_mb=64)
    task = asyncio.create_task(
        engine.exec(bomb.id, ["python3", "-c", "x = [bytearray(1 << 20) for _ in range(4096)]"])
    )
    for _ in range(5):
        code, out, _ = await sh(engine, calm.id, "echo alive")
        assert (code, out) == (0, "alive\n")
    r = await task
    assert r.oom_killed and r.returncode == -9 and not r.timed_out
    code, out, _ = await sh(engine, bomb.id, "echo still here")
    assert out == "still here\n"


async def test_host_network_is_opt_in(engine):
    info = await engine.create(network="host")
    code, out, _ = await sh(engine, info.id, "cat /proc/net/dev")
    ifaces = [line.split(":")[0].strip() for line in out.splitlines()[2:]]
    assert code == 0 and "lo" in ifaces and len(ifaces) > 1
