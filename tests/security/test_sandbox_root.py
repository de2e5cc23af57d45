"""Root in a sandbox (``exec(..., user="root")``, an image's ``USER root``) is root of
the sandbox's user namespace only (docs/users.md): attacked from inside (the host,
mounts, devices, the kernel, cgroups, limits, the agent, other ids), checked from the
host, and against a second sandbox."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from corral.runtime.uids import RANGE_START, root_uid
from tests.conftest import requires_root
from tests.security.conftest import agent_host_pid, assert_honest, run_json
from tests.security.test_root_build import ATTACKS

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]

MORE = r"""
import resource, subprocess
out["setuid_other"] = err(lambda: os.setuid(1234))  # only 0 and 1000 are mapped
out["chown_other"] = err(lambda: os.chown("/tmp/f", 1234, 1234))
out["agent_environ"] = err(lambda: open("/proc/1/environ").read())
out["agent_mem"] = err(lambda: open("/proc/1/mem", "rb").read(1))
# (root may list the agent's descriptor numbers, which /proc shows as its namespace's
# root's; opening or reading one needs CAP_SYS_PTRACE over a non-dumpable process)
out["agent_fd"] = max(err(lambda: os.open(f"/proc/1/fd/{n}", os.O_RDONLY))
                      for n in os.listdir("/proc/1/fd"))
out["agent_fd_link"] = err(lambda: os.readlink("/proc/1/fd/0"))
out["agent_root"] = err(lambda: os.listdir("/proc/1/root/"))
def lower_oom():
    fd = os.open("/proc/1/oom_score_adj", os.O_WRONLY)
    try:
        os.write(fd, b"-1000")
    finally:
        os.close(fd)
out["agent_lower_oom"] = err(lower_oom)
out["agent_oom"] = open("/proc/1/oom_score_adj").read().strip()
out["ptrace_agent"] = call(libc.ptrace(16, 1, None, None))  # PTRACE_ATTACH
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
try:  # Python turns the EPERM into ValueError
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))
    out["raise_nofile"] = 0
except ValueError:
    out["raise_nofile"] = 1
