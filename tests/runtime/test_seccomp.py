"""The seccomp filter: its logic through a small BPF interpreter, then for real under bwrap."""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from corral.errors import Unsupported
from corral.runtime.seccomp import (
    ALLOWED_SOCKET_FAMILIES,
    DENIED_IOCTLS,
    DENIED_SYSCALLS,
    build_filter,
)
from tests.syscall_probe import NR, PRELUDE, numbers

KILL_PROCESS = 0x80000000
ALLOW = 0x7FFF0000
EPERM = 0x00050000 | errno.EPERM
ENOSYS = 0x00050000 | errno.ENOSYS
CLONE_NEWUSER = 0x10000000
SIGCHLD = 17

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


def run_bpf(program: bytes, *, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """Interpret the classic-BPF opcodes a seccomp filter may use, on one syscall."""
    args = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("=iIQ6Q", nr, arch, 0x400000, *args)
    insns = [struct.unpack_from("=HBBI", program, off) for off in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]  # IndexError: ran off the end, which the kernel refuses
        pc += 1
        if code == 0x20:  # ld [k]
            (acc,) = struct.unpack_from("=I", data, k)
        elif code == 0x06:  # ret k
            return k
        elif code == 0x05:  # ja k
            pc += k
        elif code in (0x15, 0x35, 0x45):  # jeq / jge / jset
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


# -- unit ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_program_shape(arch: str) -> None:
    program = build_filter(arch)
    assert len(program) % 8 == 0
    assert 0 < len(program) // 8 <= 4096
    assert build_filter(arch) is program  # cached


def test_default_is_this_machine() -> None:
    if platform.machine() not in AUDIT_ARCH:
        pytest.skip(f"host architecture {platform.machine()} is not supported")
    assert build_filter() == build_filter(platform.machine())


@pytest.mark.parametrize("arch", ["riscv64", "i686", "armv7l"])
def test_unknown_arch_is_unsupported(arch: str) -> None:
    with pytest.raises(Unsupported, match="x86_64 and aarch64") as info:
        build_filter(arch)
    assert info.value.details["arch"] == arch


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_logic(arch: str) -> None:
    program, audit, nr = build_filter(arch), AUDIT_ARCH[arch], NR[arch]

    def verdict(name: str, *args: int) -> int:
        return run_bpf(program, nr=nr[name], arch=audit, args=args)

    for name in ("mount", "ptrace", "unshare", "keyctl", "bpf", "init_module", "reboot",
                 "swapon", "pidfd_getfd", "process_vm_readv", "kcmp"):
        assert verdict(name) == EPERM, name
    assert verdict("prlimit64", 0) == ALLOW  # getrlimit/setrlimit: this process
    assert verdict("prlimit64", 1) == EPERM  # the agent's limits
    assert verdict("prlimit64", 1 << 32) == ALLOW  # the kernel reads an int: pid 0
    for name in ("read", "write", "execve"):
        assert verdict(name) == ALLOW, name
    assert verdict("clone3") == ENOSYS
    assert verdict("clone", SIGCHLD) == ALLOW  # fork
    assert verdict("clone", 0x3D0F00) == ALLOW  # pthread_create's flags
    assert verdict("clone", CLONE_NEWUSER | SIGCHLD) == EPERM
    assert verdict("clone", CLONE_NEWUSER << 32) == ALLOW  # only the low word counts
    other_arch = AUDIT_ARCH["aarch64" if arch == "x86_64" else "x86_64"]
    assert run_bpf(program, nr=nr["read"], arch=other_arch) == KILL_PROCESS
    assert run_bpf(program, nr=nr["read"], arch=0x40000003) == KILL_PROCESS  # i386


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_ioctls_that_fake_input_are_denied(arch: str) -> None:
    program, audit, nr = build_filter(arch), AUDIT_ARCH[arch], NR[arch]

    def ioctl(request: int) -> int:
        return run_bpf(program, nr=nr["ioctl"], arch=audit, args=(0, request))

    assert ioctl(0x5412) == EPERM  # TIOCSTI
    assert ioctl(0x541C) == EPERM  # TIOCLINUX
    assert ioctl(0xFFFFFFFF00005412) == EPERM  # the kernel reads an unsigned int
    # What a program on a terminal needs: TCGETS, TCSETS, TIOCGWINSZ, TIOCSWINSZ,
    # TIOCSCTTY, TIOCGPTPEER, TIOCSPTLCK, FIONREAD.
    for request in (0x5401, 0x5402, 0x5413, 0x5414, 0x540E, 0x5441, 0x40045431, 0x541B):
        assert ioctl(request) == ALLOW, hex(request)
    assert DENIED_IOCTLS == {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C}


def test_x86_specifics() -> None:
    program, audit = build_filter("x86_64"), AUDIT_ARCH["x86_64"]
    assert run_bpf(program, nr=0x40000000 | 0, arch=audit) == EPERM  # x32 read
    assert run_bpf(program, nr=NR["x86_64"]["iopl"], arch=audit) == EPERM
    # aarch64 has no iopl: its number there is an ordinary syscall (172 = getpid).
    assert run_bpf(build_filter("aarch64"), nr=172, arch=AUDIT_ARCH["aarch64"]) == ALLOW


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_numbers_match_kernel_headers(arch: str) -> None:
    header = HEADERS[arch]
    if not header.exists():
        pytest.skip(f"{header} not installed (linux-libc-dev)")
    table = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)\b",
                                                     header.read_text())}
    program, audit = build_filter(arch), AUDIT_ARCH[arch]
    denied_here = [name for name in DENIED_SYSCALLS if name in table]
    assert len(denied_here) >= 40
    for name in denied_here:
        assert run_bpf(program, nr=table[name], arch=audit) == EPERM, name
    assert run_bpf(program, nr=table["clone3"], arch=audit) == ENOSYS
    for name in ("read", "openat", "getpid", "execve", "wait4", "exit_group"):
        assert run_bpf(program, nr=table[name], arch=audit) == ALLOW, name


