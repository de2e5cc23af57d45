"""The seccomp filter every sandbox runs under, built as classic BPF in pure Python.

``bwrap --seccomp FD`` reads an array of ``struct sock_filter`` (``u16 code; u8 jt;
u8 jf; u32 k``, native byte order) from ``FD`` and installs it just before it execs
the sandboxed command. :func:`build_filter` returns exactly those bytes::

    import os, subprocess
    program = build_filter()
    r, w = os.pipe()
    os.write(w, program)  # a few hundred bytes: fits in the pipe buffer
    os.close(w)
    subprocess.run(["bwrap", ..., "--seccomp", str(r), "--", "true"], pass_fds=(r,))

What the filter does, in order:

1. A syscall made under another ABI than the expected one (for example ``int 0x80``
   on x86_64, which uses the i386 table) kills the process: its numbers would be
   read against the wrong table, so no answer would be safe.
2. On x86_64, x32 syscalls (``nr | 0x40000000``) get ``EPERM``: a second table of
   the same calls would let every rule below be bypassed.
3. Every syscall in :data:`DENIED_SYSCALLS` that exists on the architecture gets
   ``EPERM``.
4. ``clone3`` gets ``ENOSYS``: its flags live in a struct in user memory, which BPF
   cannot read, so we could not refuse ``CLONE_NEWUSER`` there. ``ENOSYS`` (not
   ``EPERM``) makes glibc and other runtimes fall back to ``clone``, whose flags
   are a register we can check.
5. ``clone`` with ``CLONE_NEWUSER`` gets ``EPERM``; any other ``clone`` (fork,
   threads) is allowed.
6. ``prlimit64`` on another process (a pid other than 0) gets ``EPERM``: the kernel
   lets a process change the limits of any other of the same uid, and the agent
   shares the sandbox's uid (a tiny RLIMIT_NOFILE or RLIMIT_CPU would break or kill
   it). ``getrlimit``/``setrlimit`` (glibc passes pid 0) keep working.
7. ``ioctl`` with a request in :data:`DENIED_IOCTLS` gets ``EPERM``: ``TIOCSTI``
   types bytes into a terminal's input and ``TIOCLINUX`` reaches a Linux console's
   selection (pasted as input). A sandbox has terminals of its own (``corral shell``
   runs on one, and sandbox code can open ``/dev/ptmx``), and the kernel would refuse
   ``TIOCSTI`` on any but the caller's controlling terminal, but this host allows it
   there (``dev.tty.legacy_tiocsti=1``): no code of the sandbox may fake what a user
   types, wherever a terminal leads.
8. ``socket`` and ``socketpair`` with an address family not in
   :data:`ALLOWED_SOCKET_FAMILIES` get ``EAFNOSUPPORT`` (what a kernel without that
   family says, so programs fall back as they would there), and ``AF_NETLINK`` with
   a protocol other than ``NETLINK_ROUTE`` gets ``EPROTONOSUPPORT``. A sandbox needs
   Unix sockets, IPv4 and IPv6 (loopback in ``network="none"``, its veth otherwise)
   and route netlink (``getaddrinfo`` with ``AI_ADDRCONFIG``, ``getifaddrs``, ``ip``:
   namespaced, it shows only the sandbox's own interfaces). The others are ways out
   of the network namespace or into kernel code a sandbox has no use for:
   ``AF_VSOCK`` ignores network namespaces (a sandbox with no network could reach
   the hypervisor or its other guests), and ``AF_PACKET``, ``AF_BLUETOOTH``,
   ``AF_ALG``, ``AF_XDP``, netlink's audit, uevent and netfilter protocols, ... are
   kernel surface a sandbox never needs.
9. Everything else is allowed.

The sandbox already runs without capabilities inside its own namespaces; this filter
shrinks the kernel surface an escape would need (new namespaces, mounts, keyrings,
eBPF, io_uring, modules, ...), and, with the agent being not dumpable (see
``agent/agent.c``), keeps sandbox code away from the agent: every call that reads or
writes another process's memory or descriptors is denied here, even though the
kernel would also refuse it for a non-dumpable target. ``pidfd_open`` stays allowed
(asyncio and subprocess use it on their own children): without ``pidfd_getfd`` and
``process_madvise`` a pidfd only waits for an exit or sends a signal, which ``kill``
can do already.
"""

from __future__ import annotations

import functools
import platform
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from corral.errors import Unsupported

__all__ = ["ALLOWED_SOCKET_FAMILIES", "DENIED_IOCTLS", "DENIED_SYSCALLS", "build_filter"]

