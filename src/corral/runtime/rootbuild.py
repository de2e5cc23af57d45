"""Image build steps as root (``run: ...`` with ``user: root``), without host privilege.

A root step runs in a build sandbox like any other (:mod:`corral.runtime.image_build`),
with three differences:

* bubblewrap maps uid and gid 0 of the sandbox's user namespace to the sandbox's own
  host uid (:mod:`corral.runtime.uids`: unprivileged, used by nothing else), and the
  step keeps :data:`ROOT_CAPS` *in that namespace only*: enough for ``apt-get`` and
  ``dpkg`` (owners, modes, reading and writing root's files), not ``CAP_SYS_ADMIN``
  (no mounts), ``CAP_SYS_MODULE``, ``CAP_NET_ADMIN`` and the rest; the seccomp filter
  and ``--disable-userns`` are those of every sandbox. No other id is mapped: the
  step cannot act as, or ``chown`` to, the sandbox user (do that in a later step
  without ``user: root``) or any host id.
* the image's lower layers are idmapped so that their host-root-owned files are the
  sandbox's (``agent/launch.c``, ``--root-build``); the sandbox user's files (owned by
  :data:`~corral.runtime.uids.CANONICAL_UID`) are nobody's to it.
* what it wrote is committed owned by root (uid 0), like the base image's own files,
  with set-user-id and set-group-id bits and file capabilities removed
  (:func:`strip_privileges`): at run time a sandbox maps no root at all and mounts its
  layers ``nosuid`` (and bubblewrap sets ``no_new_privs``), so such a bit could give
  nothing anyway; stripping it keeps the layer store on the host free of them too.

apt needs four things besides: its download sandbox user ``_apt`` is not mapped, so
:data:`APT_CONF` (put read-only in the build sandbox, ``APT_CONFIG`` pointing at it)
sets ``APT::Sandbox::User "root"``; package sources: the host's Debian mirror for the
image's release, in a ``sources.list`` beside it (:func:`apt_files`); the network, which every ``run`` step has
(``network="host"``; sandboxes made from the image do not); and
``DEBIAN_FRONTEND=noninteractive``. Sandboxes from the built image run as the sandbox
user, as always: they cannot ``apt-get`` (root's files are read-only to them).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from corral.errors import CorralError
from corral.runtime import paths
from corral.runtime.debian import find_debian_mirror, host_codename
from corral.runtime.rootfs import AGENT_DIR
from corral.runtime.treecopy import NODE, Walk, fd_path

# Kept in the build sandbox's user namespace by a root step (bwrap --cap-add).
ROOT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER",
             "CAP_FSETID", "CAP_SETUID", "CAP_SETGID", "CAP_KILL")
APT_CONF_PATH = f"/{AGENT_DIR}/build/apt.conf"
APT_SOURCES_PATH = f"/{AGENT_DIR}/build/sources.list"
APT_CONF = f"""// corral: a build step as root (corral.runtime.rootbuild)
APT::Sandbox::User "root";
APT::Keep-Downloaded-Packages "false";
Dpkg::Use-Pty "0";
Acquire::Retries "3";
Dir::Etc::SourceList "{APT_SOURCES_PATH}";
""".encode()
_CAPS_XATTR = "security.capability"


def bwrap_identity() -> list[str]:
    """bubblewrap's options for a root step (in place of ``--uid 1000 ... --cap-drop
    ALL``)."""
    argv = ["--uid", "0", "--gid", "0", "--cap-drop", "ALL"]
    for cap in ROOT_CAPS:
        argv += ["--cap-add", cap]
    return argv


def step_env() -> dict[str, str]:
    """What a root step's command gets besides the image's env (never stored)."""
    return {"APT_CONFIG": APT_CONF_PATH, "DEBIAN_FRONTEND": "noninteractive",
            "HOME": "/root"}


def apt_files(images_dir: Path, rootfs: Path) -> list[tuple[str, str]]:
    """The ``ro_binds`` of a root step: :data:`APT_CONF`, and a ``sources.list`` naming
    the host's Debian mirror for the image's release (the host's business, as for the
    default image: never stored in the image, whose own list stays empty)."""
    sources = b"# no Debian mirror found on the host: add your own sources\n"
    with contextlib.suppress(CorralError, OSError):
        codename = host_codename(_os_release(rootfs))
        mirror = find_debian_mirror(codename)
        if not mirror.startswith("file:"):
            sources = f"deb {mirror} {codename} main\n".encode()
    return [(str(share_copy(images_dir, ".build-apt.conf", APT_CONF)), APT_CONF_PATH),
            # root-only on the host: a mirror URL may carry credentials (the launcher
            # copies it into the sandbox as root, before it drops its privileges)
            (str(share_copy(images_dir, ".build-apt-sources.list", sources, mode=0o600)),
             APT_SOURCES_PATH)]


def _os_release(rootfs: Path) -> Path:
    """The image's os-release file (not through an absolute link: that is the host's)."""
    for rel in ("usr/lib/os-release", "etc/os-release"):
        path = Path(rootfs) / rel
        if path.is_file() and not path.is_symlink():
            return path
    return Path(rootfs) / "usr/lib/os-release"


def share_copy(images_dir: Path, name: str, data: bytes, mode: int = 0o644) -> Path:
    """A file in the cache's ``share`` directory (``mode``: world-readable by default,
    for a bind by the unprivileged launcher), written atomically when it changed."""
    share = paths.share_dir(Path(images_dir).parent)
    share.mkdir(mode=0o711, exist_ok=True)
    copy = share / name
    with contextlib.suppress(OSError):
        if copy.read_bytes() == data and stat.S_IMODE(copy.stat().st_mode) == mode:
            return copy
    tmp = copy.with_name(f"{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.rename(tmp, copy)
    return copy


def strip_privileges(tree: Path) -> int:
    """Remove set-user-id and set-group-id bits from the regular files under ``tree``
    (a staged layer) and their file capabilities; the number of files changed.
    Iterative and descriptor-relative: a build step may make its tree thousands of
    levels deep (os.walk recursed past Python's limit: the build was a 500)."""
    changed = 0
    for event, parent, name, st, _fd in Walk(tree, max_depth=None):
        if event != NODE or not stat.S_ISREG(st.st_mode):
            continue
        touched = False
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(name, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID),
                     dir_fd=parent)
            touched = True
        with contextlib.suppress(OSError):  # ENODATA: it has none
            os.removexattr(fd_path(parent, name), _CAPS_XATTR, follow_symlinks=False)
            touched = True
        changed += touched
    return changed
