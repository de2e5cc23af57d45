"""GPU sandboxes on a host without a GPU: the plumbing with stand-ins the test makes.

Each "GPU" is a character device node the test makes with ``mknod`` (with /dev/null's
numbers, so a sandbox can open it), the driver's library a file in a temporary directory,
``nvidia-smi`` a shell script; the inventory is a :class:`StaticBackend`. What CUDA itself
does with real nodes is checked on a GPU machine (scripts/gpu_check.sh); here: which nodes,
files and variables a sandbox gets, that it gets only its own GPUs, and the assignment.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from corral.errors import InvalidArgument, NoGpuCapacity
from corral.runtime.gpus import (
    DriverFiles,
    GpuAllocator,
    GpuDevice,
    StaticBackend,
    find_driver_files,
    parse_ldconfig,
)
from tests.conftest import requires_root

LDCONFIG = """\
1234 libs found in cache `/etc/ld.so.cache'
\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1
\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1
\tlibnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
"""


def test_ldconfig_cache_is_read_per_architecture():
    found = parse_ldconfig(LDCONFIG)
    assert found["libcuda.so.1"] == Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    assert "libc.so.6" in found and len(found) == 3


def test_driver_files_keep_only_the_drivers_version(tmp_path):
    good = tmp_path / "libcuda.so.580.65.06"
    stale = tmp_path / "libnvidia-ml.so.535.1"
    other = tmp_path / "libc.so.6"
    for f in (good, stale, other):
        f.write_text("x")
    (tmp_path / "libcuda.so.1").symlink_to(good.name)
    (tmp_path / "libnvidia-ml.so.1").symlink_to(stale.name)
    text = (f"\tlibcuda.so.1 (libc6,x86-64) => {tmp_path}/libcuda.so.1\n"
            f"\tlibnvidia-ml.so.1 (libc6,x86-64) => {tmp_path}/libnvidia-ml.so.1\n"
            f"\tlibc.so.6 (libc6,x86-64) => {other}\n")
    files = find_driver_files("580.65.06", tmp_path / "dev", ldconfig_text=text)
    assert files.libraries == ((good, "libcuda.so.1"),)  # not the stale one, not libc
    assert files.control_nodes == ()  # none exist under that dev dir


def test_driver_outside_the_ldconfig_cache_is_found_where_the_loader_looks(tmp_path, monkeypatch):
    libdir = tmp_path / "nvidia" / "lib64"
    libdir.mkdir(parents=True)
    real = libdir / "libcuda.so.580.65.06"
    real.write_text("x")
    (libdir / "libcuda.so.1").symlink_to(real.name)
    (libdir / "libcuda.so").symlink_to("libcuda.so.1")  # the dev link: not a soname
    monkeypatch.setenv("LD_LIBRARY_PATH", f"relative:{libdir}")
    files = find_driver_files("580.65.06", tmp_path / "dev", ldconfig_text=LDCONFIG.replace(
        "libcuda", "libother"))
    assert files.libraries == ((real, "libcuda.so.1"),)


def gpu(index: int, node: Path) -> GpuDevice:
    return GpuDevice(index=index, uuid=f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
                     name="Fake GPU", minor=index, memory_mb=1024, node=node)


def test_assignment_is_exclusive_unless_shared(tmp_path):
    alloc = GpuAllocator(StaticBackend([gpu(0, tmp_path / "n0"), gpu(1, tmp_path / "n1")]))
    a = alloc.assign("sb-a", 1)
    b = alloc.assign("sb-b", ["GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"])
    assert a is not None and b is not None
    assert {a.gpus[0].index, b.gpus[0].index} == {0, 1}
    with pytest.raises(NoGpuCapacity) as exc:
        alloc.assign("sb-c", 1)
    assert exc.value.details["free"] == [] and exc.value.details["total"] == 2
    with pytest.raises(NoGpuCapacity):
        alloc.assign("sb-c", 1, shared=True)  # an exclusive holder is never shared
    alloc.release("sb-a")
    s1 = alloc.assign("sb-s1", 1, shared=True)
    s2 = alloc.assign("sb-s2", 1, shared=True)
    assert s1 is not None and s2 is not None and s1.gpus == s2.gpus
    with pytest.raises(NoGpuCapacity):
        alloc.assign("sb-x", ["0"])  # shared GPUs are not given exclusively
    alloc.release("sb-s1")
    alloc.release("sb-s2")
    assert alloc.free() == [0]
    with pytest.raises(InvalidArgument):
        alloc.assign("sb-y", ["7"])
    with pytest.raises(InvalidArgument):
        alloc.assign("sb-y", 3)
    assert alloc.assign("sb-none", None) is None and alloc.assign("sb-none", 0) is None


def test_a_host_without_gpus_refuses_typed():
    with pytest.raises(InvalidArgument, match="no usable NVIDIA GPU"):
        GpuAllocator(StaticBackend()).assign("sb-a", 1)


# ------------------------------------------------------------------ real sandboxes


@pytest.fixture
def fake_host():
    """Two stand-in GPUs, the control nodes, one driver library and an nvidia-smi, in a
    directory the sandbox's bubblewrap (its own host uid, not root) can traverse, as it
    can /dev and the host's library directories."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    tmp_path = Path(tempfile.mkdtemp(prefix="corral-test-gpus-"))
    tmp_path.chmod(0o755)
    yield from _fake_host(tmp_path)
    shutil.rmtree(tmp_path, ignore_errors=True)


def _fake_host(tmp_path: Path):
    dev = tmp_path / "dev"
    dev.mkdir()
    null = os.makedev(1, 3)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        os.mknod(dev / name, stat.S_IFCHR | 0o666, null)
        os.chmod(dev / name, 0o666)
    lib = tmp_path / "libcuda.so.580.1"
    lib.write_text("not really libcuda\n")
    lib.chmod(0o644)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: '$CUDA_VISIBLE_DEVICES')'\n")
    smi.chmod(0o755)
    files = DriverFiles(
        version="580.1",
        control_nodes=tuple((dev / n, f"/dev/{n}") for n in ("nvidiactl", "nvidia-uvm",
                                                             "nvidia-uvm-tools")),
        libraries=((lib, "libcuda.so.1"),),
        tools=((smi, "nvidia-smi"),),
    )
    yield StaticBackend([gpu(0, dev / "nvidia0"), gpu(1, dev / "nvidia1")], files)


@pytest.fixture
async def gpu_engine(state_dir, fake_host):
    from corral.runtime.engine import Engine

    eng = await Engine.open(state_dir, gpus=fake_host)
    try:
        yield eng
    finally:
        await eng.close()


async def sh(engine, sid, cmd):
    r = await engine.exec(sid, ["sh", "-c", cmd])
    return r.returncode, r.stdout.decode(), r.stderr.decode()


@requires_root
async def test_a_gpu_sandbox_gets_its_gpu_the_driver_and_the_environment(gpu_engine):
    info = await gpu_engine.create(gpus=1, memory_mb=128)
    code, out, err = await sh(gpu_engine, info.id,
                              "ls /dev | grep nvidia | sort | tr '\\n' ' '; echo;"
                              "test -c /dev/nvidia0 && echo chardev;"
                              "echo $CUDA_VISIBLE_DEVICES $NVIDIA_DRIVER_VERSION;"
                              "echo $LD_LIBRARY_PATH; nvidia-smi; "
                              "cat /usr/local/nvidia/lib64/libcuda.so.1;"
                              "echo x > /dev/nvidia0 && echo opened")
    assert code == 0, err
    lines = out.splitlines()
    assert gpu_engine.gpus.held_by(info.id) == (0,)  # the first free one
    # its GPU and the control nodes; never the other GPU
    assert lines[0].split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"]
    assert lines[1] == "chardev"
    uuid = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    assert lines[2] == f"{uuid} 580.1"
    assert lines[3] == "/usr/local/nvidia/lib64"
    assert lines[4] == f"GPU 0: Fake GPU (UUID: {uuid})"
    assert lines[5] == "not really libcuda"
    assert lines[6] == "opened"
    # the driver's files are read-only
    code, _, _ = await sh(gpu_engine, info.id, "echo evil > /usr/local/nvidia/lib64/libcuda.so.1")
    assert code != 0
    await gpu_engine.delete(info.id)


@requires_root
async def test_a_sandbox_without_gpus_sees_none(gpu_engine):
    info = await gpu_engine.create(memory_mb=128)
    code, out, _ = await sh(gpu_engine, info.id,
                            "ls /dev | grep -c nvidia; ls /usr/local/nvidia 2>&1 | head -1;"
                            "echo ${CUDA_VISIBLE_DEVICES:-unset}")
    assert out.split("\n")[0] == "0"
    assert "No such file" in out and out.strip().endswith("unset")
    await gpu_engine.delete(info.id)


@requires_root
async def test_two_sandboxes_get_different_gpus_and_a_third_is_refused(gpu_engine):
    a = await gpu_engine.create(gpus=1, memory_mb=64)
    b = await gpu_engine.create(gpus=1, memory_mb=64)
    held_a = gpu_engine.gpus.held_by(a.id)
    assert {gpu_engine.gpus.held_by(a.id), gpu_engine.gpus.held_by(b.id)} == {(0,), (1,)}
    with pytest.raises(NoGpuCapacity):
        await gpu_engine.create(gpus=1, memory_mb=64)
    assert len(gpu_engine.list()) == 2  # the refused create left nothing
    await gpu_engine.delete(a.id)
    c = await gpu_engine.create(gpus=1, memory_mb=64)  # the freed GPU is given again
    assert gpu_engine.gpus.held_by(c.id) == held_a
    for sid in (b.id, c.id):
        await gpu_engine.delete(sid)
    assert gpu_engine.gpus.free() == [0, 1]


@requires_root
async def test_sandbox_code_cannot_make_or_reach_another_gpu(gpu_engine, fake_host):
    """The attack: a GPU sandbox tries to reach the GPU it was not given — a node of its
    own making, the host's node by path, or the host's /dev."""
    info = await gpu_engine.create(gpus=["0"], memory_mb=64)
    other = fake_host.gpus[1].node
    code, out, _ = await sh(gpu_engine, info.id,
                            "mknod /tmp/nv1 c 1 3 2>&1 || echo refused;"
                            f"ls {other} 2>&1 || echo hidden;"
                            "ls /dev/nvidia1 2>&1 || echo absent")
    assert "refused" in out and "hidden" in out and "absent" in out, out
    await gpu_engine.delete(info.id)


def test_doctor_says_whether_gpus_are_there(fake_host):
    from corral.runtime import doctor

    none = doctor.gpus(StaticBackend())
    assert none.status == "OK" and "no NVIDIA GPU" in none.detail
    two = doctor.gpus(fake_host)
    assert two.status == "OK" and "2 GPU(s)" in two.detail and "driver 580.1" in two.detail
