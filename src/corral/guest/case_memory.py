"""What one test case of the stdin/stdout judge holds in memory, all of it.

Sent ahead of :mod:`corral.guest.io_judge` (standard library only). A program may
spread its memory where no single process's resident size shows it: over several
processes (forks, a fork bomb of small allocations), into files (``/tmp``, ``/dev/shm``:
the sandbox's writable layer is a tmpfs, so a file *is* memory), into a ``memfd`` it
never maps, or into System V shared memory that outlives it. :class:`CaseMemory` sums
all of it for the processes of one case, the way a per-case cgroup would charge it:

- every process of the sandbox but the agent (pid 1) and the judge: its anonymous and
  shared-memory resident size (``/proc/PID/status``: ``RssAnon + RssShmem``), and the
  size of every memfd it holds open (``/proc/PID/fd``);
- the growth of the writable layer since the case started (``statvfs``: files, deleted
  files still open, ``/dev/shm``);
- the growth of System V shared memory (``/proc/sysvipc/shm``; the sandbox has its own
  IPC namespace).

Pages a forked child shares copy-on-write with its parent show in both resident sizes;
when the fast sum is over the limit and several processes hold it, their proportional
sizes (``smaps_rollup``: shared pages counted once) decide. A process of the program
that made itself non-dumpable can no longer be looked into: it hides its memory from
the judge, and :meth:`CaseMemory.over` says so once it was seen so three looks in a
row over 50 ms (a process is briefly unreadable while it execs).

The judge polls this while the program runs and once after (files it left behind).
Every process it counts is killed after the case (:func:`corral.guest.confine.kill_others`).
"""

import os
import time

HIDDEN = "a process of the program hid its memory from the judge (made itself non-dumpable)"
# A process is hiding once this many looks in a row, over at least this long, could not
# see into it: while it execs (its new memory starts as not dumpable as the judge's, whose
# posix_spawn it came from) or exits, it is unreadable for a moment.
HIDDEN_POLLS = 3
HIDDEN_SECONDS = 0.05


class CaseMemory:
    """Usage of one case above what the sandbox held when it started."""

    def __init__(self, limit, root="/"):
        self.limit, self.root, self.peak, self.why = limit, root, 0, None
        self.unseen = {}  # pid -> (looks in a row its descriptors were unreadable, since)
        self.me = os.getpid()
        self.base = self._files() + _sysv()

    def _files(self):
        try:
            s = os.statvfs(self.root)
        except OSError:
            return 0
        return (s.f_blocks - s.f_bfree) * s.f_frsize

    def over(self):
        """``None`` while the case is within ``limit`` bytes, else why not (kept in
        :attr:`why`); :attr:`peak`: the most it was seen to hold."""
        shared = max(0, self._files() + _sysv() - self.base)
        procs, fast, hidden, unseen = [], 0, False, {}
        for entry in _listdir("/proc"):
            if not entry.isdigit() or int(entry) in (1, self.me):
                continue
            rss = _status_rss(entry)
            if rss is None:
                continue  # gone meanwhile
            held = _memfds(entry)
            if held is None:  # not dumpable: for a moment (exec, exit) or on purpose
                looks, since = self.unseen.get(entry, (0, time.monotonic()))
                unseen[entry] = (looks + 1, since)
                if looks + 1 >= HIDDEN_POLLS and time.monotonic() - since >= HIDDEN_SECONDS:
                    hidden = hidden or _comm(entry)
                held = 0
            procs.append(entry)
            fast += rss + held
        self.unseen = unseen
        total = shared + fast
        if total > self.limit and len(procs) > 1 and not unseen:
            total = shared + sum(_pss(p) for p in procs)  # copy-on-write pages once
        self.peak = max(self.peak, total)
        if hidden:
            self.why = "%s: %s" % (HIDDEN, hidden)
        elif total > self.limit:
            self.why = "its processes and files held %d MiB" % (total >> 20)
        else:
            return None
        return self.why


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def _comm(pid):
    """``pid (name)`` of a process, for a note."""
    try:
        with open("/proc/%s/comm" % pid, "rb") as f:
            return "pid %s (%s)" % (pid, f.read().strip().decode(errors="replace"))
    except OSError:
        return "pid %s" % pid


def _status_rss(pid):
    """``RssAnon + RssShmem`` in bytes; ``None`` if the process is gone (or a zombie)."""
    try:
        with open("/proc/%s/status" % pid, "rb") as f:
            text = f.read()
    except OSError:
        return None
    total, seen = 0, False
    for line in text.split(b"\n"):
        if line.startswith((b"RssAnon:", b"RssShmem:")):
            total += int(line.split()[1]) * 1024
            seen = True
    return total if seen else None


def _memfds(pid):
    """Bytes of the memfds ``pid`` holds open; ``None`` if its descriptors cannot be
    looked at (it is not dumpable)."""
    base = "/proc/%s/fd" % pid
    try:
        names = os.listdir(base)
    except PermissionError:
        return None
    except OSError:
        return 0  # gone meanwhile
    total, seen = 0, set()
    for name in names:
        path = "%s/%s" % (base, name)
        try:
            if not os.readlink(path).startswith("/memfd:"):
                continue
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _pss(pid):
    """Proportional anonymous and shared-memory size of ``pid`` (bytes), its memfds
    included; the fast figure where ``smaps_rollup`` cannot be read."""
    try:
        with open("/proc/%s/smaps_rollup" % pid, "rb") as f:
            text = f.read()
    except OSError:
        return (_status_rss(pid) or 0) + (_memfds(pid) or 0)
    total = 0
    for line in text.split(b"\n"):
        if line.startswith((b"Pss_Anon:", b"Pss_Shmem:")):
            total += int(line.split()[1]) * 1024
    return total + (_memfds(pid) or 0)


def _sysv():
    """Resident bytes of every System V shared memory segment of the sandbox."""
    try:
        with open("/proc/sysvipc/shm", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return 0
    head = lines[0].split() if lines else []
    if b"rss" not in head:
        return 0
    col, size = head.index(b"rss"), 0
    for line in lines[1:]:
        fields = line.split()
        if len(fields) > col and fields[col].isdigit():
            size += int(fields[col])
    return size
