"""Live checkpoints of a sandbox's processes with CRIU: the dump half (docs/live.md).

:func:`dump` runs the cached CRIU (:mod:`corral.runtime.criu`) as root on the host
against the sandbox's pid 1 (the agent: CRIU dumps a pid namespace only with its init),
with ``--leave-running``: whatever happens the sandbox goes on. Its images go to a fresh
directory under ``STATE/checkpoints/<tenant>/``, root-only (0700 all the way: they hold
the sandbox's memory, secrets included); a failed dump removes it and raises
:class:`~corral.errors.Unsupported` naming the cause CRIU gave.

Every mount of the sandbox is handed to CRIU as external (``--external mnt[PATH]:KEY``):
CRIU never reads or writes a mount's files, and a restore must be given each one again,
made by the launcher as for any sandbox. Mount points come from the sandbox's mountinfo;
a sandbox cannot mount (no capabilities, seccomp), and a path CRIU's syntax would read
differently is refused.

CRIU runs as the sandbox's own host uid, holding root's capabilities as ambient ones
(``--unprivileged``): root here may lack ``CAP_SYS_RESOURCE``, and ``prlimit()`` on a
task of another uid needs it, while a task of the caller's own uid needs nothing
(:func:`dumper`). Only a checkpointable sandbox (``SandboxSpec.checkpointable``: uid 0
mapped, one user namespace, the agent's channels made inside) can be dumped.

The engine freezes the sandbox before CRIU runs (:func:`freeze_for_dump`; CRIU is given
the frozen group, ``--freeze-cgroup``, and leaves it frozen). A group frozen while one of
its processes was between ``vfork()`` and its child's ``exec`` (``sh``, dash, runs
commands so; ``posix_spawn`` too) cannot be dumped: CRIU stops the child, and the parent,
waiting in the kernel for that child, never reaches the stop CRIU waits for, until CRIU's
``--timeout`` ends the dump. So such a freeze is let go and taken again.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from corral.errors import InvalidState, Unsupported
from corral.runtime import criu, live_images, syscalls
from corral.runtime.threadwork import finish_in_thread

DUMP_TIMEOUT_S = 120.0
# CRIU's own limit on seizing the tasks (its default, 10 s, ran out on a host at load
# 30: "Timeout reached. Try to interrupt"); the sandbox is frozen meanwhile either way
COLLECT_TIMEOUT_S = 60
FREEZE_TRIES = 20
"""Freezes a dump takes at most to catch the sandbox with no process mid-vfork."""
FREEZE_TIMEOUT_S = 30.0
"""A freeze waits this long for a task asleep in the kernel (a write throttled under
disk pressure freezes only once it wakes), as a commit's does (precopy.py)."""
_NS_GET_OWNER_UID = 0xB704  # linux/nsfs.h: _IO(0xb7, 0x4)
_ADMIN = "_admin"  # the images of sandboxes without a tenant
_MAX_KDAT = 64 << 10  # CRIU's struct kerndat_s is a few KiB
_TRASH = ".trash"  # deleted images, their bytes not removed yet (discard)
# CRIU errors that are not the cause (it logs them and goes on)
_NOISE = ("RLIMIT_NOFILE", "Dumping FAILED", "Dump files (pid", "Restoring FAILED")
# what the first error CRIU gives means, in the words of docs/live.md
CAUSES = (
    ("Unable to convert uid or gid", "userns_no_root",
     "the sandbox's user namespace maps no uid 0 (CRIU needs root mapped in it)"),
    ("doesn't belong to the target user namespace", "nested_userns",
     "the sandbox's namespaces belong to an outer user namespace (bubblewrap's "
     "--disable-userns nests one): CRIU handles one level"),
    ("Can't setns", "nested_userns",
     "CRIU cannot enter the sandbox's namespaces from its user namespace"),
    ("doesn't have a proper root mount", "mount", "a mount of the sandbox is not external"),
    ("on procfs: Permission denied", "criu_unpatched",
     "this CRIU build cannot checkpoint a restored copy (it lacks corral's patch: "
     f"{criu.BUILD})"),
    ("Unix socket", "agent_socket",
     "the agent's control socket belongs to the host's network namespace"),
    ("Timeout reached", "seize_timeout",
     f"CRIU could not stop every process of the sandbox within {COLLECT_TIMEOUT_S} s (one "
     "held in the kernel); retry"),
)


@dataclass(frozen=True)
class Images:
    """A dump that succeeded: its directory and the CRIU that wrote it."""

    path: Path
    criu_version: str


def images_root(state_dir: Path, tenant: str | None) -> Path:
    """``STATE/checkpoints/<tenant>``, made root-only (0700) if it is not."""
    root = Path(state_dir) / "checkpoints"
    tenant_dir = root / (tenant or _ADMIN)
    for d in (root, tenant_dir):
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
        if not d.is_dir() or d.is_symlink() or st.st_uid != os.geteuid():
            raise InvalidState(f"{d} is not a directory of this daemon's")
        os.chmod(d, 0o700)
    return tenant_dir


