"""Whether a Unix socket's directory lets other users swap the socket (shared by the
daemon, which binds it, and the SDK, which starts the embedded daemon there).

A Unix socket speaks plain HTTP: its path is all that says who answers. Whoever may
write the directory it is in, or any directory above it (its owner, or anyone when it
is group- or world-writable without the sticky bit), may rename the daemon's socket (or
a directory holding it) away and put one of their own in its place, or plant a symlink
where the SDK writes its lock and log files. So both refuse a path through a directory
owned by another user, or writable by others and not sticky (a sticky directory such as
/tmp lets no one rename or remove another's file).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["unsafe_socket_dir"]


def unsafe_socket_dir(socket_path: str | os.PathLike[str]) -> str | None:
    """Why other users could replace a socket at ``socket_path`` (the owner or mode of
    its directory or of any directory above it, as written or with symlinks resolved:
    whoever may rename an ancestor swaps the whole path), or ``None`` when only root and
    this user can (directories that do not exist yet are skipped)."""
    parent = Path(socket_path).absolute().parent
    for chain in (parent, Path(os.path.realpath(parent))):
        for d in (chain, *chain.parents):
            try:
                st = d.stat()
            except OSError:
                continue
            mode = stat.S_IMODE(st.st_mode)
            if st.st_uid not in (0, os.geteuid()):
                return f"the directory {d} belongs to uid {st.st_uid}, another user"
            if mode & 0o022 and not mode & stat.S_ISVTX:
                return f"the directory {d} may be written by other users (mode {mode:o})"
    return None
