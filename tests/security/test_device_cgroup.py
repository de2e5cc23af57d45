"""The device cgroup: a sandbox's processes open only the nodes it was given.

A sandbox's /dev holds bubblewrap's standard nodes and its own GPUs' (runtime.gpus); it
cannot mknod. The device cgroup is the wall behind that (runtime.devices): the attack is
a process of the sandbox's group opening a node that is not on its list — another GPU,
a block device, the host's loop control, /dev/mem. A host process joined to the
sandbox's group stands in for sandbox code that got hold of such a node's path.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from corral.runtime.gpus import DriverFiles, GpuDevice, StaticBackend
from tests.conftest import requires_root

PROBE = """
import json, os, sys
for procs in sys.argv[2:]:
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
out = {}
for node in json.loads(sys.argv[1]):
    try:
        os.close(os.open(node, os.O_RDONLY | os.O_NONBLOCK))
        out[node] = "ok"
    except OSError as exc:
        out[node] = exc.strerror
print(json.dumps(out))
"""


def probe(cgroup, nodes: list[str]) -> dict[str, str]:
    """Open each node from a process in ``cgroup``'s device hierarchy only."""
    dirs = cgroup._dirs
    procs = [str(dirs["devices"] / "cgroup.procs")] if "devices" in dirs else [
        str(d / "cgroup.procs") for d in cgroup._hierarchies()]
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(nodes), *procs],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def distinct_gpus():
    """Two stand-in GPUs with numbers of their own (kmsg's and loop-control's: opening
    either read-only does nothing), so the device rules can tell them apart."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    tmp = Path(tempfile.mkdtemp(prefix="corral-test-devcg-"))
    tmp.chmod(0o755)
    for name, dev in (("nvidia0", (1, 11)), ("nvidia1", (10, 237)), ("nvidiactl", (1, 3))):
        os.mknod(tmp / name, stat.S_IFCHR | 0o666, os.makedev(*dev))
        os.chmod(tmp / name, 0o666)
    gpus = [GpuDevice(index=i, uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
                      name="Fake GPU", minor=i, memory_mb=1024, node=tmp / f"nvidia{i}")
            for i in (0, 1)]
    files = DriverFiles(version="580.1", control_nodes=((tmp / "nvidiactl", "/dev/nvidiactl"),),
                        libraries=(), tools=())
    yield StaticBackend(gpus, files), tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
async def gpu_engine(state_dir, distinct_gpus):
    from corral.runtime.engine import Engine

    eng = await Engine.open(state_dir, gpus=distinct_gpus[0])
    try:
        yield eng
    finally:
        await eng.close()


@requires_root
async def test_a_gpu_sandbox_opens_its_gpu_and_nothing_else(gpu_engine, distinct_gpus):
    _, tmp = distinct_gpus
    info = await gpu_engine.create(gpus=["0"], memory_mb=64)
    block = next(str(p) for p in Path("/dev").iterdir()
                 if p.is_block_device()) if any(
        p.is_block_device() for p in Path("/dev").iterdir()) else "/dev/null"
    nodes = ["/dev/null", "/dev/urandom", str(tmp / "nvidia0"), str(tmp / "nvidiactl"),
             str(tmp / "nvidia1"), "/dev/loop-control", "/dev/mem", block]
    got = probe(gpu_engine.cgroup(info.id), nodes)
    assert got["/dev/null"] == got["/dev/urandom"] == "ok"
    assert got[str(tmp / "nvidia0")] == got[str(tmp / "nvidiactl")] == "ok"  # its own
    for denied in (str(tmp / "nvidia1"), "/dev/loop-control",
                   *(["/dev/mem"] if os.path.exists("/dev/mem") else [])):
        assert got[denied] == "Operation not permitted", (denied, got)
    if block != "/dev/null":
        assert got[block] == "Operation not permitted", got
    # and the sandbox itself still works: a pty, /dev/null, its GPU
    r = await gpu_engine.exec(info.id, ["sh", "-c", "echo x > /dev/null && "
                                        "python3 -c 'import pty; pty.openpty()' && echo fine"])
    assert r.stdout.strip() == b"fine", r
    await gpu_engine.delete(info.id)


@requires_root
async def test_a_sandbox_without_gpus_cannot_open_any(gpu_engine, distinct_gpus):
    _, tmp = distinct_gpus
    info = await gpu_engine.create(memory_mb=64)
    got = probe(gpu_engine.cgroup(info.id), [str(tmp / "nvidia0"), str(tmp / "nvidia1")])
    assert set(got.values()) == {"Operation not permitted"}, got  # (nvidiactl is null's)
    await gpu_engine.delete(info.id)


async def _warm_slot(engine):
    """A warm slot of ``engine``'s pool, still waiting for its sandbox (not taken)."""
    import asyncio

    for _ in range(600):
        if engine._pool._ready:
            return engine._pool._ready[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no warm slot became ready in 30 s")


@requires_root
async def test_a_warm_slot_allows_only_the_standard_nodes_before_it_is_used(
        gpu_engine, distinct_gpus):
    # On v1 the list is written while the slot waits (off the create's path): its
    # launcher already sits in a group that refuses everything but the standard nodes.
    _, tmp = distinct_gpus
    slot = await _warm_slot(gpu_engine)
    if "devices" not in slot.cgroup._dirs:
        assert not slot.devices_set  # v2: the program comes after READY, as before
        pytest.skip("no v1 devices hierarchy: the list is attached after READY")
    assert slot.devices_set
    got = probe(slot.cgroup, ["/dev/null", "/dev/loop-control", str(tmp / "nvidia0")])
    assert got["/dev/null"] == "ok", got
    assert got["/dev/loop-control"] == got[str(tmp / "nvidia0")] == "Operation not permitted", got


@requires_root
async def test_a_disk_sandbox_gets_its_loop_device_at_launch_and_not_after(
        gpu_engine, distinct_gpus):
    # A warm slot's list would refuse the launcher its loop device: the group is opened
    # again for the launch and narrowed once the sandbox is READY.
    _, tmp = distinct_gpus
    info = await gpu_engine.create(storage="disk", disk_mb=32, inodes=500, memory_mb=64)
    try:
        got = probe(gpu_engine.cgroup(info.id),
                    ["/dev/null", "/dev/loop-control", str(tmp / "nvidia0")])
        assert got["/dev/null"] == "ok", got
        assert got["/dev/loop-control"] == got[str(tmp / "nvidia0")] == "Operation not permitted", got
        r = await gpu_engine.exec(info.id, ["sh", "-c", "echo x > /tmp/f && cat /tmp/f"])
        assert r.stdout == b"x\n", r
    finally:
        await gpu_engine.delete(info.id)