def discard(images: Path, state_dir: Path) -> None:
    """Take ``images`` away at once: a rename into ``STATE/checkpoints/.trash`` (no
    restore finds them, no quota counts them); :func:`empty_trash` removes the bytes
    later. Why: unlinking a checkpoint's pages (its sandbox's memory) takes ~0.1 s per
    50 MB here, which a resume or a fork would otherwise wait for."""
    trash = Path(state_dir) / "checkpoints" / _TRASH
    trash.mkdir(mode=0o700, exist_ok=True)
    images.rename(trash / f"{images.name}-{secrets.token_hex(4)}")


def empty_trash(state_dir: Path) -> None:
    """Remove what :func:`discard` took away (a daemon that died first left it there:
    the next discard's removal takes it too)."""
    trash = Path(state_dir) / "checkpoints" / _TRASH
    try:
        entries = list(trash.iterdir())
    except OSError:
        return
    for entry in entries:
        shutil.rmtree(entry, ignore_errors=True)


def images_bytes(state_dir: Path, tenant: str | None) -> int:
    """The size of ``tenant``'s process images (counted in its snapshot quota)."""
    root = Path(state_dir) / "checkpoints" / (tenant or _ADMIN)
    total = 0
    try:
        dumps = [d for d in root.iterdir() if d.is_dir() and not d.is_symlink()]
    except OSError:
        return 0
    for d in dumps:
        for f in d.iterdir():
            try:
                total += f.lstat().st_blocks * 512
            except OSError:
                continue
    return total


def sandbox_init(launcher_pid: int) -> int:
    """The host pid of the sandbox's pid 1: the one child of its launcher (its bwrap, or
    the CRIU that restored it) in a pid namespace of its own.

    A restored sandbox's CRIU stays its parent, and has children of its own too for a
    moment: its action script, run for each step, post-resume included (after the
    sandbox runs again, so after a resume returned), and then its zombie until CRIU
    reaps it. Those are in CRIU's own pid namespace: skipped, not counted."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    ours = os.stat(f"/proc/{launcher_pid}/ns/pid").st_ino
    inits = []
    for child in children:
        try:
            if os.stat(f"/proc/{child}/ns/pid").st_ino != ours:
                inits.append(int(child))
        except OSError:
            continue  # gone (reaped) meanwhile
    if len(inits) != 1:
        raise InvalidState(f"the sandbox's launcher has {len(inits)} children in a pid "
                           f"namespace of their own, not 1 (of {len(children)})")
    return inits[0]


def mid_vfork(pids: list[int]) -> list[int]:
    """Of ``pids`` (a group's processes), the parents waiting for a vfork child of the
    group to exec or exit: a child sharing its parent's address space."""
    stuck = []
    group = set(pids)  # a sandbox may have 65536 processes: no list scan per process
    for pid in pids:
        try:
            data = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2:].split()[1])
        if ppid in group and syscalls.same_vm(pid, ppid):
            stuck.append(ppid)
    return stuck


class _Freezer(Protocol):
    def freeze(self, timeout: float = ...) -> None: ...
    def thaw(self) -> None: ...
    def pids(self) -> list[int]: ...


async def freeze_for_dump(cgroup: _Freezer, sandbox_id: str) -> None:
    """Freeze the sandbox's group with none of its processes mid-vfork (see the module
    docstring): such a freeze is thawed and taken again, a little later each time, up to
    :data:`FREEZE_TRIES` times; then :class:`~corral.errors.Unsupported` (``cause``
    ``vfork``), the sandbox running. A cancel meanwhile, or a freeze that does not
    complete within :data:`FREEZE_TIMEOUT_S`, leaves it thawed."""
    def freeze_and_look() -> list[int]:
        # in a thread, the walk too: a /proc read per process, and a hostile sandbox's
        # group may hold tens of thousands of them (not the daemon's event loop's time)
        cgroup.freeze(FREEZE_TIMEOUT_S)
        try:
            return mid_vfork(cgroup.pids())
        except BaseException:
            cgroup.thaw()
            raise

    for attempt in range(FREEZE_TRIES):
        try:
            stuck = await finish_in_thread(freeze_and_look, on_cancel=lambda _: cgroup.thaw())
        except Exception:  # not frozen in time: not left half frozen either
            cgroup.thaw()
            raise
        if not stuck:
            return
        cgroup.thaw()
        await asyncio.sleep(0.005 * (attempt + 1))  # the child execs, then it is let be
    raise Unsupported(
        f"sandbox {sandbox_id} cannot be checkpointed now: each time it was frozen, a "
        f"process of it (pid {stuck[0]} on the host) was waiting for a vfork child to "
        "exec, which CRIU cannot dump; it keeps running: retry",
        details={"sandbox_id": sandbox_id, "cause": "vfork"})


