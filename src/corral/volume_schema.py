"""Volumes as the SDK and the daemon both see them: a volume's description, and what a
sandbox spec's ``volumes={"/data": "NAME[:MODE]"}`` may say (see
:mod:`corral.runtime.volumes` and docs/network.md)."""

from __future__ import annotations

import re

from corral._model import Model

__all__ = ["MAX_VOLUMES", "MODES", "VOLUME_NAME_RE", "VolumeInfo", "check_volumes", "parse_mount"]

VOLUME_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
MODES = ("cow", "ro", "rw")  # cow: the default
MAX_VOLUMES = 16  # per sandbox
_RESERVED = ("/proc", "/dev", "/sys", "/.corral", "/etc", "/tmp")


class VolumeInfo(Model):
    name: str
    size_bytes: int
    files: int
    created_at: float
    max_mb: int | None = None  # a size limit (MiB): rw writers share at most this
    home: str | None = None  # on a cluster: the node this is a copy of (None: made here)


def parse_mount(value: str) -> tuple[str, str]:
    """``"NAME"``, ``"NAME:MODE"`` or (admins) ``"/host/dir[:MODE]"`` → (source, mode)."""
    source, _, mode = value.rpartition(":") if value.count(":") else (value, "", "cow")
    if not source:
        source, mode = value, "cow"
    if mode not in MODES:
        raise ValueError(f"invalid volume mode {mode!r} in {value!r}: use one of "
                         f"{', '.join(MODES)}, e.g. 'data:ro'")
    if source.startswith("/"):
        if "\0" in source or ".." in source.split("/") or ":" in source:
            raise ValueError(f"invalid host directory {source!r}: an absolute path without '..'")
    elif not VOLUME_NAME_RE.fullmatch(source):
        raise ValueError(f"invalid volume name {source!r}: use 1-63 lower-case letters, "
                         "digits, '.', '_' or '-' (no '/', no '..')")
    return source, mode


def check_volumes(volumes: dict[str, str]) -> dict[str, str]:
    if len(volumes) > MAX_VOLUMES:
        raise ValueError(f"at most {MAX_VOLUMES} volumes per sandbox")
    for dest, value in volumes.items():
        parts = dest.split("/")
        if (not dest.startswith("/") or dest == "/" or "\0" in dest or ":" in dest
                or ".." in parts or "." in parts or len(dest) > 1024
                or any(dest == r or dest.startswith(r + "/") for r in _RESERVED)):
            raise ValueError(f"invalid volume mount point {dest!r}: an absolute path without "
                             "'..' or ':', not / nor under /proc, /dev, /sys, /etc, /tmp")
        parse_mount(value)
    dests = sorted(d.rstrip("/") for d in volumes)
    for a, b in zip(dests, dests[1:], strict=False):
        if b.startswith(a + "/"):
            raise ValueError(f"volume mount points {a!r} and {b!r} are nested: use apart ones")
    return {d.rstrip("/"): v for d, v in volumes.items()}
