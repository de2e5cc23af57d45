"""Build steps as root (``user: root``, :mod:`corral.runtime.rootbuild`) are root of the
build sandbox's user namespace only: attacked from inside, checked from the host."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import pytest

from corral.runtime import image_cache
from corral.runtime.image_build import build_image
from corral.runtime.uids import RANGE_START
from tests.conftest import requires_root
from tests.security.conftest import agent_host_pid, run_json

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(600)]

ATTACKS = r"""
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
out = {"uid": os.getuid()}
def err(f):
    try:
        f()
        return 0
    except OSError as e:
        return e.errno
def call(r):
    return 0 if r == 0 else ctypes.get_errno()
out["caps"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
out["mount"] = call(libc.mount(b"none", b"/mnt", b"tmpfs", 0, None))
out["init_module"] = call(libc.syscall(175, None, 0, b""))
out["finit_module"] = call(libc.syscall(313, 0, b"", 0))
out["setuid_1000"] = err(lambda: os.setuid(1000))  # no other id is mapped
open("/tmp/f", "w").close()
out["chown_1000"] = err(lambda: os.chown("/tmp/f", 1000, 1000))
out["host_secret"] = os.path.exists(os.environ["SECRET"])
out["core_pattern"] = err(lambda: open("/proc/sys/kernel/core_pattern", "w").write("|/x"))
out["sysrq"] = err(lambda: open("/proc/sysrq-trigger", "w").write("h"))
out["mknod"] = err(lambda: os.mknod("/tmp/dev", 0o600 | 0o20000, os.makedev(1, 3)))
out["unshare_user"] = call(libc.unshare(0x10000000))
out["hostname"] = call(libc.sethostname(b"x", 1))
out["raw_socket"] = err(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, 1))
print(json.dumps(out))
"""


async def test_a_root_build_sandbox_is_root_of_its_namespace_only(engine, tmp_path):
    """The attacks a root step might try: host files, mounts, kernel modules, other
    ids, sysctls, devices, namespaces; and its processes run as its own host uid."""
    secret = tmp_path / "host-secret"
    secret.write_text("s3cret")
    info = await engine.create({"image": "python"}, build_root=True)
    try:
        got = await run_json(engine, info.id, f"import os; os.environ['SECRET']={str(secret)!r}\n"
                             + ATTACKS)
        status = Path(f"/proc/{agent_host_pid(engine, info.id)}/status").read_text()
        host_uid = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
        caps = int(next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16)
    finally:
        await engine.delete(info.id)
    assert got["uid"] == 0  # root in its namespace...
    assert host_uid >= RANGE_START  # ...which is its own unprivileged uid on the host
    assert caps != 0 and int(got["caps"], 16) == caps  # in that namespace only
    assert not int(got["caps"], 16) & (1 << 21 | 1 << 16 | 1 << 12 | 1 << 27)  # SYS_ADMIN, SYS_MODULE, NET_ADMIN, MKNOD
    assert got["host_secret"] is False
    for attack in ("mount", "init_module", "finit_module", "setuid_1000", "chown_1000",
                   "core_pattern", "sysrq", "mknod", "unshare_user", "hostname", "raw_socket"):
        assert got[attack] in (1, 2, 13, 22, 30, 38), (attack, got)  # EPERM ENOENT EACCES EINVAL EROFS ENOSYS


async def test_a_setuid_file_a_root_step_makes_gives_nothing(engine):
    """A root step leaves a set-user-id root shell and a setgid file: the layer on the
    host has no set-id bit, and at run time the sandbox user stays itself; even a
    set-id bit would be inert (nosuid mounts, no_new_privs, no root mapped)."""
    name = f"t-rootsuid-{secrets.token_hex(4)}"
    spec = {"base": "python", "steps": [{"user": "root", "run": (
        "cp /bin/bash /usr/local/bin/rootsh && chmod 4755 /usr/local/bin/rootsh && "
        "cp /bin/cat /usr/local/bin/rootcat && chmod 6755 /usr/local/bin/rootcat && "
        "echo root-only > /etc/root-only && chmod 600 /etc/root-only && "
        "test -u /usr/local/bin/rootsh")}]}  # set while it ran
    try:
        await build_image(engine, spec, name=name)
        tree = image_cache.layer_store(engine.images.images_dir).path(
            engine.images.manifest(name)["layers"][0]["id"])
        for f in ("rootsh", "rootcat"):
            st = os.lstat(tree / "usr/local/bin" / f)
            assert st.st_uid == 0 and not st.st_mode & (stat.S_ISUID | stat.S_ISGID), oct(st.st_mode)
        info = await engine.create({"image": name})
        try:
            got = await run_json(engine, info.id, r"""
import json, subprocess
run = lambda *a: subprocess.run(a, capture_output=True, text=True)
st = open("/proc/self/status").read()
print(json.dumps({
    "id": run("/usr/local/bin/rootsh", "-p", "-c", "id -u; id -g").stdout.split(),
    "read": run("/usr/local/bin/rootcat", "/etc/root-only").returncode,
    "nnp": [l.split()[1] for l in st.splitlines() if l.startswith("NoNewPrivs")][0],
    "nosuid": all("nosuid" in l.split()[5] for l in open("/proc/self/mountinfo")
                  if l.split()[4] == "/"),
}))""")
        finally:
            await engine.delete(info.id)
        assert got == {"id": ["1000", "1000"], "read": 1, "nnp": "1", "nosuid": True}, got
    finally:
        if engine.images.exists(name):
            engine.images.remove(name)
