"""A parent as unkind as a CI runner can be, and an engine started from it.

``python -m tests.security.hostile_parent -- ARGV...`` puts this process in the state
below and execs ARGV, which inherits all of it (as a daemon inherits its runner's):
signals ignored and blocked (SIG_IGN and the mask survive execve), umask 077, low soft
resource limits and an unlimited core size, a nice level, one CPU, a session of its own
without a terminal, stdin closed, and an environment with odd locale, time zone,
``TMPDIR``, no ``HOME``, ``PYTHONWARNINGS=error`` and proxies that lead nowhere.

``python -m tests.security.hostile_parent --kernel -- ARGV...`` hands down what the
kernel keeps across fork and execve beyond that (:func:`make_kernel_hostile`: a
personality, a real-time scheduling policy and I/O class, a timer slack, THP disabled,
the IO_FLUSHER flag); ``--one`` starts one sandbox and prints what :data:`KERNEL_PROBE`
saw in it (tests/security/test_inherited_kernel_state.py).

``python -m tests.security.hostile_parent --open-files`` (under ``prlimit``) tries a
sandbox past the process's hard descriptor limit. ``--engine`` opens an engine on a private state
directory, starts :data:`SANDBOXES` sandboxes, runs :data:`PROBE` in each and prints
what they saw (JSON): tests/security/test_inherited_state.py reads it.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import rt_sigaction

IGNORED = (1, 2, 3, 10, 12, 15, 17, 32, 33)  # HUP INT QUIT USR1 USR2 TERM CHLD, glibc's two
BLOCKED = (2, 10, 14, 15, 17, 34)  # INT USR1 ALRM TERM CHLD RTMIN
UMASK = 0o077
NICE = 5
SOFT_LIMITS = {  # soft only: any runner can lower them, whatever its capabilities
    resource.RLIMIT_NOFILE: 48,
    resource.RLIMIT_FSIZE: 1 << 20,
    resource.RLIMIT_CPU: 3600,
    resource.RLIMIT_STACK: 1 << 20,
    resource.RLIMIT_NPROC: 200,
    resource.RLIMIT_MEMLOCK: 64 << 10,
}
DEAD_PROXY = "http://127.0.0.1:9"  # discard: nothing answers there
ENV = {
    "LANG": "xx_YY.bogus", "LC_ALL": "xx_YY.bogus", "TZ": "Pacific/Kiritimati",
    "TMPDIR": "/nonexistent-tmpdir", "PYTHONWARNINGS": "error", "PYTHONHASHSEED": "7",
    "PYTHONDONTWRITEBYTECODE": "1", "http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY,
    "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "ALL_PROXY": DEAD_PROXY,
    "all_proxy": DEAD_PROXY, "NO_PROXY": "example.com", "no_proxy": "example.com",
    "SHELL": "/bin/false", "TERM": "dumb",
    "PATH": "/usr/local/bin:/usr/bin:/bin",  # no sbin (a service's, su's): no nft, no losetup
}
SANDBOXES = 10  # ~5 descriptors each: more than 48 hold (test_inherited_state.py)
# what a command sees: its status, limits, environment, nice level and what it creates
PROBE = ("cat /proc/self/status; echo @@; cat /proc/self/limits; echo @@; env; echo @@;"
         " cut -d' ' -f19 /proc/self/stat; echo @@; cd /tmp && echo x > f && mkdir d &&"
         " stat -c %a f d; echo @@; grep SigIgn /proc/1/status")

# the kernel state a parent can hand down (make_kernel_hostile)
PERSONALITY = 0x0040000  # ADDR_NO_RANDOMIZE (setarch -R)
RT_PRIORITY = 1  # SCHED_FIFO (chrt -f 1)
TIMER_SLACK_NS = 20_000_000  # 20 ms (systemd's TimerSlackNSec=)
PR_SET_TIMERSLACK, PR_SET_THP_DISABLE, PR_SET_IO_FLUSHER = 29, 41, 57
PF_IO_FLUSHER = 0x00080000 | 0x00100000  # PF_MEMALLOC_NOIO | PF_LOCAL_THROTTLE
# what a command (and of it, what /proc shows of the agent, pid 1: not its personality
# or timer slack, it is not dumpable) runs with, a line "WHO WHAT VALUE..." each:
# /proc/PID/stat's 9th field is the flags, its 41st the policy
KERNEL_PROBE = ("for p in $$ 1; do echo $p stat $(cut -d' ' -f9,41 /proc/$p/stat);"
                " echo $p $(grep THP_enabled /proc/$p/status); echo $p ionice $(ionice -p $p);"
                " done; echo $$ personality $(cat /proc/$$/personality);"
                " echo $$ timerslack $(cat /proc/self/timerslack_ns)")  # (another's: CAP_SYS_NICE)


def make_kernel_hostile() -> list[str]:
    """Hand down, beside :func:`make_hostile`'s, what the kernel keeps across execve;
    the names of what this host let us set (a container may refuse real-time policies
    or IO_FLUSHER)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    done = ["personality"] if libc.personality(ctypes.c_ulong(PERSONALITY)) >= 0 else []
    for name, option, value in (("timerslack", PR_SET_TIMERSLACK, TIMER_SLACK_NS),
                                ("thp", PR_SET_THP_DISABLE, 1),
                                ("io_flusher", PR_SET_IO_FLUSHER, 1)):
        zero = ctypes.c_ulong(0)  # (varargs: each a full unsigned long)
        if libc.prctl(option, ctypes.c_ulong(value), zero, zero, zero) == 0:
            done.append(name)
    if subprocess.run(["ionice", "-c", "1", "-n", "0", "-p", str(os.getpid())],
                      check=False).returncode == 0:
        done.append("ioprio")
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
        done.append("fifo")
    except OSError:
        pass  # (a cgroup without a real-time budget: EPERM)
    return done