DENIED_SYSCALLS: tuple[str, ...] = (
    # Mounts and the filesystem view: a sandbox gets its tree from bwrap, never makes one.
    "mount", "umount2", "pivot_root", "chroot",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    # Namespaces: unshare/setns would reach kernel code (user namespaces above all)
    # that is a frequent source of privilege escalations.
    "unshare", "setns",
    # Reading or steering other processes: their memory, their descriptors.
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "process_madvise", "process_mrelease",
    # Kernel code and kernel state.
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register",
    # Keyrings are not namespaced: keys would leak between sandboxes.
    "keyctl", "add_key", "request_key",
    # Host-wide state: power, swap, accounting, clocks, quotas, kernel log, ttys.
    "reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "quotactl", "quotactl_fd", "syslog", "vhangup",
    "lookup_dcookie",
    # File handles bypass the mount tree (the "shocker" container escape).
    "open_by_handle_at", "name_to_handle_at",
    # x86 I/O port access.
    "iopl", "ioperm",
    # Obsolete calls still present on some architectures: nothing legitimate uses them.
    "uselib", "_sysctl", "create_module", "get_kernel_syms", "query_module", "nfsservctl",
)
"""Syscalls that fail with ``EPERM`` inside a sandbox (those the architecture has)."""

DENIED_IOCTLS: Mapping[str, int] = {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C}
"""``ioctl`` requests that fail with ``EPERM`` (the same numbers on x86_64 and arm64)."""

ALLOWED_SOCKET_FAMILIES: Mapping[str, int] = {
    "AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16,
}
"""The address families ``socket``/``socketpair`` accept (the same numbers on every
Linux); ``AF_NETLINK`` only with :data:`NETLINK_ROUTE`."""

NETLINK_ROUTE = 0

# <linux/audit.h>: AUDIT_ARCH_* values seccomp_data.arch carries.
_AUDIT_ARCH_X86_64 = 0xC000003E
_AUDIT_ARCH_AARCH64 = 0xC00000B7

# Syscall numbers from arch/x86/entry/syscalls/syscall_64.tbl.
_X86_64: Mapping[str, int] = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "vhangup": 153, "pivot_root": 155,
    "_sysctl": 156, "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164,
    "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
    "iopl": 172, "ioperm": 173, "create_module": 174, "init_module": 175,
    "delete_module": 176, "get_kernel_syms": 177, "query_module": 178, "quotactl": 179,
    "nfsservctl": 180, "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
    "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
    "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "quotactl_fd": 443, "pidfd_getfd": 438, "process_madvise": 440,
    "process_mrelease": 448,
    "clone": 56, "clone3": 435, "prlimit64": 302, "ioctl": 16,
    "socket": 41, "socketpair": 53,
}

# aarch64 uses the generic table, include/uapi/asm-generic/unistd.h. It never had
# iopl/ioperm, nor the obsolete calls except nfsservctl (a stub, still numbered).
_GENERIC: Mapping[str, int] = {
    "lookup_dcookie": 18, "umount2": 39, "mount": 40, "pivot_root": 41, "nfsservctl": 42,
    "chroot": 51, "vhangup": 58, "quotactl": 60, "acct": 89, "unshare": 97,
    "kexec_load": 104, "init_module": 105, "delete_module": 106, "clock_settime": 112,
    "syslog": 116, "ptrace": 117, "reboot": 142, "settimeofday": 170, "adjtimex": 171,
    "add_key": 217, "request_key": 218, "keyctl": 219, "swapon": 224, "swapoff": 225,
    "perf_event_open": 241, "name_to_handle_at": 264, "open_by_handle_at": 265,
    "clock_adjtime": 266, "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271,
    "kcmp": 272, "finit_module": 273, "bpf": 280, "userfaultfd": 282,
    "kexec_file_load": 294, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "quotactl_fd": 443, "pidfd_getfd": 438, "process_madvise": 440,
    "process_mrelease": 448,
    "clone": 220, "clone3": 435, "prlimit64": 261, "ioctl": 29,
    "socket": 198, "socketpair": 199,
}


@dataclass(frozen=True)
class _Arch:
    audit_arch: int
    syscalls: Mapping[str, int]
    has_x32: bool
    clone_flags_arg: int  # which argument of clone() holds the flags


_ARCHES: Mapping[str, _Arch] = {
    "x86_64": _Arch(_AUDIT_ARCH_X86_64, _X86_64, has_x32=True, clone_flags_arg=0),
    # arm64 selects CLONE_BACKWARDS: clone(flags, newsp, parent_tid, tls, child_tid).
    "aarch64": _Arch(_AUDIT_ARCH_AARCH64, _GENERIC, has_x32=False, clone_flags_arg=0),
}

# <linux/filter.h> opcodes, already combined (class | size | mode / op | source).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = *(u32 *)(seccomp_data + k)
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K (unsigned)
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K: jump if A & k
_RET_K = 0x06  # BPF_RET | BPF_K

# <linux/seccomp.h> return actions.
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000

# Errno values are the generic ones on both supported architectures.
_EPERM = 1
_ENOSYS = 38
_EPROTONOSUPPORT = 93
_EAFNOSUPPORT = 97

_X32_SYSCALL_BIT = 0x40000000
_CLONE_NEWUSER = 0x10000000

# Offsets in struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6]}.
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARGS = 16

