"""What one test case of the stdin/stdout judge holds in memory, all of it.

Sent ahead of :mod:`corral.guest.io_judge` (standard library only). A program may
spread its memory where no single process's resident size shows it: over several
processes (forks, a fork bomb of small allocations), into files (``/tmp``, ``/dev/shm``:
the sandbox's writable layer is a tmpfs, so a file *is* memory), into a ``memfd`` it
never maps, or into System V shared memory that outlives it. :class:`CaseMemory` sums
all of it for the processes of one case, the way a per-case cgroup would charge it:

- every process of the sandbox but the agent (pid 1) and the judge: its anonymous and
  shared-memory resident size and its huge pages (``/proc/PID/status``: ``RssAnon +
  RssShmem + HugetlbPages``: hugetlbfs pages are in no resident size), and the
  size of every memfd it holds open (``/proc/PID/fd``) or only maps (``maps``: the
  extent mapped, shared anonymous memory too), and what waits in the pipes it holds
  (but the judge's own), each counted once; read from a thread of it
  (``/proc/PID/task/TID``) once its main thread exited while others still run;
- the growth of the writable layer since the case started (``statvfs``: files, deleted
  files still open, ``/dev/shm``);
- the growth of System V shared memory and message queues (``/proc/sysvipc/shm``,
  ``/proc/sysvipc/msg``; the sandbox has its own IPC namespace).

Pages a forked child shares copy-on-write with its parent show in both resident sizes;
when the fast sum is over the limit and several processes hold it, their proportional
sizes (``smaps_rollup``: shared pages counted once) decide. A process of the program
that made itself non-dumpable can no longer be looked into: it hides its memory from
the judge, and :meth:`CaseMemory.over` says so once it was seen so three looks in a
row over 50 ms (a process is briefly unreadable while it execs).

The judge polls this while the program runs and once after (files it left behind).
Every process it counts is killed after the case (:func:`corral.guest.confine.kill_others`).
"""

import fcntl
import os
import struct
import termios
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
        procs, fast, hidden, unseen, seen = [], 0, False, {}, _own_pipes()
        for entry in _listdir("/proc"):
            if not entry.isdigit() or int(entry) in (1, self.me):
                continue
            where, rss = _live(entry)
            if where is None:
                continue  # gone meanwhile
            held = _memfds(where, seen)
            if held is None:  # not dumpable: for a moment (exec, exit) or on purpose
                looks, since = self.unseen.get(entry, (0, time.monotonic()))
                unseen[entry] = (looks + 1, since)
                if looks + 1 >= HIDDEN_POLLS and time.monotonic() - since >= HIDDEN_SECONDS:
                    hidden = hidden or _comm(entry)
                held = 0
            procs.append(where)
            fast += rss + held
        self.unseen = unseen
        total = shared + fast
        if total > self.limit and len(procs) > 1 and not unseen:
            seen = _own_pipes()  # copy-on-write pages, memfds and pipes once
            total = shared + sum(_pss(p, seen) for p in procs)
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


def _live(pid):
    """``(directory, resident bytes)`` (:func:`_status_rss`) of process ``pid``: ``/proc/PID``, or one of
    its threads (``/proc/PID/task/TID``) once its main thread exited while others run
    (then ``/proc/PID`` shows no memory and no descriptors); ``(None, 0)`` if it is gone
    or a zombie."""
    where = "/proc/%s" % pid
    rss = _status_rss(where)
    if rss is not None:
        return where, rss
    for tid in _listdir(where + "/task"):
        if tid != pid:
            rss = _status_rss("%s/task/%s" % (where, tid))
            if rss is not None:
                return "%s/task/%s" % (where, tid), rss
    return None, 0


def _status_rss(where):
    """``RssAnon + RssShmem + HugetlbPages`` in bytes; ``None`` if the process is gone
    (or a zombie)."""
    try:
        with open("%s/status" % where, "rb") as f:
            text = f.read()
    except OSError:
        return None
    total, seen = 0, False
    for line in text.split(b"\n"):
        if line.startswith((b"RssAnon:", b"RssShmem:", b"HugetlbPages:")):
            total += int(line.split()[1]) * 1024
            seen = True
    return total if seen else None


