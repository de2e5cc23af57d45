"""Red-team: memory a judged program keeps where the judge's poll of its processes and
files (guest/case_memory.py) did not look (docs/grading.md, "a case's memory")."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("code", [LEADER_GONE, SYSV_MSG], ids=["leader-gone", "sysv-msg"])
def test_memory_hidden_from_the_poll_is_counted(judge_sb, code):
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=code,
                     time_limit=5, memory_mb=128)
    assert r.verdicts == ["MLE"], (r.verdicts, r.errors)
