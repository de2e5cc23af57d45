"""What every judge does first inside its sandbox: become unreachable, stop the rest.

Sent ahead of a judge program (:func:`corral.guest.program`), so it imports only the
standard library. :func:`confine` makes the process non-dumpable (no
``/proc/PID/mem``, ``fd/*``, ``environ``, ``pidfd_getfd`` for processes of its uid;
a judge keeps no secret in its environment, argv or maps all the same: the tests come on
stdin after ``READY``),
ignores SIGINT and SIGKILLs every other process of the sandbox but the agent;
:func:`kill_others` is also the sweep between two test runs of the stdin/stdout judge.
"""

import os
import signal
import time


def confine(who):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise SystemExit("%s: cannot make itself non-dumpable" % who)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no KeyboardInterrupt mid-exchange
    if not kill_others():
        raise SystemExit("%s: other processes of the sandbox would not stop" % who)


def kill_others():
    """SIGKILL every process of the sandbox but pid 1 (the agent) and this one, until
    none is left but zombies; ``True`` if that happened within ~2 s."""
    me = os.getpid()
    try:
        with open("/proc/1/cmdline", "rb") as f:
            init = f.read().split(b"\0")[0]
    except OSError:
        init = b""
    if os.geteuid() == 0 or init != b"/.corral/agent":
        return False  # never outside a corral sandbox: kill(-1) would hit the host
    for _ in range(400):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return True
        if not any(_alive(entry, me) for entry in os.listdir("/proc")):
            return True
        time.sleep(0.005)
    return False


def _alive(entry, me):
    if not entry.isdigit() or int(entry) in (1, me):
        return False
    try:
        with open("/proc/%s/stat" % entry, "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
