"""Which device nodes a sandbox may open: the device cgroup, on v1 and v2.

A sandbox's ``/dev`` holds only the nodes bubblewrap and :mod:`corral.runtime.gpus`
put there, and it cannot ``mknod`` (no ``CAP_MKNOD`` for the host, seccomp). The
device cgroup is the second wall: even a node that reached the sandbox some other way
(a volume an admin bound, a bug) cannot be opened unless its number is on the list.

The list holds the standard character devices plus the sandbox's GPUs. On cgroup v1 a
warm slot's group gets the standard list while it waits (``launcher.SlotPool``): a
sandbox without GPUs, a disk or a restore keeps it, and nothing is written on its
create's path. The others have their group opened again (:func:`allow_all`) before
their launcher runs and get their list once the sandbox is READY (before any sandbox
code has run; the launcher has by then opened what it needed, such as a loop device
for ``storage="disk"``); so does every sandbox on v2, where a second attached program
could only narrow the first::

    rules = standard_rules() + [rule_for(Path("/dev/nvidia0"))]
    restrict(group_dirs, rules)

* cgroup v1: ``devices.deny a`` then one ``devices.allow`` line per rule, in the
  group's ``devices`` hierarchy.
* cgroup v2: a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program, generated here from the rules
  and attached to the group's directory (the kernel keeps it while the group exists).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from corral import errors

__all__ = ["DeviceRule", "DeviceRulesError", "allow_all", "bpf_program", "restrict",
           "rule_for", "standard_rules"]

ANY = -1
READ, WRITE, MKNOD = 2, 4, 1  # BPF_DEVCG_ACC_*
CHAR, BLOCK = 2, 1  # BPF_DEVCG_DEV_*


class DeviceRulesError(errors.InternalError):
    """The device cgroup could not be set (the sandbox is not started without it)."""

    code = "device_rules_failed"  # its own: a code names one class (tests/test_error_codes.py)


@dataclass(frozen=True)
class DeviceRule:
    """Allow opening (read/write, never mknod) ``kind`` device ``major:minor``."""

    major: int
    minor: int = ANY
    kind: str = "c"  # "c" or "b"

    def v1_line(self) -> str:
        major = "*" if self.major == ANY else str(self.major)
        minor = "*" if self.minor == ANY else str(self.minor)
        return f"{self.kind} {major}:{minor} rw"


def standard_rules() -> list[DeviceRule]:
    """The nodes of bubblewrap's ``--dev``: null, zero, full, random, urandom, tty, the
    sandbox's own devpts (ptmx and the pty slaves, majors 136-143)."""
    rules = [DeviceRule(1, m) for m in (3, 5, 7, 8, 9)]
    rules += [DeviceRule(5, 0), DeviceRule(5, 2)]
    rules += [DeviceRule(major) for major in range(136, 144)]
    return rules


def rule_for(node: Path) -> DeviceRule:
    """The rule that allows the device node ``node`` (a host path; follows links)."""
    st = os.stat(node)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise DeviceRulesError(f"{node} is not a device node",
                               details={"path": str(node)})
    return DeviceRule(os.major(st.st_rdev), os.minor(st.st_rdev), kind)


def restrict(dirs: dict[str, Path], rules: list[DeviceRule]) -> str:
    """Limit the group whose directories are ``dirs`` (controller -> directory, as in
    :class:`~corral.runtime.cgroups.Cgroup`; ``""`` is the v2 one) to ``rules``.

    Returns how: ``"v1"``, ``"v2"``, or ``""`` where the host offers neither (a v1 host
    without the devices controller mounted).
    """
    if "devices" in dirs:
        d = dirs["devices"]
        try:
            _write(d / "devices.deny", "a")
            _write(d / "devices.allow", *(rule.v1_line() for rule in rules))
        except OSError as exc:
            raise DeviceRulesError(f"cannot set the device rules of {d}: {exc.strerror}",
                                   details={"path": str(d), "errno": exc.errno}) from exc
        return "v1"
    if "" in dirs:
        attach_bpf(dirs[""], rules)
        return "v2"
    return ""


def allow_all(dirs: dict[str, Path]) -> bool:
    """Open a v1 group (``dirs`` as in :func:`restrict`) to every device its parent
    allows again, until :func:`restrict` narrows it; False where there is no v1 devices
    hierarchy (nothing was restricted there beforehand)."""
    if "devices" not in dirs:
        return False
    d = dirs["devices"]
    try:
        _write(d / "devices.allow", "a")
    except OSError as exc:
        raise DeviceRulesError(f"cannot set the device rules of {d}: {exc.strerror}",
                               details={"path": str(d), "errno": exc.errno}) from exc
    return True