def test_every_denied_name_is_a_real_syscall() -> None:
    known = set()
    for header in HEADERS.values():
        if not header.exists():
            pytest.skip(f"{header} not installed (linux-libc-dev)")
        known |= set(re.findall(r"#define __NR_(\w+)\s+\d+", header.read_text()))
    assert set(DENIED_SYSCALLS) <= known
    assert len(set(DENIED_SYSCALLS)) == len(DENIED_SYSCALLS)


# -- real: the filter installed by bwrap -----------------------------------------------

HOST_PYTHON = "/usr/bin/python3"

# Each probe runs in a forked child, so one that gets through (a new user namespace,
# being traced) cannot change what the next one sees; the child exits with the errno.
# Arguments are chosen so that, without the filter, the kernel answers something other
# than EPERM where it can (ENOENT, EINVAL, success): that proves the filter is what
# said no. init_module, reboot, swapon and bpf are EPERM for an unprivileged process
# anyway; test_logic covers them.
PROBE = PRELUDE + r"""
import os, subprocess, threading
clone_newuser = 0x10000000

def call(name, *args):
    r = syscall(name, *args)
    if r == 0 and name == "clone":
        os._exit(0)  # the child of a clone that got through
    if r > 0 and name == "clone":
        os.waitpid(r, 0)
    return -r if r < 0 else 0

def in_child(name, *args):
    pid = os.fork()
    if pid == 0:
        os._exit(call(name, *args))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

out = {
    "mount": in_child("mount", b"none", b"/nonexistent", b"tmpfs", L(0), None),
    "ptrace": in_child("ptrace", L(0), L(0), None, None),  # PTRACE_TRACEME
    "unshare": in_child("unshare", L(clone_newuser)),
    "keyctl": in_child("keyctl", L(0x7fff), L(0), L(0)),  # unknown op: EOPNOTSUPP
    "clone": in_child("clone", L(clone_newuser | 17), L(0), None, None, L(0)),
    "clone3": in_child("clone3", None, L(0)),  # no struct: EINVAL if it got through
    "bpf": in_child("bpf", L(0), None, L(0)),
    "init_module": in_child("init_module", None, L(0), b""),
    "reboot": in_child("reboot", L(0), L(0), L(0), None),  # bad magic: never reboots
    "swapon": in_child("swapon", b"/nonexistent", L(0)),
}
# Another process of the same uid, dumpable: what sandbox code could do to the agent
# if the filter let it (and the agent were dumpable).
target = os.fork()
if target == 0:
    import time
    time.sleep(60)
    os._exit(0)
buf = ctypes.create_string_buffer(b"secret", 16)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 16)
pidfd = os.pidfd_open(target)
out["pidfd_getfd"] = call("pidfd_getfd", L(pidfd), L(0), L(0))
out["process_vm_readv"] = call("process_vm_readv", L(target), iov, L(1), iov, L(1), L(0))
out["kcmp"] = call("kcmp", L(os.getpid()), L(target), L(0), L(0), L(0))  # KCMP_FILE
limit = (ctypes.c_uint64 * 2)()
out["prlimit64"] = call("prlimit64", L(target), L(7), None, limit)  # RLIMIT_NOFILE
out["prlimit64_self"] = call("prlimit64", L(0), L(7), None, limit)
os.kill(target, 9)
os.waitpid(target, 0)
results = []
try:  # glibc tries clone3 first, and falls back to clone only on ENOSYS
    t = threading.Thread(target=results.append, args=(1,))
    t.start(); t.join()
except RuntimeError:  # "can't start new thread"
    pass
out["thread"] = results == [1]
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open("/tmp/probe", "w") as f:
    f.write("hello")
with open("/tmp/probe") as f:
    out["file_io"] = f.read()
out["true"] = subprocess.run(["/usr/bin/true"]).returncode
out["unshare_cmd"] = subprocess.run(["unshare", "-U", "true"], capture_output=True).returncode
print(json.dumps(out))
"""

