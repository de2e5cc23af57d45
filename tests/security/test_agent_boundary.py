"""The agent (pid 1 inside every sandbox) cannot be read, written, traced, signalled,
limited or impersonated by the code it runs.

Every attack here ran against the agent as it was before (dumpable, pidfd_getfd
allowed) and worked: ``pidfd_getfd(pidfd_open(1), N)`` returned the control socket
and the agent's stderr (a host file), ``/proc/1/mem`` opened for writing, and
``/proc/1/fd`` listed its descriptors. Each test also runs the same attack on a
process of the same uid that is *not* protected (a dumpable sibling in the same
sandbox): it succeeds there, so a failure against the agent is the protection at
work, not a broken probe. The calls seccomp denies for everyone (``pidfd_getfd``,
``process_vm_readv``, ``kcmp``, ``prlimit64`` on another pid) have that control in
``tests/runtime/test_seccomp.py``, which runs them with and without the filter.
"""

from __future__ import annotations

import asyncio
import errno
import json
import shlex
from pathlib import Path

import pytest

from corral.runtime.terminal import TerminalSize
from tests.conftest import requires_root, rt_sigaction
from tests.security.conftest import agent_host_pid, assert_honest, run_json
from tests.syscall_probe import PRELUDE, numbers

pytestmark = [requires_root, pytest.mark.root]

# argv[2]: the target pid ("sibling": a dumpable child this script forks). Prints
# {attack: "ok" | errno}.
ATTACK = PRELUDE + r"""
import os, time

def sc(name, *args):
    r = syscall(name, *args)
    return "ok" if r >= 0 else -r

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return e.errno

sibling = None
if sys.argv[2] == "sibling":
    r, w = os.pipe()
    sibling = os.fork()
    if sibling == 0:
        os.close(r)
        time.sleep(120)  # holds w: a descriptor to steal
        os._exit(0)
    os.close(w)
    target = sibling
else:
    target = int(sys.argv[2])

def read_mem():
    start = int(open(f"/proc/{target}/maps").readline().split("-")[0], 16)
    with open(f"/proc/{target}/mem", "rb", buffering=0) as f:
        f.seek(start)
        assert len(f.read(16)) == 16

def write_mem():
    os.close(os.open(f"/proc/{target}/mem", os.O_RDWR))

def reopen_fds():
    errs = []
    for n in range(0, 64):
        for mode in (os.O_RDONLY, os.O_WRONLY):
            try:
                os.close(os.open(f"/proc/{target}/fd/{n}", mode | os.O_NONBLOCK))
                return
            except OSError as e:
                errs.append(e.errno)
    raise OSError(max(set(errs), key=errs.count), "no descriptor reopened")

def raise_oom_score():
    with open(f"/proc/{target}/oom_score_adj", "w") as f:
        f.write("1000")

res = {
    "mem_read": attempt(read_mem),
    "mem_write": attempt(write_mem),
    "environ": attempt(lambda: open(f"/proc/{target}/environ", "rb").read()),
    "fd_list": attempt(lambda: os.listdir(f"/proc/{target}/fd")),
    "fd_reopen": attempt(reopen_fds),
    "cwd_root": attempt(lambda: os.listdir(f"/proc/{target}/root/")),
    "oom_score_adj": attempt(raise_oom_score),
    "mem_owner": os.stat(f"/proc/{target}/mem").st_uid,
}
pidfd = os.pidfd_open(target)  # allowed: on its own it only waits and signals
res["pidfd_getfd"] = sorted({sc("pidfd_getfd", L(pidfd), L(n), L(0)) for n in range(64)}, key=str)
buf = ctypes.create_string_buffer(64)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
res["process_vm_readv"] = sc("process_vm_readv", L(target), iov, L(1), iov, L(1), L(0))
res["process_vm_writev"] = sc("process_vm_writev", L(target), iov, L(1), iov, L(1), L(0))
res["process_madvise"] = sc("process_madvise", L(pidfd), iov, L(1), L(21), L(0))  # COLD
res["kcmp"] = sc("kcmp", L(os.getpid()), L(target), L(0), L(0), L(0))
res["ptrace_seize"] = sc("ptrace", L(0x4206), L(target), None, None)
tiny = (ctypes.c_uint64 * 2)(3, 3)
res["prlimit_nofile"] = sc("prlimit64", L(target), L(7), tiny, None)
res["prlimit_cpu"] = sc("prlimit64", L(target), L(0), (ctypes.c_uint64 * 2)(1, 1), None)
res["prlimit_self"] = sc("prlimit64", L(0), L(7), None, (ctypes.c_uint64 * 2)())
if sibling:
    os.kill(sibling, 9)
    os.waitpid(sibling, 0)
print(json.dumps(res))
"""

