"""Raw syscalls from probe scripts that run inside a sandbox (Python and ctypes).

A probe is ``PRELUDE + its own code``, run as ``python3 -c PROBE json.dumps(numbers())
...``: the prelude reads the syscall numbers from ``argv[1]`` and defines ``syscall``.
The numbers are kept apart from ``corral.runtime.seccomp``'s tables on purpose, so that
a wrong number there shows here.
"""

from __future__ import annotations

import json
import platform

import pytest

NR = {
    "x86_64": {"read": 0, "write": 1, "execve": 59, "clone": 56, "clone3": 435,
               "mount": 165, "ptrace": 101, "unshare": 272, "keyctl": 250, "bpf": 321,
               "init_module": 175, "reboot": 169, "swapon": 167, "iopl": 172,
               "pidfd_open": 434, "pidfd_getfd": 438, "process_madvise": 440,
               "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
               "prlimit64": 302, "ioctl": 16},
    "aarch64": {"read": 63, "write": 64, "execve": 221, "clone": 220, "clone3": 435,
                "mount": 40, "ptrace": 117, "unshare": 97, "keyctl": 219, "bpf": 280,
                "init_module": 105, "reboot": 142, "swapon": 224,
                "pidfd_open": 434, "pidfd_getfd": 438, "process_madvise": 440,
                "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
                "prlimit64": 261, "ioctl": 29},
}

PRELUDE = r"""
import ctypes, json, sys
NR = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long

def syscall(name, *args):
    '''Its result (>= 0), or minus the errno.'''
    ctypes.set_errno(0)
    r = libc.syscall(L(NR[name]), *args)
    return r if r >= 0 else -ctypes.get_errno()
"""


def numbers() -> str:
    """This machine's syscall numbers, as the probe's first argument (or skip)."""
    nrs = NR.get(platform.machine())
    if nrs is None:
        pytest.skip(f"no syscall numbers for {platform.machine()} in the tests")
    return json.dumps(nrs)