# name -> (errno under the filter, errno without it or None when it is EPERM anyway)
EXPECTED = {
    "mount": (errno.EPERM, errno.ENOENT),
    "ptrace": (errno.EPERM, 0),
    "unshare": (errno.EPERM, 0),
    "keyctl": (errno.EPERM, errno.EOPNOTSUPP),
    "clone": (errno.EPERM, 0),
    "clone3": (errno.ENOSYS, errno.EINVAL),
    "bpf": (errno.EPERM, None),
    "init_module": (errno.EPERM, None),
    "reboot": (errno.EPERM, None),
    "swapon": (errno.EPERM, None),
    "pidfd_getfd": (errno.EPERM, 0),
    "process_vm_readv": (errno.EPERM, 0),
    "kcmp": (errno.EPERM, 0),
    "prlimit64": (errno.EPERM, 0),
    "prlimit64_self": (0, 0),
}

needs_bwrap = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None or not Path(HOST_PYTHON).exists(),
    reason=f"needs root, bwrap on PATH and {HOST_PYTHON}",
)


def bwrap(cmd: list[str], *, seccomp: bool) -> subprocess.CompletedProcess[str]:
    argv = [
        "bwrap", "--unshare-user", "--unshare-pid", "--unshare-net",
        "--uid", "1000", "--gid", "1000",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
    ]
    if not seccomp:
        return subprocess.run([*argv, "--", *cmd], capture_output=True, text=True, timeout=60)
    r, w = os.pipe()
    try:
        os.write(w, build_filter())
        os.close(w)
        w = -1
        return subprocess.run(
            [*argv, "--seccomp", str(r), "--", *cmd],
            pass_fds=(r,), capture_output=True, text=True, timeout=60,
        )
    finally:
        os.close(r)
        if w != -1:
            os.close(w)


def probe(*, seccomp: bool) -> dict:
    proc = bwrap([HOST_PYTHON, "-c", PROBE, numbers()], seccomp=seccomp)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def filtered() -> dict:
    return probe(seccomp=True)


@pytest.fixture(scope="module")
def unfiltered() -> dict:
    return probe(seccomp=False)


@pytest.mark.root
@needs_bwrap
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_denied_under_bwrap(name: str, filtered: dict, unfiltered: dict) -> None:
    with_filter, without = EXPECTED[name]
    assert filtered[name] == with_filter, errno.errorcode.get(filtered[name], filtered[name])
    if without is not None:  # the same call does get through without the filter
        assert unfiltered[name] == without


@pytest.mark.root
@needs_bwrap
def test_ordinary_work_still_runs(filtered: dict, unfiltered: dict) -> None:
    assert filtered["thread"] is True
    assert filtered["fork"] == 7
    assert filtered["file_io"] == "hello"
    assert filtered["true"] == 0
    assert filtered["unshare_cmd"] != 0
    assert unfiltered["unshare_cmd"] == 0  # so it is the filter that stops it


@pytest.mark.root
@needs_bwrap
def test_true_runs_under_the_filter() -> None:
    proc = bwrap(["true"], seccomp=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_socket_families_outside_the_allow_list_are_refused(arch: str) -> None:
    program, audit, nr = build_filter(arch), AUDIT_ARCH[arch], SOCKET_NR[arch]
    eafnosupport, eprotonosupport = 0x00050000 | errno.EAFNOSUPPORT, 0x00050000 | errno.EPROTONOSUPPORT

    def verdict(call: str, family: int, protocol: int = 0) -> int:
        return run_bpf(program, nr=nr[call], arch=audit, args=(family, 1, protocol))

    for call in ("socket", "socketpair"):
        for family in (1, 2, 10):  # AF_UNIX, AF_INET, AF_INET6
            assert verdict(call, family) == ALLOW, (call, family)
        assert verdict(call, 16, 0) == ALLOW  # AF_NETLINK, NETLINK_ROUTE
        for protocol in (4, 9, 12, 15):  # sock_diag, audit, netfilter, uevent
            assert verdict(call, 16, protocol) == eprotonosupport, (call, protocol)
        for family in (0, 3, 17, 30, 38, 40, 44, 45, 46, 255, 0xFFFF):  # AF_VSOCK is 40
            assert verdict(call, family) == eafnosupport, (call, family)
        assert verdict(call, 40 | (1 << 32)) == eafnosupport  # the kernel reads an int
    assert ALLOWED_SOCKET_FAMILIES == {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}


# Kept apart from the filter's own table, like tests/syscall_probe.py's numbers.
SOCKET_NR = {"x86_64": {"socket": 41, "socketpair": 53},
             "aarch64": {"socket": 198, "socketpair": 199}}