PROC_ATTACKS = ("mem_read", "mem_write", "environ", "fd_list", "fd_reopen", "cwd_root",
                "oom_score_adj")
SECCOMP_ATTACKS = ("process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
                   "ptrace_seize", "prlimit_nofile", "prlimit_cpu")


async def test_agent_memory_fds_and_limits_are_out_of_reach(sandbox):
    engine, sid = sandbox
    control = await run_json(engine, sid, ATTACK, numbers(), "sibling")
    # The control: a dumpable process of the same uid is wide open through /proc.
    for name in PROC_ATTACKS:
        assert control[name] == "ok", (name, control[name])
    assert control["mem_owner"] == 1000

    pid = agent_host_pid(engine, sid)
    oom_before = Path(f"/proc/{pid}/oom_score_adj").read_text()
    res = await run_json(engine, sid, ATTACK, numbers(), "1")
    for name in PROC_ATTACKS:
        assert res[name] in (errno.EACCES, errno.EPERM), (name, res[name])
    # /proc/1 belongs to nobody inside: the kernel's mark of a non-dumpable process
    assert res["mem_owner"] != 1000
    assert res["pidfd_getfd"] == [errno.EPERM]  # every descriptor number
    for name in SECCOMP_ATTACKS:
        assert res[name] == errno.EPERM, (name, res[name])
    assert res["prlimit_self"] == "ok"  # getrlimit/setrlimit on itself still work

    # Nothing changed on the agent, seen from the host.
    limits = Path(f"/proc/{pid}/limits").read_text()
    nofile = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    assert nofile.split()[3:5] == ["1024", "1024"]
    cpu = next(line for line in limits.splitlines() if line.startswith("Max cpu time"))
    assert cpu.split()[3:5] == ["unlimited", "unlimited"]
    assert Path(f"/proc/{pid}/oom_score_adj").read_text() == oom_before
    await assert_honest(engine, sid)


# Lists the descriptors this process has, as {number: target}. Python started with
# -I -S keeps nothing open of its own (unlike ls, which may hold a locale file it
# opened while formatting); the listing's own descriptors are left out: the directory
# opened here by its number, and the copy listdir makes of it, gone once it returns.
LIST_FDS = r"""
import json, os
d = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
fds = {}
for n in os.listdir(d):
    try:
        fds[n] = os.readlink(f"/proc/self/fd/{n}")
    except FileNotFoundError:
        pass  # listdir's own copy of d, closed when it returned
fds.pop(str(d))
print(json.dumps(fds))
"""


async def test_a_command_inherits_only_its_three_pipes(sandbox):
    engine, sid = sandbox
    lister = ["python3", "-I", "-S", "-c", LIST_FDS]
    quoted = " ".join(shlex.quote(a) for a in lister)
    for run in (
        lambda: engine.exec(sid, lister),
        lambda: engine.exec(sid, lister, stdin="x"),
        # a grandchild: what a shell's background job inherits
        lambda: engine.exec(sid, f"{quoted} & wait $!"),
    ):
        r = await run()
        assert r.returncode == 0, r.stderr
        fds = {int(n): target for n, target in json.loads(r.stdout).items()}
        assert set(fds) == {0, 1, 2}, fds
        assert all(fds[n].startswith("pipe:") for n in (1, 2)), fds


