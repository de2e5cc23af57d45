"""Paths inside a sandbox, checked before they reach the agent."""

from __future__ import annotations

from corral.errors import InvalidArgument, PathOutsideSandbox


def resolve_path(workdir: str, path: str) -> str:
    """Make ``path`` absolute (relative to ``workdir``) and normal.

    ``..`` that would climb above ``/`` is refused rather than silently clamped: a
    caller writing ``../../etc/passwd`` meant something other than what they would
    get. Symlinks need no check here: the agent resolves them inside the sandbox's
    own mount namespace, where nothing of the host exists to reach.
    """
    if not isinstance(path, str) or not path:
        raise InvalidArgument("a path must be a non-empty string")
    if "\0" in path:
        raise InvalidArgument("a path may not contain NUL bytes")
    full = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    parts: list[str] = []
    for part in full.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise PathOutsideSandbox(
                    f"path {path!r} climbs above the sandbox's root directory: "
                    "use a path inside the sandbox, e.g. /workspace/file.txt",
                    details={"path": path},
                )
            parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)
