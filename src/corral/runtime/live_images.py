"""A live checkpoint's images, made ready for one restore (docs/live.md).

The restore half of :mod:`corral.runtime.checkpoint`. CRIU restores as root on the
host, so its images are hostile input: nothing it is told comes from them.

- **Mounts**: every mount of a checkpointable sandbox was dumped as external under a
  key named after its mount point (:func:`mount_key`); a restore maps the keys it knows
  to the new slot's own mounts (:func:`restore_argv`), made by the launcher as for any
  sandbox. A key it does not know fails the restore; a host path never comes from the
  images.
- **User namespace**: the image's map is not read; it is written again
  (:func:`stage`): uid and gid 0 to the new slot's host uid, nothing else.
- **The agent's channels**: the socket inodes CRIU must hand over (``--inherit-fd``)
  are the engine's own record (``corral.json``, written by the dump, root's), checked
  to be numbers; the descriptors are the new slot's.
- Each restore gets its own directory of hard links (the pages are never copied; an
  ACL entry lets the new slot's root read them while it restores) plus its user
  namespace image, in the new sandbox's directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from corral.errors import InvalidState, Unsupported
from corral.runtime.uids import SANDBOX_UID, root_uid
from corral.runtime.users import ROOT_CAPS

META = "corral.json"
CRIU_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # CRIU runs ip and iptables-restore
_COMMON_MAGIC = 0x54564319  # CRIU's images/magic.h: IMG_COMMON_MAGIC
_USERNS_MAGIC = 0x55474906  # USERNS_MAGIC
_MAX_SAID = 500  # characters of the action script's errors quoted in an error
_DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
# CRIU's action script, run for each of its steps (:func:`action_script`).
# - A checkpointable sandbox's network namespace holds loopback alone (a policy's is
#   refused at checkpoint): rather than CRIU making it again (several `ip` and
#   `iptables-restore` runs), it is made empty and its loopback brought up, once the
#   namespaces exist and before any socket is restored (setup-namespaces).
# - CRIU gives each restored process the limits its images name, up to its own (the
#   launcher raises CRIU's open files limit: launchargs.py): once every process is
#   restored and before any runs again (pre-resume, each stopped under CRIU's ptrace),
#   each one's open files limit is lowered to the new sandbox's own where above it.
#   Walked from the restored init by /proc's children lists, with the shell's builtins
#   (a fork only for a limit to lower); a failure is written to @ERRORS@ (prlimit's
#   message) and fails the check after the restore, typed (:func:`check_restored`).
_ACTION_SCRIPT = """#!/bin/sh
case "$CRTOOLS_SCRIPT_ACTION" in
setup-namespaces) exec nsenter --target "$CRTOOLS_INIT_PID" --net ip link set lo up ;;
pre-resume) ;;
*) exit 0 ;;
esac
max=@NOFILE@
todo=$CRTOOLS_INIT_PID
while [ -n "$todo" ]; do
    set -- $todo
    p=$1
    shift
    todo=$*
    for t in /proc/$p/task/*/children; do
        kids=
        read -r kids < "$t"
        todo="$todo $kids"
    done
    while read -r a b c soft hard rest; do
        [ "$a $b $c" = "Max open files" ] && break
    done < /proc/$p/limits
    h=$hard
    [ "$h" -gt "$max" ] && h=$max
    s=$soft
    [ "$s" -gt "$h" ] && s=$h
    if [ "$s:$h" != "$soft:$hard" ]; then
        if ! err=$(prlimit --pid "$p" --nofile="$s:$h" 2>&1); then
            echo "$p $hard $err" >> '@ERRORS@'
            exit 1
        fi
    fi
done
"""


NOFILE_ERRORS = "criu-nofile.err"
"""Where the action script says which limit it could not lower (in the sandbox's
directory, root's: the sandbox never sees it)."""


def action_script(nofile: int, errors: Path) -> str:
    """CRIU's action script for a restore into a sandbox of ``nofile`` open files, its
    failures written to ``errors`` (see the comment above)."""
    if "'" in str(errors):
        raise ValueError(f"a path with a quote: {errors}")
    return _ACTION_SCRIPT.replace("@NOFILE@", str(int(nofile))).replace("@ERRORS@", str(errors))


def mount_key(point: str, seen: dict[str, int]) -> str:
    """The external key of a mount point: ``dev.pts``, ``dev.pts.1`` for a second one."""
    base = point.strip("/").replace("/", ".") or "root"
    n = seen.get(base, 0)
    seen[base] = n + 1
    return base if n == 0 else f"{base}.{n}"


def mount_sources(sandbox_dir: Path) -> dict[str, str]:
    """Each key a checkpointable sandbox may have, to the new sandbox's own mount
    (the root itself is ``--root``)."""
    rw = sandbox_dir / "rw"
    known = {f"dev.{n}": f"/dev/{n}" for n in _DEV_NODES}
    known.update({"dev.pts": str(rw / "pts"), "dev.pts.1": str(rw / "pts"),
                  "dev.shm": str(rw / "shm"), "sys": str(rw / "sys")})
    return known


def check_mounts(keys: list[str]) -> None:
    """:class:`Unsupported` for a sandbox with a mount a restore could not make again
    (a volume, a GPU's files, a network policy's resolv.conf)."""
    known = set(mount_sources(Path("/"))) | {"root"}
    odd = [k for k in keys if k not in known]
    if odd:
        raise Unsupported(f"a sandbox with these mounts cannot be checkpointed yet: {odd}",
                          details={"cause": "mount", "mounts": odd})


def write_meta(images: Path, *, ctl: int, reattach: int) -> None:
    (images / META).write_text(json.dumps({"ctl": ctl, "reattach": reattach}))
    os.chmod(images / META, 0o600)


def read_meta(images: Path) -> dict[str, int]:
    try:
        meta = json.loads((images / META).read_text())
        out = {k: meta[k] for k in ("ctl", "reattach")}
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise InvalidState(f"{images} is not a live checkpoint of this daemon's") from None
    if not all(type(v) is int and v > 0 for v in out.values()):
        raise InvalidState(f"{images}: its record is damaged")
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _extent(first: int, lower: int) -> bytes:
    body = b"\x08" + _varint(first) + b"\x10" + _varint(lower) + b"\x18\x01"  # count 1
    return _varint(len(body)) + body


def userns_image(uid: int) -> bytes:
    """CRIU's ``userns-*.img`` for a sandbox of host uid ``uid``: its user (1000) to
    ``uid``, its root (0) to :func:`~corral.runtime.uids.root_uid` (docs/users.md),
    nothing else; uids and gids alike."""
    entry = (b"\x0a" + _extent(0, root_uid(uid)) + b"\x0a" + _extent(SANDBOX_UID, uid)
             + b"\x12" + _extent(0, root_uid(uid)) + b"\x12" + _extent(SANDBOX_UID, uid))
    return (_COMMON_MAGIC.to_bytes(4, "little") + _USERNS_MAGIC.to_bytes(4, "little")
            + len(entry).to_bytes(4, "little") + entry)


def stage(images: Path, dest: Path, *, uid: int) -> None:
    """``dest`` (made here): ``images``' files for host uid ``uid``, the user namespace
    image written anew. CRIU reads the images from inside the new user namespace (as
    its root, or as host root without capabilities). Each image is a hard link to the
    checkpoint's own file (no byte copied), which an ACL entry lets the new slot's root
    read (:func:`unstage` removes it); where links or ACLs do not work (another
    filesystem), a copy owned by its root's host uid and group 0, 0440. ``dest`` is
    only searchable (0711); nothing of the sandbox reaches it (its root is elsewhere)
    while CRIU restores, and it is removed once the agent answers."""
    dest.mkdir(mode=0o711)
    os.chmod(dest, 0o711)
    userns = 0
    for entry in images.iterdir():
        if entry.is_symlink() or not entry.is_file():
            raise InvalidState(f"{images} holds {entry.name}, which is not a plain file")
        if entry.name == META or entry.suffix not in (".img", ".gz"):
            continue
        userns += entry.name.startswith("userns-")
        if not entry.name.startswith("userns-") and _link(entry, dest / entry.name, uid):
            continue
        fd = os.open(dest / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o440)
        try:
            if entry.name.startswith("userns-"):
                os.write(fd, userns_image(uid))
            else:
                with open(entry, "rb") as src:
                    size = os.fstat(src.fileno()).st_size
                    while size > 0:
                        size -= os.copy_file_range(src.fileno(), fd, size) or size
            # read from inside the new user namespace: by its root (root_uid) or, before
            # CRIU gives a task its ids, by host root without its capabilities (gid 0)
            os.fchown(fd, root_uid(uid), 0)
        finally:
            os.close(fd)
    if userns != 1:
        raise InvalidState(f"{images} has {userns} user namespaces, not 1")


def unstage(images: Path, *, uid: int) -> None:
    """A restore for host uid ``uid`` ended: its read access to ``images`` goes."""
    with _acl_lock(images):
        for entry in images.iterdir():
            if entry.suffix == ".img" and not entry.is_symlink():
                try:
                    _set_reader(entry, root_uid(uid), add=False)
                except OSError:
                    continue


def _link(src: Path, dst: Path, uid: int) -> bool:
    """``dst`` a hard link to ``src`` readable by ``uid``'s root (an ACL entry), or
    False where that cannot be (another filesystem, no ACLs): then it is copied."""
    try:
        with _acl_lock(src.parent):
            _set_reader(src, root_uid(uid), add=True)
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        return False
    return True


_ACL = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def _set_reader(path: Path, uid: int, *, add: bool) -> None:
    """Add (or remove) a read entry for host uid ``uid`` in ``path``'s POSIX ACL
    (linux/posix_acl_xattr.h); the owner keeps read and write, nobody else has any."""
    try:
        raw = os.getxattr(path, _ACL, follow_symlinks=False)
        users = {i for t, _, i in struct.iter_unpack("<HHI", raw[4:]) if t == _ACL_USER}
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        users = set()
    users = (users | {uid}) if add else (users - {uid})
    entries = [(_ACL_USER_OBJ, 6, _NO_ID), *((_ACL_USER, 4, u) for u in sorted(users)),
               (_ACL_GROUP_OBJ, 0, _NO_ID)]
    if users:
        entries.append((_ACL_MASK, 4, _NO_ID))
    entries.append((_ACL_OTHER, 0, _NO_ID))
    os.setxattr(path, _ACL, struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", *e) for e in entries), follow_symlinks=False)


@contextmanager
def _acl_lock(images: Path) -> Iterator[None]:
    """Restores of one checkpoint change its files' ACLs one at a time (a fork's)."""
    fd = os.open(images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def restore_argv(criu: Path, dest: Path, *, sandbox_dir: Path, meta: dict[str, int],
                 ctl_fd: int, reattach_fd: int, nofile: int) -> list[str]:
    """CRIU's restore of the images staged in ``dest`` into the new sandbox's mounts,
    its agent given the new slot's channels, its processes at most ``nofile`` open
    files. Run by the launcher, as root, in the new slot's cgroup (it stays CRIU's
    parent: ``-d`` is not given)."""
    script = sandbox_dir / "criu-action.sh"  # not in dest: CRIU runs it after dest is gone
    errors = sandbox_dir / NOFILE_ERRORS
    errors.unlink(missing_ok=True)
    script.write_text(action_script(nofile, errors))
    os.chmod(script, 0o500)
    argv = ["/usr/bin/env", "-i", f"PATH={CRIU_PATH}", str(criu), "restore", "-D", str(dest),
            "-o", "restore.log", "--shell-job", "--network-lock", "skip",
            "--empty-ns", "net", "--action-script", str(script),
            "--manage-cgroups=ignore", "--root", str(sandbox_dir / "root"),
            "--inherit-fd", f"fd[{ctl_fd}]:socket:[{meta['ctl']}]",
            "--inherit-fd", f"fd[{reattach_fd}]:socket:[{meta['reattach']}]"]
    for key, src in mount_sources(sandbox_dir).items():
        argv += ["--external", f"mnt[{key}]:{src}"]
    return argv


def check_restored(pids: list[int], *, outer: int, uid: int, nofile: int,
                   sandbox_dir: Path | None = None) -> None:
    """After a restore, before the sandbox is handed out: every process of its cgroup
    but ``outer`` (CRIU, its parent) is what a sandbox's processes always are, whatever
    its images said: the slot's host uid or its root's, no capability beyond
    :data:`~corral.runtime.users.ROOT_CAPS` (bounding set included), ``no_new_privs``,
    a seccomp filter and at most ``nofile`` open files (the sandbox's own limit).
    :class:`InvalidState` otherwise (a forged or damaged checkpoint): the caller ends
    the sandbox. A limit the restore's action script could not lower (it says so in
    ``sandbox_dir``'s :data:`NOFILE_ERRORS`) is :class:`Unsupported` instead, saying
    what to do: the sandbox is ended all the same."""
    allowed = _caps_mask(ROOT_CAPS)
    for pid in pids:
        if pid == outer:
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # gone: nothing to check
        fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
        ids = {int(v) for k in ("Uid", "Gid") for v in fields[k].split()}
        caps = [int(fields[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")]
        confined = (ids <= {uid, root_uid(uid)} and not any(c & ~allowed for c in caps)
                    and fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2")
        if confined and (hard := _nofile_hard(pid)) > nofile and sandbox_dir is not None:
            _not_lowered(sandbox_dir / NOFILE_ERRORS, pid, hard, nofile)
        if not confined or _nofile_hard(pid) > nofile:
            raise InvalidState(
                f"a restored process (host pid {pid}) is not confined like a sandbox's "
                "(its ids, capabilities, no_new_privs, seccomp filter or open files limit "
                "differ): the checkpoint's images were changed; the sandbox was ended",
                details={"cause": "forged_images", "pid": pid})


def _not_lowered(errors: Path, pid: int, hard: int, nofile: int) -> None:
    """:class:`Unsupported` if the action script wrote that it could not lower a limit
    (prlimit refused: the host's root may lack ``CAP_SYS_RESOURCE``); else nothing."""
    try:
        said = errors.read_text(errors="replace")[:_MAX_SAID].strip()
    except OSError:
        return
    if not said:
        return
    raise Unsupported(
        f"the restored processes' open files limit ({hard}, the checkpoint's) could not be "
        f"lowered to this sandbox's open_files ({nofile}): prlimit said {said!r}. The "
        "host's root may lack CAP_SYS_RESOURCE: restore with open_files at least "
        f"{hard} (or leave it unset), or run the daemon with CAP_SYS_RESOURCE; the "
        "sandbox was ended",
        details={"cause": "open_files_not_lowered", "pid": pid, "open_files": nofile,
                 "checkpoint_open_files": hard})


def _nofile_hard(pid: int) -> int:
    """The hard open files limit of host pid ``pid`` (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[4])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _caps_mask(names: tuple[str, ...]) -> int:
    """The bit mask of capability names (``CAP_CHOWN``...), as /proc/PID/status shows."""
    mask = 0
    for name in names:
        mask |= 1 << _CAP_BITS[name]
    return mask


_CAP_BITS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3,
             "CAP_FSETID": 4, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7,
             "CAP_NET_BIND_SERVICE": 10}