# The signal barrage: every signal number at pid 1, then a storm of forged SIGCHLDs.
SIGNALS = r"""
import json, os, signal, sys, time

def status(pid):
    lines = open(f"/proc/{pid}/status").read().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)

def barrage(pid):
    accepted = 0
    for sig in range(1, signal.SIGRTMAX + 1):
        try:
            os.kill(pid, sig)
            accepted += 1
        except OSError:
            pass
    for _ in range(1000):
        os.kill(pid, signal.SIGCHLD)
    return accepted

res = {}
if sys.argv[1] == "sibling":
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.2)
    res["stopped_state"] = status(pid)["State"].split()[0]
    os.kill(pid, signal.SIGCONT)
    os.kill(pid, signal.SIGUSR1)
    res["usr1_killed"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
else:
    before = status(1)
    res["SigCgt"], res["SigBlk"] = before["SigCgt"].strip(), before["SigBlk"].strip()
    res["accepted"] = barrage(1)
    res["state"] = status(1)["State"].split()[0]
print(json.dumps(res))
"""


async def test_no_signal_from_inside_stops_kills_or_confuses_the_agent(sandbox):
    engine, sid = sandbox
    control = await run_json(engine, sid, SIGNALS, "sibling")
    assert control["stopped_state"] == "T"  # SIGSTOP stops a same-uid process...
    assert control["usr1_killed"] == -10  # ...and SIGUSR1 kills one without a handler

    res = await run_json(engine, sid, SIGNALS, "1")
    assert res["accepted"] >= 60  # the kernel took them (kill is not filtered)...
    assert int(res["SigCgt"], 16) == 0  # ...but pid 1 has no handler for any of them
    assert int(res["SigBlk"], 16) == 1 << (17 - 1)  # only SIGCHLD, read from a signalfd
    assert res["state"] in ("S", "R")
    # A command that sends forged SIGCHLDs while it runs still gets its own exit.
    r = await engine.exec(
        sid, ["python3", "-c", "import os\nfor _ in range(2000): os.kill(1, 17)\nprint('x', flush=True)\nos._exit(5)"]
    )
    assert (r.returncode, r.stdout) == (5, b"x\n")
    await assert_honest(engine, sid)


# Stops every other process in the sandbox, in a loop, until the test has it stop
# (STOP_AT appears, written through the agent, which it cannot stop; STOP_FOR bounds it
# if the test died): it catches the agent's freshly forked children between fork and
# exec. The agent used to wait for that exec in a blocking read: it stopped answering
# anyone, and the engine ended the sandbox (run against the old agent, the first
# command did not come back).
STOP_AT = "/tmp/stop-stopping"
STOPPER = r"""
import os, signal, time
end = time.monotonic() + float(os.environ["STOP_FOR"])
print("stopping", flush=True)
while time.monotonic() < end and not os.path.exists("%s"):
    try:
        os.kill(-1, signal.SIGSTOP)
    except OSError:
        pass
""" % STOP_AT
CAUGHT = 3  # commands the stopper must catch (each one stopped, then killed on time)
MIN_COMMANDS = 20  # commands run while it stops everything, at least
MAX_COMMANDS = 400  # a stopper that catches none in as many did not run: the test fails


async def test_stopping_every_process_cannot_park_the_agent(sandbox):
    import asyncio

    engine, sid = sandbox
    stopper = await engine.spawn(sid, ["python3", "-c", STOPPER], env={"STOP_FOR": "600"})
    assert await asyncio.wait_for(stopper.readline(), 60) == b"stopping\n"
    # Commands go on until the stopper has caught some: how many it catches in a given
    # time is chance under load (it was a 4 s window: once, with ten test modules in
    # parallel, it caught none), how many it must catch is not.
    outcomes = []
    while (sum(outcomes) < CAUGHT or len(outcomes) < MIN_COMMANDS) \
            and len(outcomes) < MAX_COMMANDS:
        # a command that lives 0.1 s: `true` lived too short to be caught once the
        # agent's exec path got faster (caught 0 of 400, 1 run in 3 at load 30-60)
        r = await asyncio.wait_for(engine.exec(sid, ["sleep", "0.1"], timeout=0.5), 60)
        assert r.timed_out or r.returncode == 0, r  # stopped (and killed on time), or ran
        outcomes.append(r.timed_out)
        await asyncio.wait_for(engine.write_file(sid, "/tmp/alive", "yes"), 60)
    assert stopper.returncode is None, "the stopper ended before the test had it stop"
    await engine.write_file(sid, STOP_AT, "")
    assert sum(outcomes) >= CAUGHT, f"the stopper caught {sum(outcomes)} of {len(outcomes)}"
    await asyncio.wait_for(stopper.wait(), 60)
    assert await engine.read_file(sid, "/tmp/alive") == b"yes"
    await assert_honest(engine, sid)