out["dev_write"] = err(lambda: open("/dev/evil", "w"))
out["dev_chmod"] = err(lambda: os.chmod("/dev/null", 0o777))
out["cgroup_mount"] = call(libc.mount(b"cgroup", b"/mnt", b"cgroup2", 0, None))
out["remount_root"] = call(libc.mount(None, b"/", None, 32 | 1 << 5, None))  # MS_REMOUNT
out["chroot"] = err(lambda: os.chroot("/tmp"))
out["kill_agent"] = err(lambda: os.kill(1, 9))
out["still_root"] = os.getuid()
subprocess.run(["cp", "/usr/bin/id", "/tmp/rootid"], check=True)  # set-user-id root
os.chmod("/tmp/rootid", 0o4755)
print(json.dumps(out))
"""


async def test_root_in_a_sandbox_is_root_of_its_namespace_only(engine, tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("s3cret")
    a = await engine.create({"image": "python"})
    b = await engine.create({"image": "python"})
    try:
        await engine.exec(b.id, "echo b-only > /tmp/b-file")
        attacks = ATTACKS.replace("print(json.dumps(out))\n", "").replace(
            'out["setuid_1000"] = err(lambda: os.setuid(1000))', "")  # allowed here: 1000 is mapped
        assert "os.setuid(1000)" not in attacks
        code = f"import os; os.environ['SECRET']={str(secret)!r}\n" + attacks + MORE
        r = await engine.exec(a.id, ["python3", "-c", code], user="root", timeout=120)
        assert r.returncode == 0, r.stderr.decode()
        got = json.loads(r.stdout)
        pid = agent_host_pid(engine, a.id)
        status = Path(f"/proc/{pid}/status").read_text()
        caps = {k: int(v, 16) for k, v in (ln.split() for ln in status.splitlines()
                                            if ln.startswith(("CapEff:", "CapInh:", "CapAmb:")))}
        live_a, live_b = engine._live[a.id], engine._live[b.id]
        seen = await run_json(engine, a.id, "import json, os; print(json.dumps("
                              "{'b': os.path.exists('/tmp/b-file')}))")
        suid = (await engine.exec(a.id, "/tmp/rootid -u; stat -c %a%U /tmp/rootid")).stdout
        await assert_honest(engine, a.id)  # the agent took every attack
    finally:
        await engine.delete(a.id)
        await engine.delete(b.id)
    assert got["agent_oom"] == "500"
    assert got["uid"] == got["still_root"] == 0 and got["host_secret"] is False and seen == {"b": False}
    eff = int(got["caps"], 16)
    assert eff and not eff & (1 << 21 | 1 << 16 | 1 << 12 | 1 << 27 | 1 << 19 | 1 << 24 | 1 << 13 | 1 << 18)
    # (SYS_ADMIN, SYS_MODULE, NET_ADMIN, MKNOD, SYS_PTRACE, SYS_RESOURCE, NET_RAW, SYS_CHROOT)
    assert caps == {"CapEff:": 0, "CapInh:": 0, "CapAmb:": 0}  # the agent uses none itself
    for attack in ("mount", "init_module", "finit_module", "core_pattern", "sysrq", "mknod",
                   "unshare_user", "hostname", "raw_socket", "setuid_other", "chown_other",
                   "agent_environ", "agent_mem", "agent_fd", "agent_fd_link", "agent_root",
                   "agent_lower_oom", "ptrace_agent", "raise_nofile",
                   "dev_write", "dev_chmod", "cgroup_mount", "remount_root", "chroot"):
        assert got[attack] in (1, 2, 13, 22, 30, 38), (attack, got)  # EPERM ENOENT EACCES EINVAL EROFS ENOSYS
    assert suid.split() == [b"1000", b"4755root"]  # set-user-id root gives nothing
    # each sandbox's root is its own unprivileged host uid, never another sandbox's
    ids_a = {live_a.uid, root_uid(live_a.uid)}
    ids_b = {live_b.uid, root_uid(live_b.uid)}
    assert not ids_a & ids_b and min(ids_a | ids_b) >= RANGE_START
    assert os.getuid() == 0  # (the test ran as host root; nothing of it leaked in)


async def test_what_root_makes_never_becomes_host_root_s(engine, tmp_path):
    """An admin's host directory mounted rw: its root-owned files stay out of reach of
    the sandbox's root, and nothing root makes there is host root's. A set-user-id file
    root makes goes into a snapshot without its set-id bit (a snapshot's layer is host
    root's files on the host's disk)."""
    host = tmp_path / "vol"
    host.mkdir()
    os.chmod(host, 0o777)
    (host / "root-owned").write_text("host root's\n")
    sb = await engine.create({"image": "python", "volumes": {"/data": f"{host}:rw"}})
    try:
        write = await engine.exec(sb.id, "echo x > /data/root-owned", user="root")
        make = await engine.exec(sb.id, "echo x > /data/new-by-root", user="root")
    finally:
        await engine.delete(sb.id)
    assert write.returncode != 0 and (host / "root-owned").read_text() == "host root's\n"
    assert make.returncode != 0 or os.stat(host / "new-by-root").st_uid != 0
    # (a sandbox with an rw volume cannot be snapshotted: the set-id check on its own)
    sb = await engine.create(image="python")
    try:
        await engine.exec(sb.id, "cp /usr/bin/id /srv/id && chmod 4755 /srv/id", user="root")
        snap = await engine.snapshot(sb.id)
    finally:
        await engine.delete(sb.id)
    again = await engine.create(image="python", snapshot=snap.id)
    try:
        r = await engine.exec(again.id, "stat -c %a:%U /srv/id")
        assert r.stdout == b"755:root\n", r
    finally:
        await engine.delete(again.id)
