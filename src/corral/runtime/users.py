"""Who a command runs as: the sandbox user (uid 1000) or the sandbox's root (uid 0).

A sandbox's user namespace maps exactly two ids (``agent/launch.c``): 1000, the
sandbox user, to the sandbox's host uid, and 0, its root, to the odd host uid after
it (:func:`corral.runtime.uids.root_uid`) — both unprivileged on the host and used by
no other sandbox. The agent runs as 1000 and holds :data:`ROOT_CAPS` in its permitted
set only; a command asked to run as root gets uid/gid 0 and those capabilities *in the
sandbox's user namespace* (``agent/exec.c``), with no_new_privs and the seccomp filter
of every command. See docs/users.md for what root in a sandbox can and cannot do.

A command's user comes from, in order: the call (``exec(..., user="root")``, E2B's
``user=``, Harbor's ``user=``), the image (Dockerfile ``USER``, an OCI config's
``User``), else the sandbox user. A name is looked up in the image's ``/etc/passwd``
(``root``, ``sandbox`` and ``user`` are always known); a uid other than 0 and 1000
cannot run: :class:`~corral.errors.InvalidArgument` says which two can.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from corral.errors import InvalidArgument
from corral.runtime.uids import SANDBOX_HOME, SANDBOX_UID

if TYPE_CHECKING:
    from corral.runtime.images import Image

log = logging.getLogger("corral.runtime")

ROOT_UID = 0
# What root keeps in the sandbox's user namespace: Docker's default set less what
# reaches the kernel's attack surface or devices (MKNOD, NET_RAW, SETFCAP, SETPCAP,
# SYS_CHROOT, AUDIT_WRITE). No SYS_ADMIN (mounts), SYS_PTRACE (the agent and other
# commands' memory), NET_ADMIN, SYS_MODULE, SYS_RESOURCE (limits).
ROOT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER",
             "CAP_FSETID", "CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_NET_BIND_SERVICE")
_KNOWN = {"root": ROOT_UID, "0": ROOT_UID, "sandbox": SANDBOX_UID, "user": SANDBOX_UID,
          str(SANDBOX_UID): SANDBOX_UID, "": SANDBOX_UID}


def bwrap_identity() -> list[str]:
    """bubblewrap's options for a sandbox: enter the user namespace the launcher made
    (``@USERNS@``: its descriptor), run the agent as the sandbox user, keep root's
    capabilities for the agent to hand on (it keeps them permitted only)."""
    argv = ["--userns", "@USERNS@", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--cap-drop", "ALL"]
    for cap in ROOT_CAPS:
        argv += ["--cap-add", cap]
    return argv


def resolve(user: str | int | None, lowers: Sequence[Path] = ()) -> int:
    """The uid ``user`` names (``"root"``, ``"0"``, ``"1000:1000"``, a name from the
    image's ``/etc/passwd`` found in ``lowers``, top first); 1000 for ``None``."""
    if user is None:
        return SANDBOX_UID
    text = str(user).strip()
    name = text.split(":", 1)[0]  # USER name:group: the group follows the user
    uid = _KNOWN.get(name)
    if uid is None and name.isdecimal():
        uid = int(name)
    if uid is None:
        uid = _passwd_uid(name, lowers)
    if uid not in (ROOT_UID, SANDBOX_UID):
        raise InvalidArgument(
            f"user {text!r} " + ("is not in the image's /etc/passwd" if uid is None else
                                 f"is uid {uid}") +
            f": a sandbox runs commands as root (uid 0) or as the sandbox user (uid "
            f"{SANDBOX_UID}) only; use one of them (docs/users.md)")
    return uid


def image_default(image: Image) -> int | None:
    """The uid an image's ``USER`` names (``None``: it names none). One a sandbox cannot
    map (``USER app`` as uid 1001) falls back to the sandbox user, with a warning: the
    image still runs, as a caller naming that user explicitly would be told."""
    if not image.user:
        return None
    try:
        return resolve(image.user, image.lowers)
    except InvalidArgument as exc:
        log.warning("image %s: %s; its commands run as the sandbox user", image.name, exc)
        return SANDBOX_UID


def entrypoint_argv(image: Image) -> list[str]:
    """What Docker would run for the image: ``ENTRYPOINT`` + ``CMD`` (``CMD`` alone if
    there is no entrypoint), or :class:`~corral.errors.InvalidArgument`."""
    argv = [*image.entrypoint, *image.cmd]
    if not argv:
        raise InvalidArgument(
            f"image {image.name!r} has no ENTRYPOINT or CMD: leave out run_entrypoint, "
            "or start a command with exec/spawn")
    return argv


def user_env(uid: int) -> dict[str, str]:
    """``HOME``, ``USER`` and ``LOGNAME`` for a command running as ``uid``."""
    if uid == ROOT_UID:
        return {"HOME": "/root", "USER": "root", "LOGNAME": "root"}
    return {"HOME": SANDBOX_HOME, "USER": "sandbox", "LOGNAME": "sandbox"}


def _passwd_uid(name: str, lowers: Sequence[Path]) -> int | None:
    """``name``'s uid in the topmost ``etc/passwd`` of the layers (not through a link:
    an absolute one would be the host's)."""
    for layer in lowers:
        path = Path(layer) / "etc" / "passwd"
        if path.is_symlink() or not path.is_file():
            continue
        with contextlib.suppress(OSError, ValueError):
            with open(path, "rb") as f:
                for line in f.read(1 << 20).decode(errors="replace").splitlines():
                    parts = line.split(":")
                    if len(parts) >= 3 and parts[0] == name:
                        return int(parts[2])
        return None
    return None