def _write(path: Path, *values: str) -> None:
    """Each of ``values`` in a write of its own (the kernel takes one rule per write),
    all through one open file: a sandbox's ~15 rules cost one open, not fifteen."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for value in values:
            os.write(fd, value.encode())
    finally:
        os.close(fd)


# --------------------------------------------------------------- cgroup v2: BPF

_BPF_PROG_LOAD, _BPF_PROG_ATTACH = 5, 8
_BPF_PROG_TYPE_CGROUP_DEVICE, _BPF_CGROUP_DEVICE = 15, 6
_BPF_F_ALLOW_MULTI = 2
_SYS_BPF = {"x86_64": 321, "aarch64": 280}


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


_LDX_W, _AND_K, _RSH_K, _MOV_X, _MOV_K, _JNE_K, _EXIT = 0x61, 0x57, 0x77, 0xBF, 0xB7, 0x55, 0x95


def bpf_program(rules: list[DeviceRule]) -> bytes:
    """The device program for ``rules``: 1 (allow) for read/write access to a listed
    device, 0 (EPERM) for anything else, mknod included.

    Context (``struct bpf_cgroup_dev_ctx``): ``access_type`` (type in the low 16 bits,
    access in the high 16) at 0, ``major`` at 4, ``minor`` at 8.
    """
    head = [
        _insn(_LDX_W, dst=2, src=1, off=0),  # r2 = access_type
        _insn(_MOV_X, dst=3, src=2),  # r3 = access_type
        _insn(_AND_K, dst=2, imm=0xFFFF),  # r2 = type
        _insn(_RSH_K, dst=3, imm=16),  # r3 = access
        _insn(_LDX_W, dst=4, src=1, off=4),  # r4 = major
        _insn(_LDX_W, dst=5, src=1, off=8),  # r5 = minor
    ]
    body: list[bytes] = []
    for rule in rules:
        checks = [(2, CHAR if rule.kind == "c" else BLOCK)]
        if rule.major != ANY:
            checks.append((4, rule.major))
        if rule.minor != ANY:
            checks.append((5, rule.minor))
        # r1 = access outside READ|WRITE (mknod); any check failing skips this rule's
        # "return 1": a jump's offset counts the instructions after it in the block
        body += [_insn(_MOV_X, dst=1, src=3), _insn(_AND_K, dst=1, imm=~(READ | WRITE))]
        checks.append((1, 0))
        for i, (reg, value) in enumerate(checks):
            body.append(_insn(_JNE_K, dst=reg, imm=value, off=len(checks) - 1 - i + 2))
        body += [_insn(_MOV_K, dst=0, imm=1), _insn(_EXIT)]
    tail = [_insn(_MOV_K, dst=0, imm=0), _insn(_EXIT)]
    return b"".join(head + body + tail)


def _bpf(cmd: int, attr: bytes) -> int:
    nr = _SYS_BPF.get(os.uname().machine)
    if nr is None:
        raise DeviceRulesError(f"no bpf() syscall number for {os.uname().machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr, len(attr))
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), buf, ctypes.c_uint(len(attr)))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(rc)


def attach_bpf(cgroup_dir: Path, rules: list[DeviceRule]) -> None:
    """Load the device program for ``rules`` and attach it to ``cgroup_dir`` (v2)."""
    prog = bpf_program(rules)
    insns = ctypes.create_string_buffer(prog, len(prog))
    license_ = ctypes.create_string_buffer(b"Apache-2.0")
    log = ctypes.create_string_buffer(16384)

    def load(log_level: int) -> int:
        # union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license,
        # log_level, log_size, log_buf, kern_version, prog_flags (zero-padded)
        attr = struct.pack("<IIQQIIQII", _BPF_PROG_TYPE_CGROUP_DEVICE, len(prog) // 8,
                           ctypes.addressof(insns), ctypes.addressof(license_), log_level,
                           len(log) if log_level else 0,
                           ctypes.addressof(log) if log_level else 0, 0, 0)
        return _bpf(_BPF_PROG_LOAD, attr.ljust(128, b"\0"))

    try:
        prog_fd = load(0)
    except OSError as exc:
        with suppress(OSError):  # again with the verifier's log, to say why
            os.close(load(1))
        raise DeviceRulesError(
            f"cannot load the device filter for {cgroup_dir}: {exc.strerror}",
            details={"path": str(cgroup_dir), "errno": exc.errno,
                     "verifier": log.value.decode(errors="replace")[-500:]}) from exc
    try:
        cg_fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # target_fd, attach_bpf_fd, attach_type, attach_flags
            attach = struct.pack("<IIII", cg_fd, prog_fd, _BPF_CGROUP_DEVICE,
                                 _BPF_F_ALLOW_MULTI).ljust(128, b"\0")
            _bpf(_BPF_PROG_ATTACH, attach)
        finally:
            os.close(cg_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise DeviceRulesError(f"cgroup {cgroup_dir} is gone") from exc
        raise DeviceRulesError(
            f"cannot attach the device filter to {cgroup_dir}: {exc.strerror}",
            details={"path": str(cgroup_dir), "errno": exc.errno}) from exc
    finally:
        os.close(prog_fd)