def _memfds(where, seen=None):
    """Bytes of the memfds the process at ``where`` (:func:`_live`) holds: open (their
    size), or only mapped (the extent mapped; shared anonymous mappings too: pages a
    process wrote through a mapping stay in the object once no page table maps them),
    and the bytes waiting in the pipes it holds.
    ``seen``: objects already counted. ``None`` if its descriptors cannot be looked at
    (it is not dumpable)."""
    base = "%s/fd" % where
    try:
        names = os.listdir(base)
    except PermissionError:
        return None
    except OSError:
        return 0  # gone meanwhile
    total, seen = 0, set() if seen is None else seen
    for name in names:
        path = "%s/%s" % (base, name)
        try:
            link = os.readlink(path)
            if link.startswith("pipe:"):
                if link not in seen:
                    seen.add(link)
                    total += _queued(path)
                continue
            if not link.startswith("/memfd:"):
                continue
            st = os.stat(path)
        except OSError:
            continue
        key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        if key not in seen:
            seen.add(key)
            total += st.st_blocks * 512
    extent = {}
    for key, end in _shmem_mappings(where):
        if key not in seen:
            extent[key] = max(extent.get(key, 0), end)
    seen.update(extent)
    return total + sum(extent.values())


def _queued(path):
    """Bytes waiting in the pipe ``path`` (a ``/proc/PID/fd`` link) names."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except OSError:
        return 0
    finally:
        os.close(fd)


def _own_pipes():
    """The pipes this process holds (a program's stdin, stdout, stderr): not its memory."""
    return {link for name in _listdir("/proc/self/fd")
            if (link := _readlink("/proc/self/fd/" + name)).startswith("pipe:")}


def _readlink(path):
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _shmem_mappings(where):
    """``((major, minor, inode), end offset)`` of each mapping of a memfd or of shared
    anonymous memory (``/proc/PID/maps``)."""
    try:
        with open("%s/maps" % where, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith((b"/memfd:", b"/dev/zero (deleted)")):
            continue
        try:
            start, end = (int(x, 16) for x in fields[0].split(b"-"))
            major, minor = (int(x, 16) for x in fields[3].split(b":"))
            yield (major, minor, int(fields[4])), int(fields[2], 16) + end - start
        except ValueError:
            continue


def _pss(where, seen):
    """Proportional anonymous and shared-memory size of the process at ``where``
    (bytes), its memfds included; the fast figure where ``smaps_rollup`` cannot be read."""
    try:
        with open("%s/smaps_rollup" % where, "rb") as f:
            text = f.read()
    except OSError:
        return (_status_rss(where) or 0) + (_memfds(where, seen) or 0)
    total = 0
    for line in text.split(b"\n"):
        if line.startswith((b"Pss_Anon:", b"Pss_Shmem:", b"Private_Hugetlb:", b"Shared_Hugetlb:")):
            total += int(line.split()[1]) * 1024
    return total + (_memfds(where, seen) or 0)


def _sysv():
    """Bytes held in System V IPC of the sandbox: every shared memory segment's resident
    size and every message queue's queued bytes."""
    return _ipc_column("/proc/sysvipc/shm", b"rss") + _ipc_column("/proc/sysvipc/msg",
                                                                    b"cbytes")


def _ipc_column(path, name):
    """The sum of column ``name`` of a ``/proc/sysvipc`` table."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return 0
    head = lines[0].split() if lines else []
    if name not in head:
        return 0
    col, size = head.index(name), 0
    for line in lines[1:]:
        fields = line.split()
        if len(fields) > col and fields[col].isdigit():
            size += int(fields[col])
    return size


# Sockets for the programs a judge runs: none. A socket holds memory no process shows:
# a descriptor in flight on a Unix socket (a memfd sent and closed, SCM_RIGHTS) is in
# no /proc/PID/fd, and socket buffers are in no resident size. The filter refuses
# socket() and socketpair() (EAFNOSUPPORT) and every call of another ABI (x86's 32-bit
# and x32 ones) to this process and all it starts.
_ARCH = {"x86_64": (0xC000003E, 41, 53), "aarch64": (0xC00000B7, 198, 199)}


def forbid_sockets():
    """Install the filter; ``False`` where this machine's architecture is not known."""
    import ctypes
    import platform

    if platform.machine() not in _ARCH:
        return False
    arch, socket_nr, socketpair_nr = _ARCH[platform.machine()]
    allow, deny = 0x7FFF0000, 0x00050000 | 97  # SECCOMP_RET_ERRNO | EAFNOSUPPORT
    code = [(0x20, 0, 0, 4),                    # A = arch
            (0x15, 1, 0, arch),                 # native: go on
            (0x06, 0, 0, deny),
            (0x20, 0, 0, 0),                    # A = syscall number
            (0x35, 3, 0, 0x40000000),           # x32: refused
            (0x15, 2, 0, socket_nr),
            (0x15, 1, 0, socketpair_nr),
            (0x06, 0, 0, allow),
            (0x06, 0, 0, deny)]

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8),
                    ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(code))(*[Insn(*i) for i in code])
    prog = Prog(len(code), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    if libc.prctl(38, 1, None, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot refuse sockets to the programs judged")
    return True
