"""Red-team: limits of the stdin/stdout judge a program could escape by spreading its work
over processes the judge does not wait for (docs/grading.md, "stdin/stdout problems")."""

from __future__ import annotations

import pytest

from corral.rl.stdio import run_io_tests
from tests.security import test_judge_hacks

judge_sb = test_judge_hacks.judge_sb  # the fixture: a sandbox of the judge image

# A program that needs ~2.4 s of CPU under a 1 s limit. Alone it is a TLE; the attack
# hands the work down a chain of double-forked processes: each one burns 0.6 s and forks
# the next before exiting, so no process reaches RLIMIT_CPU, and none is the judge's
# child (each is reparented away), so wait4's rusage of the program never shows it.
CPU_CHAIN = r"""
import os, time
r, w = os.pipe()
def burn(sec):
    end = time.process_time() + sec
    while time.process_time() < end:
        pass
if os.fork() == 0:
    if os.fork() == 0:
        for _ in range(4):
            burn(0.6)
            if os.fork():
                os._exit(0)
        os.write(w, b"done\n")
    os._exit(0)
os.wait()
os.close(w)
print(os.read(r, 64).decode().strip())
"""

ALONE = r"""
import time
end = time.process_time() + 2.4
while time.process_time() < end:
    pass
print("done")
"""

# The same with memory: the program itself stays small, a child it does not wait for
# holds 400 MiB while the answer is printed.
MEM_CHILD = r"""
import os, time
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:
        blob = bytearray(400 << 20)
        for i in range(0, len(blob), 4096):
            blob[i] = 1
        os.write(w, b"done\n")
        time.sleep(3)
    os._exit(0)
os.wait()
os.close(w)
print(os.read(r, 64).decode().strip())
"""


def test_cpu_time_spread_over_orphaned_processes_is_counted(judge_sb):
    case = [{"input": "", "output": "done"}]
    alone = run_io_tests(judge_sb, case, code=ALONE, time_limit=1)
    assert alone.verdicts == ["TLE"], alone.errors
    chain = run_io_tests(judge_sb, case, code=CPU_CHAIN, time_limit=1)
    assert chain.verdicts == ["TLE"], (chain.verdicts, chain.errors)


def test_memory_held_by_an_orphaned_child_is_counted(judge_sb):
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=MEM_CHILD,
                     time_limit=5, memory_mb=128)
    assert r.verdicts == ["MLE"], (r.verdicts, r.errors)


# A checker that parses the output raises on garbage. That must be the program's wrong
# answer, not "not gradable" (reward None, which spares a wrong program its 0).
FLOAT_CHECKER = {"kind": "python", "source": (
    "def check(i, o, e):\n    return abs(float(o) - float(e)) < 1e-6\n")}
FLOAT_CHECKER_C = {"kind": "program", "language": "c", "source": (
    "#include <stdio.h>\n#include <stdlib.h>\n#include <math.h>\n"
    "int main(int c,char**v){double a,b;FILE*o=fopen(v[2],\"r\"),*e=fopen(v[3],\"r\");"
    "if(fscanf(o,\"%lf\",&a)!=1)abort();fscanf(e,\"%lf\",&b);return fabs(a-b)<1e-6?0:1;}\n")}


@pytest.mark.parametrize("checker", [FLOAT_CHECKER, FLOAT_CHECKER_C], ids=["python", "program"])
def test_output_that_crashes_the_checker_is_a_wrong_answer(judge_sb, checker):
    case = [{"input": "", "output": "0.5"}]
    r = run_io_tests(judge_sb, case, code="print('garbage')", checker=checker)
    assert r.verdicts == ["WA"], (r.verdicts, r.errors)
    right = run_io_tests(judge_sb, case, code="print(0.5)", checker=checker)
    assert right.verdicts == ["AC"], right.errors


def test_a_checker_that_fails_on_the_right_answer_is_still_not_gradable(judge_sb):
    broken = {"kind": "python", "source": "def check(i, o, e):\n    return int(e) > 0\n"}
    r = run_io_tests(judge_sb, [{"input": "", "output": "0.5"}], code="print('x')",
                     checker=broken)
    assert r.verdicts == ["IE"], (r.verdicts, r.errors)


# Memory split between processes, each under the limit, together over it.
MEM_SPLIT = r"""
import os, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        blob = bytearray(100 << 20)
        for i in range(0, len(blob), 4096):
            blob[i] = 1
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print("done")
"""


def test_memory_split_between_processes_is_counted_together(judge_sb):
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=MEM_SPLIT,
                     time_limit=5, memory_mb=128)
    assert r.verdicts == ["MLE"], (r.verdicts, r.errors)


