"""Red-team: memory a judged program keeps where the judge's poll of its processes and
files (guest/case_memory.py) did not look (docs/grading.md, "a case's memory")."""

from __future__ import annotations

import pytest

from corral.guest import case_memory
from corral.rl.stdio import run_io_tests
from tests.security import test_judge_hacks

judge_sb = test_judge_hacks.judge_sb  # the fixture: a sandbox of the judge image

# Three processes of 100 MiB each (a limit of 128): each one's main thread exits while a
# second thread holds the memory. A thread group whose leader exited has no memory in
# /proc/PID/status (nor fds in /proc/PID/fd): only its other threads, under task/, show it.
LEADER_GONE = r"""
import os, time
r, w = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        import ctypes, threading
        def hold():
            time.sleep(0.2)  # the leader is gone by then
            blob = bytearray(100 << 20)
            for i in range(0, len(blob), 4096):
                blob[i] = 1
            os.write(w, b"x")
            time.sleep(1.5)
            os._exit(0)
        threading.Thread(target=hold).start()
        ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: this thread only
os.close(w)
got = 0
while got < 3:
    got += len(os.read(r, 64))
time.sleep(0.3)
print("done")
"""

# 300 MiB in memfds never mapped, each of 50 MiB sent away on a Unix socket once
# written: no process holds them open, so no /proc/PID/fd shows them; they come back
# when needed.
MEMFD_IN_FLIGHT = r"""
import os, socket, time
a, b = socket.socketpair()
chunk = b"\1" * (1 << 20)
for _ in range(6):
    fd = os.memfd_create("table")
    for i in range(50):
        os.pwrite(fd, chunk, i << 20)
    socket.send_fds(a, [b"t"], [fd])
    os.close(fd)
time.sleep(0.5)
ok = True
for _ in range(6):  # one at a time: look, send it back
    fd = socket.recv_fds(b, 1, 1)[1][0]
    ok = ok and os.pread(fd, 1, 49 << 20) == b"\1"
    socket.send_fds(a, [b"t"], [fd])
    os.close(fd)
print("done" if ok else "lost")
"""

# 300 MiB in memfds each mapped, never touched through the mapping, its descriptor
# closed: the mapping alone keeps the memfd, its pages resident in none of the page
# tables (RssShmem counts only what a process touched through its mappings).
MEMFD_MAPPED = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
chunk = b"\1" * (1 << 20)
maps = []
for _ in range(6):
    fd = os.memfd_create("table")
    for i in range(50):
        os.pwrite(fd, chunk, i << 20)
    maps.append(libc.mmap(None, 50 << 20, 1, 1, fd, 0))  # PROT_READ, MAP_SHARED
    os.close(fd)
ok = all(ctypes.string_at(m + (49 << 20), 1) == b"\1" for m in maps)
print("done" if ok else "lost")
"""

# The same in shared anonymous memory: children write 50 MiB each through the parent's
# mapping, one after the other, and exit; the parent never touches it.
SHARED_ANON = r"""
import mmap, os
table = mmap.mmap(-1, 300 << 20)
chunk = b"\1" * (1 << 20)
for part in range(6):
    pid = os.fork()
    if pid == 0:
        for i in range(50):
            table[((part * 50 + i) << 20):((part * 50 + i + 1) << 20)] = chunk
        os._exit(0)
    os.waitpid(pid, 0)
print("done" if table[(300 << 20) - 1] == 1 else "lost")
"""

# 90 MiB in the process, 60 more written into pipes it keeps full (up to the 64 MiB a
# user's pipes hold before they shrink): kernel buffers, in no resident size.
PIPES = r"""
import fcntl, os
blob = bytearray(90 << 20)
for i in range(0, len(blob), 4096):
    blob[i] = 1
held, chunk = [], b"\1" * 65536
while len(held) < 480:
    try:
        r, w = os.pipe()
    except OSError:
        break
    try:
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
    except OSError:
        pass
    os.set_blocking(w, False)
    n = 0
    try:
        while True:
            n += os.write(w, chunk)
    except BlockingIOError:
        pass
    held.append((r, w, n))
total = sum(n for _, _, n in held)
print("done" if total > (60 << 20) else "only %d MiB" % (total >> 20))
"""

# 300 MiB of System V message queues (16 KiB each, the default msgmnb).
SYSV_MSG = r"""
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(8 + 8192)
ctypes.memset(ctypes.addressof(buf), 1, 8)
queues = []
for _ in range(19200):
    q = libc.msgget(0, 0o1600)
    if q < 0:
        break
    queues.append(q)
    for _ in range(2):
        libc.msgsnd(q, buf, 8192, 0o4000)
time.sleep(0.5)
print("done" if len(queues) == 19200 else "only %d" % len(queues))
"""


@pytest.mark.parametrize("code", [LEADER_GONE, MEMFD_MAPPED, SHARED_ANON, PIPES, SYSV_MSG],
                         ids=["leader-gone", "memfd-mapped", "shared-anon", "pipes", "sysv-msg"])
def test_memory_hidden_from_the_poll_is_counted(judge_sb, code):
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=code,
                     time_limit=5, memory_mb=128)
    assert r.verdicts == ["MLE"], (r.verdicts, r.errors)


def test_a_program_has_no_socket_to_keep_memory_in(judge_sb):
    # A descriptor in flight on a Unix socket is in no /proc/PID/fd (and socket buffers
    # in no resident size): the programs judged get no socket at all.
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=MEMFD_IN_FLIGHT,
                     time_limit=5, memory_mb=128)
    assert r.verdicts == ["RE"], (r.verdicts, r.errors)
    assert "Address family not supported" in r.errors[0], r.errors
    tcp = "import socket\nsocket.socket()\nprint('done')"
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=tcp)
    assert r.verdicts == ["RE"], (r.verdicts, r.errors)


def test_huge_pages_count(tmp_path):
    # hugetlbfs pages (mmap MAP_HUGETLB, where the host keeps a pool) are in no resident
    # size: /proc/PID/status has them apart, smaps_rollup too.
    (tmp_path / "status").write_text("Name:\tx\nRssAnon:\t1024 kB\nRssFile:\t4 kB\n"
                                     "RssShmem:\t0 kB\nHugetlbPages:\t204800 kB\n")
    (tmp_path / "smaps_rollup").write_text("Pss_Anon:\t1024 kB\nPss_Shmem:\t0 kB\n"
                                           "Shared_Hugetlb:\t0 kB\nPrivate_Hugetlb:\t204800 kB\n")
    (tmp_path / "fd").mkdir()
    assert case_memory._status_rss(tmp_path) == (1024 + 204800) << 10
    assert case_memory._pss(tmp_path, set()) == (1024 + 204800) << 10
