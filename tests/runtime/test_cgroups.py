"""Tests of corral.runtime.cgroups.

The ``real_*`` tests make real cgroups and need root (CI runs as root); the others
point a driver at a fake tree of files to check the v2 writing and parsing logic on
hosts without a usable cgroup v2.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import shlex
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from corral import errors
from corral.runtime import cgroups
from corral.runtime.cgroups import CgroupError, CgroupV1Driver, CgroupV2Driver

PYTHON = "/usr/bin/python3"  # the system python: a pyenv shim would re-exec through bash
MiB = 1 << 20


def _real_driver() -> cgroups.CgroupDriver:
    if os.geteuid() != 0:
        pytest.skip("real cgroups need root")
    try:
        return cgroups.detect()
    except errors.Unsupported as exc:
        pytest.skip(f"no usable cgroups on this host: {exc}")


@pytest.fixture
def driver() -> cgroups.CgroupDriver:
    return _real_driver()


@pytest.fixture
def parent(driver):
    """A unique parent group for one test, removed with everything in it afterwards."""
    path = f"corral-test/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    try:
        driver.open(path).remove()
    except errors.NotFound:
        pass
    for root in driver._roots().values():  # shared with concurrent runs: only if empty
        with contextlib.suppress(OSError):  # (a remove() of it took theirs down too)
            (root / "corral-test").rmdir()
    assert not any((root / path).exists() for root in driver._roots().values())


@pytest.fixture
def spawn():
    """Start ``argv`` the way the launcher does: join every hierarchy, then exec."""
    started: list[subprocess.Popen] = []

    def start(group: cgroups.Cgroup, argv: list[str], **kwargs) -> subprocess.Popen:
        joins = "".join(f"echo $$ > {shlex.quote(f)}; " for f in group.procs_files())
        proc = subprocess.Popen(["/bin/sh", "-c", f"{joins}exec {shlex.join(argv)}"], **kwargs)
        started.append(proc)
        deadline = time.monotonic() + 60  # bounded: a loaded host is slow, not stuck
        while proc.pid not in group.pids():
            assert proc.poll() is None and time.monotonic() < deadline, "did not join"
            time.sleep(0.001)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# -- real cgroups -------------------------------------------------------------------


@pytest.mark.root
def test_real_detect_picks_a_working_version(driver):
    unified = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    if unified.exists() and "memory" not in unified.read_text().split():
        # The hybrid layout of the CI machine: v2 there has hugetlb only.
        assert driver.version == 1 and isinstance(driver, CgroupV1Driver)
    assert driver.version in (1, 2)
    assert isinstance(driver, CgroupV1Driver if driver.version == 1 else CgroupV2Driver)


@pytest.mark.root
def test_real_limits_are_written(driver, parent):
    group = driver.create(f"{parent}/sb-limits", cpus=0.5, memory_mb=64, pids=30)
    if driver.version == 1:
        d = group._dirs
        assert (d["cpu"] / "cpu.cfs_period_us").read_text().strip() == "100000"
        assert (d["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert int((d["memory"] / "memory.limit_in_bytes").read_text()) == 64 * MiB
        memsw = d["memory"] / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            assert int(memsw.read_text()) == 64 * MiB
        assert (d["pids"] / "pids.max").read_text().strip() == "30"
        assert len(group.procs_files()) == len(set(driver.mounts.values()))
    else:
        d = group._dirs[""]
        assert (d / "cpu.max").read_text().split() == ["50000", "100000"]
        assert int((d / "memory.max").read_text()) == 64 * MiB
        assert (d / "pids.max").read_text().strip() == "30"
        assert len(group.procs_files()) == 1
    assert group.pids() == [] and group.oom_kills() == 0 and not group.frozen()


def test_real_create_remakes_a_parent_removed_meanwhile(driver, parent):
    """The driver remembers parents it made (no stat per create): one removed since is
    made again, in every hierarchy, with its cpuset filled."""
    driver.create(f"{parent}/mid/sb-1", cpus=1.0, memory_mb=64, pids=10)
    driver.open(f"{parent}/mid").remove()
    assert not any((root / parent / "mid").exists() for root in driver._roots().values())
    group = driver.create(f"{parent}/mid/sb-2", cpus=1.0, memory_mb=64, pids=10)
    assert all(d.is_dir() for d in group._dirs.values())
    cpuset = group._dirs.get("cpuset")
    if driver.version == 1 and cpuset is not None:
        assert (cpuset / "cpuset.cpus").read_text().strip()
        assert (cpuset.parent / "cpuset.cpus").read_text().strip()


def test_real_changed_limits_are_written(driver, parent):
    """set_limits skips what is unchanged; what changed is really in force."""
    group = driver.create(f"{parent}/sb-relimit", cpus=1.0, memory_mb=256, pids=100)
    driver.set_limits(group, cpus=1.0, memory_mb=256, pids=100)
    driver.set_limits(group, cpus=0.5, memory_mb=64, pids=30)
    fresh = driver.open(f"{parent}/sb-relimit")
    if driver.version == 1:
        d = fresh._dirs
        assert (d["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert int((d["memory"] / "memory.limit_in_bytes").read_text()) == 64 * MiB
        memsw = d["memory"] / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            assert int(memsw.read_text()) == 64 * MiB
        assert (d["pids"] / "pids.max").read_text().strip() == "30"
    else:
        d = fresh._dirs[""]
        assert (d / "cpu.max").read_text().split() == ["50000", "100000"]
        assert int((d / "memory.max").read_text()) == 64 * MiB
        assert (d / "pids.max").read_text().strip() == "30"
    driver.set_limits(group, cpus=0.5, memory_mb=512, pids=30)  # raised: memsw first
    mem = fresh._dirs["memory"] / "memory.limit_in_bytes" if driver.version == 1 else (
        fresh._dirs[""] / "memory.max")
    assert int(mem.read_text()) == 512 * MiB


@pytest.mark.root
def test_real_create_is_idempotent_for_parents_and_lists_children(driver, parent):
    driver.create(f"{parent}/sb-a", cpus=1, memory_mb=32, pids=10)
    driver.create(f"{parent}/sb-b", cpus=1, memory_mb=32, pids=10)
    assert driver.children(parent) == ["sb-a", "sb-b"]
    assert driver.open(f"{parent}/sb-a").path == f"{parent}/sb-a"
    with pytest.raises(errors.NotFound):
        driver.open(f"{parent}/sb-missing")


@pytest.mark.root
def test_real_add_moves_a_process_into_every_hierarchy(driver, parent):
    group = driver.create(f"{parent}/sb-add", cpus=1, memory_mb=64, pids=10)
    proc = subprocess.Popen(["/bin/sleep", "30"])
    try:
        group.add(proc.pid)
        assert group.pids() == [proc.pid]
        for procs in group.procs_files():
            assert str(proc.pid) in Path(procs).read_text().split()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.root
def test_real_memory_bomb_is_oom_killed(driver, parent, spawn):
    group = driver.create(f"{parent}/sb-mem", cpus=1, memory_mb=50, pids=10)
    assert group.oom_kills() == 0
    # bytes * n writes every page, unlike calloc'd zero pages that are never touched.
    proc = spawn(group, [PYTHON, "-c", "b = b'x' * (200 << 20)"])
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert group.oom_kills() >= 1
    assert 0 < group.memory_peak_bytes() <= 51 * MiB


@pytest.mark.root
def test_the_oom_count_reads_through_a_kept_descriptor_that_never_blocks_removal(driver, parent):
    """oom_kills keeps its file open (one pread a command): the group still goes, a read
    after that fails as a cgroup error (not a read of whatever reused the number), and
    the descriptor closes when the group is collected."""
    group = driver.create(f"{parent}/sb-kept", cpus=1, memory_mb=64, pids=10)
    assert group.oom_kills() == 0
    fd = group._oom_fd
    assert fd >= 0 and group.oom_kills() == 0 and group._oom_fd == fd  # opened once
    group.remove()
    assert not any(d.exists() for d in group._hierarchies())
    with pytest.raises(CgroupError):
        group.oom_kills()
    del group
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.root
def test_real_fork_bomb_is_capped_by_pids(driver, parent, spawn):
    group = driver.create(f"{parent}/sb-pids", cpus=1, memory_mb=256, pids=20)
    bomb = (
        "import subprocess\n"
        "ok = fail = 0\n"
        "for _ in range(60):\n"
        "    try:\n"
        "        subprocess.Popen(['/bin/sleep', '30'], stdout=subprocess.DEVNULL)\n"
        "        ok += 1\n"
        "    except OSError:\n"
        "        fail += 1\n"
        "print(ok, fail, flush=True)\n"
        "import time; time.sleep(30)\n"
    )
    proc = spawn(group, [PYTHON, "-c", bomb], stdout=subprocess.PIPE, text=True)
    peak = 0
    deadline = time.monotonic() + 30
    while not select.select([proc.stdout], [], [], 0.001)[0]:  # sample while it forks
        assert time.monotonic() < deadline
        peak = max(peak, len(group.pids()))
    ok, fail = map(int, proc.stdout.readline().split())
    assert ok <= 19 and fail >= 41  # the bomb itself is the 20th process
    assert peak <= 20 and len(group.pids()) <= 20
    peak_file = group._dirs["pids" if driver.version == 1 else ""] / "pids.peak"
    if peak_file.exists():
        assert int(peak_file.read_text()) <= 20


@pytest.mark.root
def test_real_freeze_stops_and_thaw_resumes(driver, parent, spawn, tmp_path):
    group = driver.create(f"{parent}/sb-freeze", cpus=1, memory_mb=64, pids=10)
    counter = tmp_path / "counter"
    counter.write_bytes(b"%20d" % 0)
    code = (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
        "n = 0\n"
        "while True:\n"
        "    n += 1\n"
        "    os.pwrite(fd, b'%20d' % n, 0)\n"
    )
    spawn(group, [PYTHON, "-c", code, str(counter)])

    def count() -> int:
        return int(counter.read_bytes())

    def until(predicate) -> None:  # bounded: a loaded host is slow, not stuck
        deadline = time.monotonic() + 60
        while not predicate():
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.01)

    until(lambda: count() > 0)
    group.freeze()
    assert group.frozen()
    before = count()
    time.sleep(0.3)
    assert count() == before
    group.thaw()
    assert not group.frozen()
    until(lambda: count() > before)


@pytest.mark.root
def test_real_cpu_quota_caps_a_spinner(driver, parent, spawn):
    """Measured with the group's own counters, not the wall clock (a loaded host gives
    the spinner less, never more): it is throttled, and in no period does it get more
    than its quota (plus the kernel's tick of slack)."""
    group = driver.create(f"{parent}/sb-cpu", cpus=0.2, memory_mb=64, pids=10)
    stat = group._dirs["cpu" if driver.version == 1 else ""] / "cpu.stat"
    spawn(group, [PYTHON, "-c", "while True: pass"])
    deadline = time.monotonic() + 120
    while cgroups._keyed(stat)["nr_throttled"] < 5:
        assert time.monotonic() < deadline, f"never throttled: {cgroups._keyed(stat)}"
        time.sleep(0.05)
    used = group.cpu_seconds()  # read first: the periods read next can only be more
    periods = cgroups._keyed(stat)["nr_periods"]
    quota = 0.2 * cgroups.CFS_PERIOD_US / 1e6  # CPU seconds a period
    assert quota <= used <= (periods + 1) * quota * 1.5, (used, periods, quota)


@pytest.mark.root
def test_real_kill_all_and_remove_leave_nothing(driver, parent, spawn):
    path = f"{parent}/sb-kill"
    group = driver.create(path, cpus=1, memory_mb=128, pids=50)
    tree = "trap '' TERM; for i in 1 2 3 4 5; do /bin/sleep 60 & done; /bin/sleep 60"
    procs = [spawn(group, ["/bin/sh", "-c", tree]) for _ in range(2)]
    deadline = time.monotonic() + 60
    while len(group.pids()) < 12:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victims = group.pids()

    group.kill_all()
    assert group.pids() == []
    assert all(p.wait(timeout=60) == -signal.SIGKILL for p in procs)
    assert not any(_alive(pid) for pid in victims)

    spawn(group, ["/bin/sleep", "60"])
    group.remove()
    group.remove()  # idempotent
    assert not any(Path(f).parent.exists() for f in group.procs_files())
    assert not any((root / path).exists() for root in driver._roots().values())
    assert driver.children(parent) == []
    with pytest.raises(errors.NotFound):
        driver.open(path)


@pytest.mark.root
@pytest.mark.parametrize("joined", ["all", "last"])
def test_real_remove_without_children_kills_what_is_left_first(driver, parent, spawn, joined):
    # remove(children=False) tries rmdir before reading cgroup.procs: a group that
    # still holds a task (in every hierarchy, or only in the last one: a join cut
    # short) refuses (EBUSY), and the task is killed and the group removed after all.
    path = f"{parent}/sb-left-{joined}"
    group = driver.create(path, cpus=1, memory_mb=64, pids=20)
    if joined == "all":
        proc = spawn(group, ["/bin/sleep", "60"])
    else:
        last = group.procs_files()[-1]
        proc = subprocess.Popen(["/bin/sh", "-c", f"echo $$ > {shlex.quote(last)}; exec /bin/sleep 60"])
        deadline = time.monotonic() + 60
        while proc.pid not in group.pids():
            assert proc.poll() is None and time.monotonic() < deadline, "did not join"
            time.sleep(0.001)
    try:
        group.remove(children=False)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert not any(Path(f).parent.exists() for f in group.procs_files())
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.root
def test_real_remove_takes_child_groups_along(driver, parent, spawn):
    spawn(driver.create(f"{parent}/a/sb-1", cpus=1, memory_mb=32, pids=5), ["/bin/sleep", "60"])
    driver.create(f"{parent}/a/sb-2", cpus=1, memory_mb=32, pids=5)
    driver.open(f"{parent}/a").remove()
    assert driver.children(parent) == []


# -- validation and fake trees ------------------------------------------------------


def _files(d: Path, contents: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in contents.items():
        (d / name).write_text(text)


@pytest.mark.parametrize("path", ["", "/abs", "a//b", "a/../b", "a/./b"])
def test_bad_paths_are_rejected(tmp_path, path):
    with pytest.raises(errors.InvalidArgument):
        CgroupV2Driver(tmp_path).open(path)


@pytest.mark.parametrize("limits", [(0, 64, 10), (1, 0, 10), (1, 64, 0), (float("nan"), 64, 10)])
def test_bad_limits_are_rejected(tmp_path, limits):
    cpus, memory_mb, pids = limits
    with pytest.raises(errors.InvalidArgument):
        CgroupV2Driver(tmp_path).create("a/b", cpus=cpus, memory_mb=memory_mb, pids=pids)


def test_v2_create_enables_controllers_and_writes_limits(tmp_path):
    _files(tmp_path, {"cgroup.controllers": "cpu memory pids", "cgroup.subtree_control": ""})
    _files(tmp_path / "corral", {"cgroup.subtree_control": "cpu memory pids"})
    leaf = tmp_path / "corral" / "sb-1"
    names = ["cpu.max", "memory.max", "memory.swap.max", "pids.max", "cgroup.procs"]
    _files(leaf, dict.fromkeys(names, ""))
    group = CgroupV2Driver(tmp_path).create("corral/sb-1", cpus=1.5, memory_mb=100, pids=64)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (tmp_path / "corral" / "cgroup.subtree_control").read_text() == "cpu memory pids"
    assert (leaf / "cpu.max").read_text() == "150000 100000"
    assert (leaf / "memory.max").read_text() == str(100 * MiB)
    assert (leaf / "memory.swap.max").read_text() == "0"
    assert (leaf / "pids.max").read_text() == "64"
    assert group.procs_files() == [str(leaf / "cgroup.procs")]


def test_v2_set_limits_writes_only_what_changed(tmp_path):
    """A warm slot's group has the defaults: a sandbox asking for them costs no write,
    one asking for another memory limit costs that one write, nothing else."""
    _files(tmp_path, {"cgroup.controllers": "cpu memory pids", "cgroup.subtree_control": ""})
    _files(tmp_path / "corral", {"cgroup.subtree_control": "cpu memory pids"})
    leaf = tmp_path / "corral" / "sb-1"
    names = ["cpu.max", "memory.max", "memory.swap.max", "pids.max", "cgroup.procs"]
    _files(leaf, dict.fromkeys(names, ""))
    driver = CgroupV2Driver(tmp_path)
    group = driver.create("corral/sb-1", cpus=1.0, memory_mb=100, pids=64)
    for name in names:  # anything written from here on shows up
        (leaf / name).write_text("untouched")
    driver.set_limits(group, cpus=1.0, memory_mb=100, pids=64)
    assert {n: (leaf / n).read_text() for n in names} == dict.fromkeys(names, "untouched")
    driver.set_limits(group, cpus=1.0, memory_mb=64, pids=64)
    assert (leaf / "memory.max").read_text() == str(64 * MiB)
    assert [n for n in names if (leaf / n).read_text() != "untouched"] == ["memory.max"]
    driver.set_limits(group, cpus=2.0, memory_mb=64, pids=10)
    assert (leaf / "cpu.max").read_text() == "200000 100000"
    assert (leaf / "pids.max").read_text() == "10"


def test_v2_a_failed_set_limits_writes_everything_next_time(tmp_path):
    _files(tmp_path, {"cgroup.controllers": "cpu memory pids", "cgroup.subtree_control": ""})
    _files(tmp_path / "corral", {"cgroup.subtree_control": "cpu memory pids"})
    leaf = tmp_path / "corral" / "sb-1"
    names = ["cpu.max", "memory.max", "pids.max", "cgroup.procs"]
    _files(leaf, dict.fromkeys(names, ""))
    driver = CgroupV2Driver(tmp_path)
    group = driver.create("corral/sb-1", cpus=1.0, memory_mb=100, pids=64)
    (leaf / "memory.max").unlink()
    (leaf / "memory.max").mkdir()  # the write fails
    with pytest.raises(CgroupError):
        driver.set_limits(group, cpus=0.5, memory_mb=64, pids=64)
    (leaf / "memory.max").rmdir()
    (leaf / "memory.max").write_text("")
    (leaf / "pids.max").write_text("untouched")
    driver.set_limits(group, cpus=1.0, memory_mb=100, pids=64)  # what create wrote
    assert (leaf / "cpu.max").read_text() == "100000 100000"
    assert (leaf / "memory.max").read_text() == str(100 * MiB)
    assert (leaf / "pids.max").read_text() == "64"


def test_v2_create_failure_removes_what_it_made(tmp_path):
    _files(tmp_path, {"cgroup.subtree_control": "cpu memory pids"})
    with pytest.raises(CgroupError, match="cpu.max"):
        # The new leaf is a plain empty directory here, so writing cpu.max fails.
        CgroupV2Driver(tmp_path).create("sb-1", cpus=1, memory_mb=64, pids=10)
    assert not (tmp_path / "sb-1").exists()


def test_v1_create_failure_removes_parents_it_made(tmp_path):
    mounts = {c: tmp_path / c for c in ("memory", "pids", "cpu", "freezer")}
    for d in mounts.values():
        d.mkdir()
    (mounts["cpu"] / "kept").mkdir()
    with pytest.raises(CgroupError, match="cfs_period_us"):
        CgroupV1Driver(mounts).create("kept/new/sb-1", cpus=1, memory_mb=64, pids=10)
    assert sorted(p.name for d in mounts.values() for p in d.iterdir()) == ["kept"]


def test_v2_parsing(tmp_path):
    leaf = tmp_path / "sb"
    _files(leaf, {
        "memory.events": "low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n",
        "memory.current": "4096\n",
        "cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n",
        "cgroup.events": "populated 1\nfrozen 1\n",
        "cgroup.procs": "12\n7\n",
    })  # fmt: skip
    group = cgroups.CgroupV2("sb", {"": leaf})
    assert group.oom_kills() == 2
    assert group.memory_bytes() == 4096
    assert group.memory_peak_bytes() == 4096  # no memory.peak before Linux 5.19
    (leaf / "memory.peak").write_text("8192\n")
    assert group.memory_peak_bytes() == 8192
    assert group.cpu_seconds() == 1.5
    assert group.frozen() and group.pids() == [7, 12]


def test_v2_kill_all_prefers_cgroup_kill_else_freezes(tmp_path):
    leaf = tmp_path / "sb"
    _files(leaf, {"cgroup.procs": "", "cgroup.freeze": "", "cgroup.events": "frozen 1\n"})
    group = cgroups.CgroupV2("sb", {"": leaf})
    group.kill_all()
    assert (leaf / "cgroup.freeze").read_text() == "0"  # froze, then thawed again
    _files(leaf, {"cgroup.kill": "", "cgroup.freeze": ""})
    group.kill_all()
    assert (leaf / "cgroup.kill").read_text() == "1"
    assert (leaf / "cgroup.freeze").read_text() == ""


def test_v1_parsing_and_cpu_fallback(tmp_path):
    dirs = {c: tmp_path / c / "sb" for c in ("memory", "pids", "cpu", "freezer")}
    _files(dirs["memory"], {"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n"})
    _files(dirs["cpu"], {"cpu.stat": "nr_periods 3\nnr_throttled 1\n"})
    _files(dirs["freezer"], {"freezer.state": "FREEZING\n"})
    group = cgroups.CgroupV1("sb", dirs)
    assert group.oom_kills() == 0  # no oom_kill line before Linux 4.13
    (dirs["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\noom_kill 3\n")
    assert group.oom_kills() == 3
    assert not group.frozen()
    with pytest.raises(CgroupError, match="cpuacct"):
        group.cpu_seconds()
    _files(dirs["cpu"], {"cpu.stat": "usage_usec 250000\n"})
    assert group.cpu_seconds() == 0.25
    dirs["cpuacct"] = tmp_path / "cpuacct" / "sb"
    _files(dirs["cpuacct"], {"cpuacct.usage": "2000000000\n"})
    assert cgroups.CgroupV1("sb", dirs).cpu_seconds() == 2.0


def _mountinfo(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "mountinfo"
    path.write_text("".join(f"{i} 1 0:{i} / {line}\n" for i, line in enumerate(lines, 30)))
    return str(path)


def test_detect_prefers_v2_with_the_controllers(tmp_path):
    _files(tmp_path / "v2 root", {"cgroup.controllers": "cpuset cpu io memory pids\n"})
    info = _mountinfo(tmp_path, [f"{tmp_path}/v2\\040root rw - cgroup2 cgroup2 rw"])
    driver = cgroups.detect(mountinfo=info)
    assert isinstance(driver, CgroupV2Driver) and driver.version == 2
    assert driver.root == tmp_path / "v2 root"


def test_detect_falls_back_to_v1_on_a_hybrid_host(tmp_path):
    _files(tmp_path / "unified", {"cgroup.controllers": "hugetlb\n"})
    lines = [f"{tmp_path}/unified rw - cgroup2 cgroup2 rw"]
    for name in ("cpu,cpuacct", "memory", "pids", "freezer", "name=systemd"):
        lines.append(f"{tmp_path}/{name} rw,relatime - cgroup cgroup rw,{name}")
    driver = cgroups.detect(mountinfo=_mountinfo(tmp_path, lines))
    assert isinstance(driver, CgroupV1Driver) and driver.version == 1
    assert driver.mounts["cpu"] == driver.mounts["cpuacct"] == tmp_path / "cpu,cpuacct"
    assert "name=systemd" not in driver.mounts


def test_detect_explains_what_is_missing(tmp_path):
    lines = [f"{tmp_path}/{c} rw - cgroup cgroup rw,{c}" for c in ("cpu", "memory", "pids")]
    with pytest.raises(errors.Unsupported, match="missing v1: freezer"):
        cgroups.detect(mountinfo=_mountinfo(tmp_path, lines))


def test_v2_delegates_cpuset_where_offered_and_confines_a_group(tmp_path):
    _files(tmp_path, {"cgroup.controllers": "cpuset cpu memory pids", "cgroup.subtree_control": ""})
    leaf = tmp_path / "sb-1"
    names = ["cpu.max", "memory.max", "pids.max", "cgroup.procs", "cpuset.cpus"]
    _files(leaf, dict.fromkeys(names, ""))
    driver = CgroupV2Driver(tmp_path)
    group = driver.create("sb-1", cpus=2, memory_mb=100, pids=64)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids +cpuset"
    assert driver.set_cpus(group, (1, 3))
    assert (leaf / "cpuset.cpus").read_text() == "1,3"


def test_v1_new_cpuset_groups_start_with_their_parents_cpus(tmp_path):
    mounts = {c: tmp_path / c for c in ("memory", "pids", "cpu", "freezer", "cpuset")}
    for c, root in mounts.items():
        _files(root, {"cpuset.cpus": "0-3\n", "cpuset.mems": "0\n"} if c == "cpuset" else {})
    driver = CgroupV1Driver(mounts)

    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):  # the kernel makes a cpuset group's files, empty
        real_mkdir(self, *a, **kw)
        names = (("cpuset.cpus", "cpuset.mems") if self.is_relative_to(mounts["cpuset"]) else
                 ("cpu.cfs_period_us", "cpu.cfs_quota_us", "pids.max", "memory.limit_in_bytes"))
        for name in (*names, "cgroup.procs"):
            (self / name).write_text("0" if name == "memory.limit_in_bytes" else "")

    Path.mkdir = mkdir
    try:
        group = driver.create("corral/sb-1", cpus=1, memory_mb=64, pids=10)
    finally:
        Path.mkdir = real_mkdir
    for d in (mounts["cpuset"] / "corral", mounts["cpuset"] / "corral" / "sb-1"):
        assert (d / "cpuset.cpus").read_text() == "0-3" and (d / "cpuset.mems").read_text() == "0"
    assert driver.set_cpus(group, (2,))
    assert (mounts["cpuset"] / "corral" / "sb-1" / "cpuset.cpus").read_text() == "2"


def test_v2_new_group_under_the_root_keeps_an_inheriting_cpuset(tmp_path):
    # a v2 root offers cpuset but has no cpuset.cpus (only .effective); a new group's
    # empty cpuset.cpus means "the parent's": nothing to copy (a GPU machine failed here)
    _files(tmp_path, {"cgroup.controllers": "cpuset cpu memory pids",
                      "cpuset.cpus.effective": "0-15"})
    _files(tmp_path / "corral", {"cpuset.cpus": "", "cpuset.mems": ""})
    CgroupV2Driver(tmp_path)._made(tmp_path / "corral")
    assert (tmp_path / "corral" / "cpuset.cpus").read_text() == ""