def test_a_language_the_image_cannot_run_chosen_by_the_completion_scores_zero(daemon):
    # The reward runs on an image without compilers (image=); the completion picks Rust.
    # A missing toolchain is "not gradable" (reward None) only when the task asked for
    # the language: chosen by the completion, it would spare every wrong answer its 0.
    from corral.rl import code_reward

    reward = code_reward("fraction", url=daemon.url, image="python", time_limit=2)
    wrong = "```rust\nfn main() { println!(\"41\"); }\n```"
    got = reward(completions=[wrong], tests=[[{"input": "", "output": "42"}]])
    outcome = reward.last_outcomes[0]
    assert got == [0.0], (got, outcome.report and outcome.report.feedback())
    assert outcome.verdicts == ["CE"], outcome.verdicts
    forced = code_reward("fraction", url=daemon.url, image="python", time_limit=2,
                         language="rust")
    assert forced(completions=[wrong], tests=[[{"input": "", "output": "42"}]]) == [None]


# Memory kept in a file instead: a table of 300 MiB written to /tmp (or /dev/shm) and
# read back with pread is nobody's resident size; the writable layer is a tmpfs.
MEM_IN_A_FILE = r"""
import os
fd = os.open("/tmp/table", os.O_RDWR | os.O_CREAT, 0o600)
chunk = b"\1" * (1 << 20)
for i in range(300):
    os.pwrite(fd, chunk, i << 20)
print("done" if os.pread(fd, 1, 299 << 20) == b"\1" else "lost")
"""


def test_memory_kept_in_a_file_is_counted(judge_sb):
    try:
        r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=MEM_IN_A_FILE,
                         time_limit=5, memory_mb=128)
    finally:
        judge_sb.exec(["rm", "-f", "/tmp/table"])
    assert r.verdicts == ["MLE"], (r.verdicts, r.errors)


# More places to keep memory no process's resident size shows (guest/case_memory.py):
# 40 processes of 8 MiB each, a memfd written and never mapped, a /dev/shm file held
# open after it is deleted, a System V segment left behind, and a process that makes
# itself non-dumpable so the judge cannot look into it.
FORK_SWARM = r"""
import os, time
r, w = os.pipe()
for _ in range(40):
    if os.fork() == 0:
        os.close(r)
        blob = bytearray(8 << 20)
        for i in range(0, len(blob), 4096):
            blob[i] = 1
        os.write(w, b"x")
        time.sleep(1)
        os._exit(0)
os.close(w)
got = 0
while got < 40:
    got += len(os.read(r, 64))
print("done")
"""
MEMFD = r"""
import os
fd = os.memfd_create("table")
chunk = b"\1" * (1 << 20)
for i in range(300):
    os.pwrite(fd, chunk, i << 20)
print("done" if os.pread(fd, 1, 299 << 20) == b"\1" else "lost")
"""
SHM_DELETED = MEM_IN_A_FILE.replace('"/tmp/table"', '"/dev/shm/table"').replace(
    "print(", 'os.unlink("/dev/shm/table")\nprint(')
SYSV = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
for _ in range(3):  # three segments of 90 MiB, each filled, detached, never removed
    addr = libc.shmat(libc.shmget(0, 90 << 20, 0o1600), None, 0)
    ctypes.memset(addr, 1, 90 << 20)
    libc.shmdt(addr)
print("done")
"""
HIDING = r"""
import ctypes, os
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
fd = os.memfd_create("table")
for i in range(200):
    os.pwrite(fd, b"\1" * (1 << 20), i << 20)
print("done")
"""


@pytest.mark.parametrize("code", [FORK_SWARM, MEMFD, SHM_DELETED, SYSV, HIDING],
                         ids=["fork-swarm", "memfd", "dev-shm-deleted", "sysv-shm", "hiding"])
def test_memory_kept_out_of_sight_is_counted(judge_sb, code):
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=code,
                     time_limit=5, memory_mb=128)
    assert r.verdicts == ["MLE"], (r.verdicts, r.errors)


def test_an_honest_forking_program_within_the_limit_is_accepted(judge_sb):
    # Four workers forked from a parent holding 60 MiB share it copy-on-write: the
    # proportional sizes count it once (60 + 4 x 8 MiB, not 5 x 60).
    code = FORK_SWARM.replace("range(40)", "range(4)").replace("got < 40", "got < 4")
    code = "big = bytearray(60 << 20)\nfor i in range(0, len(big), 4096): big[i] = 1\n" + code
    r = run_io_tests(judge_sb, [{"input": "", "output": "done"}], code=code,
                     time_limit=5, memory_mb=128)
    assert r.verdicts == ["AC"], (r.verdicts, r.errors)