def _ambient_caps() -> str:
    """``-all,+cap,...``: every capability in our bounding set, by setpriv's names."""
    names = subprocess.run(["setpriv", "--list-caps"], capture_output=True, text=True,
                           check=True).stdout.split()
    bound = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            bound = int(line.split()[1], 16)
    return ",".join(["-all", *(f"+{n}" for i, n in enumerate(names) if bound >> i & 1)])


def dumper(uid: int) -> list[str]:
    """The prefix that runs CRIU as host uid ``uid`` with our capabilities, ambient.

    Why: ``prlimit()`` of another uid's task needs ``CAP_SYS_RESOURCE`` in its user
    namespace, which root may not hold (some hosts drop it from the bounding set); of
    a task of the caller's own real uid and gid it needs nothing. Sandbox code cannot
    reach the dumper: it runs outside the sandbox's pid namespace, with capabilities
    the sandbox's processes lack (so they cannot ptrace it)."""
    caps = _ambient_caps()
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            f"--inh-caps={caps}", f"--ambient-caps={caps}"]


def _kerndat_dir(state_dir: Path) -> Path:
    """Where CRIU caches what it probed of the kernel (its dumps start faster): a
    directory of the daemon's state, reached by no sandbox."""
    d = Path(state_dir) / "checkpoints" / ".kerndat"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def kdat_cache(state_dir: Path, binary: criu.Criu) -> Path:
    """Where the engine keeps the kernel probes of ``binary`` for restores (launch.c,
    ``seed_kdat``): one file per boot and CRIU build, in a directory of the daemon's."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    name = f"criu.kdat-{boot}-{binary.version_text}-{binary.patch_level}"
    return _kerndat_dir(state_dir) / name


def keep_kdat(launcher_pid: int, cache: Path) -> None:
    """After a restore that had no probes to start from: keep those its CRIU (still the
    sandbox's outer process) wrote in the tmpfs of its own ``/run``. Best effort."""
    if cache.exists():
        return
    try:
        fd = os.open(f"/proc/{launcher_pid}/root/run/criu.kdat", os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_KDAT + 1)
    except OSError:
        return
    if not data or len(data) > _MAX_KDAT:
        return
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}-{secrets.token_hex(4)}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)
    os.replace(tmp, cache)


