"""A sandbox's ``secrets=``, kept for the next engine: ``STATE/secrets/<sandbox id>``.

The registry keeps a sandbox's spec with its secrets masked (``SecretStr``): the
listing, the API and the registry's file never hold them in clear. A sandbox that
outlives its engine (adopted after a restart, or hibernated and resumed later:
:mod:`.engine_restore`, :mod:`.engine_hibernate`) must still give its new commands
the real values, so they are written here as well, and nowhere else:

- the directory is root's alone (0700), each file 0600, created with its mode (no
  moment when it is more open), atomically (a temporary name, fsync, rename), never
  through a symlink;
- one file per sandbox, holding its secrets only (a JSON object of names to values);
  nothing for a sandbox without secrets;
- removed when the sandbox ends or is deleted, and at an engine's start for every
  sandbox it did not take over (:meth:`SecretStore.sweep`).

Snapshots never carry them (a sandbox made from one has none, as before); a live
checkpoint's process images hold the sandbox's memory, its environment included, and
are root-only for that reason (:mod:`.checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

__all__ = ["SecretStore"]

_TMP = ".tmp-"
_O_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class SecretStore:
    """``root``: a directory under the state directory, made root-only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, exist_ok=True)
        st = root.lstat()
        if root.is_symlink() or st.st_uid != os.geteuid():
            raise PermissionError(f"{root} is not a directory of this engine's")
        os.chmod(root, 0o700)
        # the sandboxes that have a file here (written by this store, or found at its
        # start): an end or delete of any other removes nothing (two a delete, on the
        # event loop)
        self._held = {name for name in os.listdir(root) if not name.startswith(_TMP)}

    def _path(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise ValueError(f"not a sandbox id: {sandbox_id!r}")
        return self.root / sandbox_id

    def put(self, sandbox_id: str, values: dict[str, str]) -> None:
        """Keep ``values`` (names to values, in clear) for ``sandbox_id``; none: remove."""
        if not values:
            self.remove(sandbox_id)
            return
        path = self._path(sandbox_id)
        tmp = self.root / f"{_TMP}{sandbox_id}-{secrets.token_hex(4)}"
        fd = os.open(tmp, _O_FLAGS, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(values, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._held.add(sandbox_id)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, sandbox_id: str) -> dict[str, str]:
        """The secrets kept for ``sandbox_id``; none if there are none (or they are
        unreadable: a damaged file gives the sandbox's commands no secrets, never an
        error that ends it)."""
        try:
            fd = os.open(self._path(sandbox_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, ValueError):
            return {}
        try:
            with os.fdopen(fd) as f:
                values = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(values, dict):
            return {}
        return {k: v for k, v in values.items() if isinstance(k, str) and isinstance(v, str)}

    def remove(self, sandbox_id: str) -> None:
        if sandbox_id not in self._held:
            return
        try:
            self._path(sandbox_id).unlink()
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            return  # kept: a later remove, or the next start's sweep, tries again
        self._held.discard(sandbox_id)

    def sweep(self, keep: Callable[[str], bool]) -> list[str]:
        """Remove every file but those of sandboxes ``keep`` says still live (a crash
        mid-write leaves a temporary one). Returns the names removed."""
        removed = []
        for name in os.listdir(self.root):
            if name.startswith(_TMP) or not keep(name):
                with contextlib.suppress(OSError):
                    (self.root / name).unlink()
                self._held.discard(name)
                removed.append(name)
        return removed