_BPF_MAXINSNS = 4096
_MAX_JUMP = 255  # jt and jf are u8


def build_filter(arch: str | None = None) -> bytes:
    """Return the sandbox seccomp program, ready for ``bwrap --seccomp FD``.

    ``arch`` is a :func:`platform.machine` value (default: this machine's);
    ``"x86_64"`` and ``"aarch64"`` are supported. The result is cached per arch.

    >>> len(build_filter("x86_64")) % 8
    0

    Raises :class:`~corral.errors.Unsupported` for any other architecture.
    """
    return _build(arch or platform.machine())


@functools.lru_cache(maxsize=None)
def _build(machine: str) -> bytes:
    spec = _ARCHES.get(machine)
    if spec is None:
        raise Unsupported(
            f"no seccomp filter for CPU architecture {machine!r}: corral sandboxes run "
            f"only on {' and '.join(_ARCHES)} hosts",
            details={"arch": machine},
        )
    nrs = spec.syscalls
    low_word_of_flags = _OFF_ARGS + 8 * spec.clone_flags_arg  # little-endian u64

    prog: list[tuple[int, int | str, int | str, int] | str] = [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, "nr", 0, spec.audit_arch),
        (_RET_K, 0, 0, _RET_KILL_PROCESS),
        "nr",
        (_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if spec.has_x32:
        prog.append((_JGE_K, "eperm", 0, _X32_SYSCALL_BIT))
    for name in DENIED_SYSCALLS:
        if name in nrs:
            prog.append((_JEQ_K, "eperm", 0, nrs[name]))
    prog += [
        (_JEQ_K, "enosys", 0, nrs["clone3"]),
        (_JEQ_K, "prlimit", 0, nrs["prlimit64"]),
        (_JEQ_K, "ioctl", 0, nrs["ioctl"]),
        (_JEQ_K, "socket", 0, nrs["socket"]),
        (_JEQ_K, "socket", 0, nrs["socketpair"]),
        (_JEQ_K, 0, "allow", nrs["clone"]),
        # Only the low 32 bits: clone flags are an unsigned long but every flag,
        # CLONE_NEWUSER included, sits in the low word, and BPF loads 32 bits.
        (_LD_W_ABS, 0, 0, low_word_of_flags),
        (_JSET_K, "eperm", "allow", _CLONE_NEWUSER),
        "prlimit",
        # prlimit64(pid_t pid, ...): the kernel reads an int, the low word of the
        # register, so that word alone says whether it is this process (0).
        (_LD_W_ABS, 0, 0, _OFF_ARGS),
        (_JEQ_K, "allow", "eperm", 0),
        "ioctl",
        # ioctl(int fd, unsigned int cmd, ...): the kernel reads the low word of cmd.
        (_LD_W_ABS, 0, 0, _OFF_ARGS + 8),
        *[(_JEQ_K, "eperm", 0, request) for request in DENIED_IOCTLS.values()],
        (_RET_K, 0, 0, _RET_ALLOW),
        "socket",
        # socket(int domain, int type, int protocol): ints, the low words.
        (_LD_W_ABS, 0, 0, _OFF_ARGS),
        *[(_JEQ_K, "allow", 0, family) for name, family in ALLOWED_SOCKET_FAMILIES.items()
          if name != "AF_NETLINK"],
        (_JEQ_K, 0, "eafnosupport", ALLOWED_SOCKET_FAMILIES["AF_NETLINK"]),
        (_LD_W_ABS, 0, 0, _OFF_ARGS + 16),
        (_JEQ_K, "allow", "eprotonosupport", NETLINK_ROUTE),
        "allow",
        (_RET_K, 0, 0, _RET_ALLOW),
        "eperm",
        (_RET_K, 0, 0, _RET_ERRNO | _EPERM),
        "enosys",
        (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS),
        "eafnosupport",
        (_RET_K, 0, 0, _RET_ERRNO | _EAFNOSUPPORT),
        "eprotonosupport",
        (_RET_K, 0, 0, _RET_ERRNO | _EPROTONOSUPPORT),
    ]
    return _assemble(prog)


def _assemble(prog: list[tuple[int, int | str, int | str, int] | str]) -> bytes:
    """Pack instructions, turning label jumps (``"eperm"``) into relative offsets."""
    labels: dict[str, int] = {}
    insns: list[tuple[int, int | str, int | str, int]] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)
    if len(insns) > _BPF_MAXINSNS:
        raise AssertionError(f"seccomp program has {len(insns)} instructions")

    def offset(pc: int, target: int | str) -> int:
        if isinstance(target, int):
            return target
        off = labels[target] - pc - 1  # jumps are relative to the next instruction
        if not 0 <= off <= _MAX_JUMP:
            raise AssertionError(f"jump to {target!r} out of range at {pc}")
        return off

    return b"".join(
        struct.pack("=HBBI", code, offset(pc, jt), offset(pc, jf), k)
        for pc, (code, jt, jf, k) in enumerate(insns)
    )