def userns_owner(pid: int) -> int:
    """The host uid that owns ``pid``'s user namespace (``NS_GET_OWNER_UID``).

    It has every capability over that namespace's tasks: a sandbox bubblewrap made is
    owned by its own uid (then CRIU dumps as that uid: :func:`dumper`), a copy CRIU
    restored as root by root (then CRIU dumps as root: root holds ``CAP_SYS_RESOURCE``
    there as its owner, and a restored task, which never executed a program, is
    reachable only from the host's user namespace)."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, _NS_GET_OWNER_UID, buf)
    finally:
        os.close(fd)
    return int.from_bytes(buf, "little")


def _chown_root(path: Path) -> None:
    """The dumper wrote the images as the sandbox's uid: make them root's."""
    for entry in (path, *path.iterdir()):
        os.chown(entry, 0, 0, follow_symlinks=False)
        if not entry.is_symlink():
            os.chmod(entry, 0o700 if entry.is_dir() else 0o600)


_SAFE_MOUNT = re.compile(r"^/[A-Za-z0-9._/+-]*$")


def external_mounts(pid: int) -> list[str]:
    """``--external mnt[PATH]:KEY`` for each mount point of ``pid`` but /proc and /dev
    (which CRIU makes again), keyed by :func:`~corral.runtime.live_images.mount_key`;
    :class:`Unsupported` for a path it would parse differently."""
    argv: list[str] = []
    seen: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point in ("/proc", "/dev"):
            continue
        if not _SAFE_MOUNT.match(point):
            raise Unsupported(f"a mount point of the sandbox ({point!r}) cannot be named to "
                              "CRIU", details={"cause": "mount"})
        argv += ["--external", f"mnt[{point}]:{live_images.mount_key(point, seen)}"]
    return argv


def agent_sockets(pid: int) -> dict[str, int]:
    """The inodes of the agent's channels (``ctl``: its stream socket, ``reattach``: its
    seqpacket one), socketpair ends made inside the sandbox (agent.c, ``local``) whose
    peers are the engine's and the warden's."""
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            held.add(int(target[8:-1]))
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 7 and int(cols[6]) in held:
            kind = {"0001": "ctl", "0005": "reattach"}.get(cols[4])
            if kind is None or kind in found:
                raise Unsupported("the sandbox's agent holds sockets a checkpoint cannot "
                                  "hand over", details={"cause": "agent_socket"})
            found[kind] = int(cols[6])
    if len(found) != 2 or len(held) != 2:
        raise Unsupported("the sandbox's agent channels are not its own (not a "
                          "checkpointable sandbox, or one adopted after a daemon restart)",
                          details={"cause": "agent_socket"})
    return found


def is_noise(line: str) -> bool:
    """A line CRIU logs as an error that is not the cause (it goes on, or sums up)."""
    return any(n in line for n in _NOISE)


def cause_of(log: str) -> tuple[str, str, str]:
    """(cause code, what it means, CRIU's own line) from a dump log."""
    errors = [ln for ln in log.splitlines() if "Error (" in ln and not is_noise(ln)]
    first = errors[0].split("): ", 1)[-1].strip() if errors else "no error in its log"
    for needle, code, meaning in CAUSES:
        if needle in first:
            return code, meaning, first
    return "criu_error", "CRIU refused the sandbox", first


async def dump(*, cache_dir: Path, state_dir: Path, sandbox_id: str, tenant: str | None,
               launcher_pid: int, uid: int | None = None, freezer: Path | None = None) -> Images:
    """Dump a running sandbox's processes, leaving them running (see the module's doc).
    With ``freezer`` (the sandbox's frozen freezer cgroup) CRIU leaves it frozen: its
    files can be committed before it goes on (``Engine.checkpoint``)."""
    binary = criu.require(cache_dir)
    root = images_root(state_dir, tenant)
    images = root / f"{sandbox_id}-{secrets.token_hex(6)}"
    images.mkdir(mode=0o700)
    try:
        pid = sandbox_init(launcher_pid)
        mounts = external_mounts(pid)
        own = ["--network-lock", "skip"]  # nothing but loopback to lock
        as_uid = None
        if uid is not None:  # only a checkpointable sandbox gets here
            live_images.check_mounts([m.rsplit(":", 1)[1] for m in mounts[1::2]])
            own += ["--empty-ns", "net"]  # loopback alone: made again at restore (live_images)
            channels = agent_sockets(pid)
            own += [f"--external=unix[{ino}]" for ino in channels.values()]
            as_uid = userns_owner(pid) or None  # see dumper(); root: a restored copy's
            if as_uid is not None:
                own.append("--unprivileged")
        if freezer is not None:
            own += ["--freeze-cgroup", str(freezer)]
        argv = [*([] if as_uid is None else dumper(as_uid)), str(binary.path), "dump", *own,
                "-t", str(pid), "-D", str(images), "-o", "dump.log", "--leave-running",
                "--timeout", str(COLLECT_TIMEOUT_S),
                "--ext-unix-sk", "--shell-job", *mounts]
        try:
            rc = await _run_dump(argv, state_dir, sandbox_id)
        finally:  # root's CRIU leaves its kernel probes in /run (criu.drop_kdat_tmp)
            await asyncio.to_thread(criu.drop_kdat_tmp)
        if rc != 0:
            log = (images / "dump.log").read_text(errors="replace")
            code, meaning, line = cause_of(log)
            raise Unsupported(
                f"sandbox {sandbox_id} cannot be checkpointed here: {meaning} (CRIU: {line}); "
                "it keeps running. See docs/live.md",
                details={"sandbox_id": sandbox_id, "cause": code, "criu_error": line},
            )
        if uid is not None:
            live_images.write_meta(images, **channels)
        _chown_root(images)
    except BaseException:
        shutil.rmtree(images, ignore_errors=True)
        raise
    return Images(images, binary.version_text)


async def _run_dump(argv: list[str], state_dir: Path, sandbox_id: str) -> int:
    """Run CRIU's dump; its exit status (a dump past DUMP_TIMEOUT_S is killed)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, cwd="/",
        env={"PATH": live_images.CRIU_PATH, "XDG_RUNTIME_DIR": str(_kerndat_dir(state_dir))})
    try:
        async with asyncio.timeout(DUMP_TIMEOUT_S):
            return await proc.wait()
    except asyncio.TimeoutError:
        await _stopped(proc)
        raise Unsupported(f"CRIU took over {DUMP_TIMEOUT_S:.0f} s to dump sandbox "
                          f"{sandbox_id}", details={"cause": "timeout"}) from None
    except BaseException:
        # a cancel (a client that left): CRIU must not run on past its checkpoint, as
        # the sandbox's uid, holding its tasks, writing into images being removed, and
        # leaving the freezer frozen as it found it after the engine thawed it
        await _stopped(proc)
        raise


async def _stopped(proc: asyncio.subprocess.Process) -> None:
    """Kill CRIU and wait for its end, whatever cancels the waiter meanwhile (CRIU's
    --leave-running resumes what it froze as it dies)."""
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    ended = asyncio.ensure_future(proc.wait())
    while not ended.done():
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            continue
