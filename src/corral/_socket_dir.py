"""Whether a Unix socket's directory lets other users swap the socket (shared by the
daemon, which binds it, and the SDK, which starts the embedded daemon there).

A Unix socket speaks plain HTTP: its path is all that says who answers. Whoever may
write the directory it is in (its owner, or anyone when it is group- or world-writable
without the sticky bit) may rename the daemon's socket away and put one of their own in
its place, or plant a symlink where the SDK writes its lock and log files. So both
refuse a directory owned by another user, or writable by others and not sticky (a
sticky directory such as /tmp lets no one rename or remove another's file).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["unsafe_socket_dir"]


def unsafe_socket_dir(socket_path: str | os.PathLike[str]) -> str | None:
    """Why other users could replace a socket at ``socket_path`` (its directory's owner
    or mode), or ``None`` when only root and this user can (or it does not exist yet)."""
    parent = Path(socket_path).absolute().parent
    try:
        st = parent.stat()
    except OSError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (0, os.geteuid()):
        return f"its directory {parent} belongs to uid {st.st_uid}, another user"
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return f"its directory {parent} may be written by other users (mode {mode:o})"
    return None