async def probe_one() -> dict:
    """What one sandbox's command saw (:data:`KERNEL_PROBE`), or why its create failed."""
    from corral.errors import CorralError
    from corral.runtime.engine import Engine

    out: dict = {"handed_down": os.environ.get("CORRAL_TEST_HANDED_DOWN", "").split(",")}
    state = Path(tempfile.mkdtemp(prefix="corral-test-hostile-", dir="/tmp"))
    os.chmod(state, 0o711)
    try:
        engine = await Engine.open(state, warm_slots=0)
        try:
            try:
                sid = (await engine.create()).id
            except CorralError as exc:
                return {**out, "create": str(exc)}
            r = await engine.exec(sid, ["sh", "-c", KERNEL_PROBE], timeout=120)
            return {**out, "probe": [r.returncode, r.stdout.decode(), r.stderr.decode()]}
        finally:
            await engine.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)


def make_hostile(env: dict[str, str]) -> dict[str, str]:
    """Put this process in the hostile state; the environment to exec with."""
    for s in IGNORED:
        rt_sigaction(s, 1)  # SIG_IGN
    signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
    os.umask(UMASK)
    for res, soft in SOFT_LIMITS.items():
        hard = resource.getrlimit(res)[1]
        resource.setrlimit(res, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))  # as large as allowed
    os.nice(NICE)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if os.getsid(0) != os.getpid():
        os.setsid()  # no controlling terminal
    os.close(0)
    out = {k: v for k, v in env.items() if k != "HOME"}
    out.update(ENV)
    return out


async def probe_engine() -> dict:
    """What an engine opened here did, and what its sandboxes' commands saw."""
    from corral.runtime.engine import Engine

    state = Path(tempfile.mkdtemp(prefix="corral-test-hostile-", dir="/tmp"))
    os.chmod(state, 0o711)
    out: dict = {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "commands": []}
    try:
        engine = await Engine.open(state)
        try:
            out["nofile_open"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            # what the daemon may write at once: its registry, layers, checkpoints
            big = state / "big"
            big.write_bytes(bytes(2 * SOFT_LIMITS[resource.RLIMIT_FSIZE]))
            out["wrote"] = big.stat().st_size
            big.unlink()
            # the exit status of a host-side helper, as the engine's own subprocess calls see it
            out["false_status"] = subprocess.run(["false"], check=False).returncode
            ids = [(await engine.create()).id for _ in range(SANDBOXES)]
            for sid in ids:
                r = await engine.exec(sid, ["sh", "-c", PROBE], timeout=60)
                out["commands"].append([r.returncode, r.stdout.decode(), r.stderr.decode()])
            r = await engine.exec(ids[0], ["sleep", "30"], timeout=0.5)
            out["timed_out"] = r.timed_out
            # a network policy: its namespace, link and nftables rules made by host tools
            sid = (await engine.create(network={"allow": ["192.0.2.1"]})).id
            r = await engine.exec(sid, ["cat", "/etc/resolv.conf"], timeout=60)
            out["policy"] = [r.returncode, r.stderr.decode()]
            out["restored"] = await restored_probe(engine)
        finally:
            await engine.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return out


async def restored_probe(engine) -> list | None:  # noqa: ANN001
    """:data:`PROBE` in a sandbox restored from a live checkpoint (CRIU, run by this
    engine), and the status of a process it restored; None without a cached CRIU."""
    from corral.runtime import criu

    if criu.find(engine.layout.cache_dir) is None:
        return None
    sb = await engine.create(network="none", checkpointable=True)
    await engine.exec(sb.id, ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $! > /tmp/pid"])
    snap = await engine.checkpoint(sb.id, name="hostile")
    copy = await engine.restore_checkpoint(snap.id)
    r = await engine.exec(copy.id, ["sh", "-c", PROBE + "; echo @@; cat /proc/$(cat /tmp/pid)/status"
                                    "; echo @@; cat /proc/$(cat /tmp/pid)/limits"], timeout=60)
    return [r.returncode, r.stdout.decode(), r.stderr.decode()]


async def probe_open_files() -> dict:
    """Under a hard RLIMIT_NOFILE below a sandbox's default open_files: what a default
    create says, and what a sandbox that asks for less gets."""
    from corral.errors import SandboxStartError
    from corral.runtime.engine import Engine

    state = Path(tempfile.mkdtemp(prefix="corral-test-hostile-", dir="/tmp"))
    os.chmod(state, 0o711)
    out: dict = {}
    try:
        engine = await Engine.open(state, warm_slots=0)
        try:
            for name, spec in (("default", {}), ("asked", {"open_files": 128})):
                try:
                    sid = (await engine.create(spec)).id
                except SandboxStartError as exc:
                    out[name] = str(exc)
                    continue
                r = await engine.exec(sid, ["sh", "-c", "ulimit -n"], timeout=60)
                out[name] = int(r.stdout)
        finally:
            await engine.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--engine"]:
        print(json.dumps(asyncio.run(probe_engine())))
        return 0
    if argv[:1] == ["--one"]:
        print(json.dumps(asyncio.run(probe_one())))
        return 0
    if argv[:2] == ["--kernel", "--"] and len(argv) > 2:
        os.environ["CORRAL_TEST_HANDED_DOWN"] = ",".join(make_kernel_hostile())
        os.execvp(argv[2], argv[2:])
    if argv[:1] == ["--open-files"]:
        print(json.dumps(asyncio.run(probe_open_files())))
        return 0
    if argv[:1] != ["--"] or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    env = make_hostile(dict(os.environ))
    os.execvpe(argv[1], argv[1:], env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
