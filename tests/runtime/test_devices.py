"""The device rules themselves (runtime.devices): v1 lines and the v2 BPF program,
loaded into the kernel and attached to a cgroup v2 directory where the host has one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.runtime import devices
from corral.runtime.cgroups import _cgroup_mounts
from tests.conftest import requires_root


def test_rules_are_read_write_never_mknod():
    assert devices.DeviceRule(1, 3).v1_line() == "c 1:3 rw"
    assert devices.DeviceRule(136).v1_line() == "c 136:* rw"
    assert devices.rule_for(Path("/dev/null")) == devices.DeviceRule(1, 3, "c")
    with pytest.raises(devices.DeviceRulesError, match="not a device"):
        devices.rule_for(Path("/etc/hostname") if Path("/etc/hostname").exists() else Path("/"))
    assert len(devices.bpf_program(devices.standard_rules())) % 8 == 0


def _v2_root() -> Path | None:
    _, v2 = _cgroup_mounts("/proc/self/mountinfo")
    return v2[0] if v2 else None


PROBE = """
import os, sys
open(sys.argv[1], "w").write(str(os.getpid()))
for node in sys.argv[2:]:
    try:
        os.close(os.open(node, os.O_RDONLY | os.O_NONBLOCK)); print("ok")
    except OSError as exc:
        print(exc.strerror)
"""


@requires_root
def test_the_bpf_filter_allows_the_list_and_refuses_the_rest():
    root = _v2_root()
    if root is None or not os.access(root, os.W_OK):
        pytest.skip("no writable cgroup v2 hierarchy on this host")
    group = root / f"corral-test-devices-{os.getpid()}"
    group.mkdir()
    try:
        rules = devices.standard_rules() + [devices.rule_for(Path("/dev/loop-control"))]
        devices.attach_bpf(group, rules)
        r = subprocess.run([sys.executable, "-c", PROBE, str(group / "cgroup.procs"),
                            "/dev/null", "/dev/loop-control", "/dev/kmsg"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:3] == ["ok", "ok", "Operation not permitted"]
        # mknod of an allowed number is refused too (access outside read/write)
        r = subprocess.run([sys.executable, "-c",
                            f"import os; open('{group}/cgroup.procs','w').write(str(os.getpid()));"
                            "os.mknod('/tmp/corral-devtest-%d' % os.getpid(), 0o20600, os.makedev(1, 3))"],
                           capture_output=True, text=True, timeout=60)
        assert "Operation not permitted" in r.stderr
    finally:
        group.rmdir()