# Issue 30: the agent ignores few signals as pid 1 and its child resets only those; a
# command must still start as if from a clean exec: no signal ignored, caught or blocked.
async def test_a_command_starts_with_default_signals_and_an_empty_mask(sandbox):
    engine, sid = sandbox
    for run in (
        lambda: engine.exec(sid, ["cat", "/proc/self/status"]),
        lambda: engine.exec(sid, ["cat", "/proc/self/status"], stdin="x"),
    ):
        r = await run()
        assert r.returncode == 0, r.stderr
        fields = dict(line.split(":", 1) for line in r.stdout.decode().splitlines() if ":" in line)
        for key in ("SigIgn", "SigCgt", "SigBlk", "SigPnd"):
            assert int(fields[key], 16) == 0, (key, fields[key])
    # on a terminal too (the child's other path: its own session)
    proc = await engine.spawn(sid, ["cat", "/proc/self/status"], terminal=TerminalSize(24, 80))
    text = b""
    async with asyncio.timeout(60):
        async for event in proc.output():
            if event.kind == "exit":
                break
            text += event.data
    fields = dict(line.split(":", 1) for line in text.decode().splitlines() if ":" in line)
    for key in ("SigIgn", "SigCgt", "SigBlk", "SigPnd"):
            assert int(fields[key], 16) == 0, (key, fields[key])
    # ...and the agent, pid 1, still ignores what it must (SIGPIPE: a closed reader).
    r = await engine.exec(sid, ["cat", "/proc/1/status"])
    fields = dict(line.split(":", 1) for line in r.stdout.decode().splitlines() if ":" in line)
    assert int(fields["SigIgn"], 16) & (1 << (13 - 1))


# CI found it: the agent reset only its own six signals in a command's child, trusting
# every other disposition to be SIG_DFL; but SIG_IGN survives execve, so a daemon started
# by a process that ignores signal 32 (or SIGQUIT, as a shell's background job does)
# handed that down to every command. The engine here starts from such a process.
async def test_a_command_starts_with_default_signals_whatever_the_daemon_inherited(state_dir):
    from corral.runtime.engine import Engine

    # SIGQUIT, SIGUSR1, glibc's two; each put back as it was after (only those at SIG_DFL
    # or SIG_IGN here: a handler's address could not be put back without its flags;
    # SIGINT is Python's handler, so this worker's ^C stays a KeyboardInterrupt)
    was = {s: rt_sigaction(s) for s in (3, 10, 32, 33)}  # (rt_sigaction: libc refuses 32)
    inherited = tuple(s for s, h in was.items() if h in (0, 1))
    assert 32 in inherited, was
    for s in inherited:
        rt_sigaction(s, 1)
    try:
        engine = await Engine.open(state_dir)
        try:
            sid = (await engine.create()).id
            for cmd in (["cat", "/proc/self/status"], ["cat", "/proc/1/status"]):
                r = await engine.exec(sid, cmd)
                assert r.returncode == 0, r.stderr
                fields = dict(ln.split(":", 1) for ln in r.stdout.decode().splitlines() if ":" in ln)
                ignored = int(fields["SigIgn"], 16)
                if cmd[1] == "/proc/self/status":
                    assert ignored == 0, hex(ignored)
                else:  # the agent: its own six, none of what it inherited
                    assert all(not ignored & (1 << (s - 1)) for s in inherited), hex(ignored)
            await assert_honest(engine, sid)
        finally:
            await engine.close()
    finally:
        for s in inherited:
            rt_sigaction(s, was[s])
