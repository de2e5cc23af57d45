"""Turning a build spec and the files its ``copy`` steps name into a build request.

Blocking file work, shared by the asyncio and blocking clients (which call it through
``AsyncBackend.run_blocking``). The daemon may be on another machine and never reads
its own files for a client, so what ``copy`` steps name is sent along: a tar holding
``build.json`` (the request; ``sources`` says where each ``copy`` source went:
``s<step>[/<file name>]``) and ``context/`` (those sources). A spec without ``copy``
steps goes as plain JSON.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument
from corral.image_schema import BuildSpec, CopyStep, read_build_spec

TAR = "application/x-tar"
JSON = "application/json"


def load_spec(spec: Any, context: str | os.PathLike[str] | None) -> tuple[BuildSpec, Path]:
    """The spec, and the directory its relative ``copy`` sources start from: the given
    ``context``, else the spec file's directory, else the current directory."""
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        return read_build_spec(path), Path(context) if context is not None else path.parent
    return BuildSpec.parse(spec), Path(context) if context is not None else Path.cwd()


def pack_build(spec: BuildSpec, name: str | None, context: Path) -> tuple[str, bytes]:
    """``(content type, body)`` of ``POST /v1/images/build``."""
    steps = spec.model_dump(mode="json")["steps"]
    sources: dict[str, str] = {}
    copies = [i for i, s in enumerate(spec.steps) if isinstance(s, CopyStep)]
    if not copies:
        return JSON, json.dumps({"spec": spec.model_dump(mode="json"), "name": name}).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in copies:
            src = steps[i]["copy"]["src"]
            path = Path(src) if Path(src).is_absolute() else context / src
            if not os.path.exists(path):
                raise InvalidArgument(f"copy source {src!r} does not exist ({path})",
                                      details={"src": src})
            real = Path(os.path.realpath(path))  # a link given as the source is followed
            if real.is_dir():
                sent = f"s{i}"
            else:
                sent = f"s{i}/{path.name}"  # kept: a destination ending in / takes it
            tar.add(real, arcname=f"context/{sent}", recursive=True)
            sources[str(i + 1)] = sent
        request = {"spec": spec.model_dump(mode="json"), "name": name, "sources": sources}
        data = json.dumps(request).encode()
        info = tarfile.TarInfo("build.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return TAR, buf.getvalue()


def read_archive(path: str | os.PathLike[str]) -> bytes:
    """An image archive's bytes: a file as is, an OCI layout directory as a tar."""
    path = Path(path)
    if path.is_dir():
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for entry in sorted(path.iterdir()):
                tar.add(entry, arcname=entry.name, recursive=True)
        return buf.getvalue()
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the image archive {path}: {exc.strerror}",
                              details={"path": str(path)}) from None


# ------------------------------------------------------------------ Dockerfiles

DOCKERFILE_MEMBER = "dockerfile.json"


def pack_dockerfile(context: str | os.PathLike[str], dockerfile: str | os.PathLike[str] | None,
                    name: str | None, build_args: dict[str, str] | None,
                    target: str | None) -> tuple[str, bytes]:
    """``(content type, body)`` of ``POST /v1/images/dockerfile``: the Dockerfile's text
    and the context, less what its ``.dockerignore`` excludes."""
    root = Path(context)
    if not root.is_dir():
        raise InvalidArgument(f"the build context {root} is not a directory",
                              details={"path": str(root)})
    path = Path(dockerfile) if dockerfile is not None else root / "Dockerfile"
    if not path.is_absolute() and dockerfile is not None and not path.exists():
        path = root / path
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the Dockerfile {path}: {exc.strerror}",
                              details={"path": str(path)}) from None
    if name is None:
        slug = re.sub(r"[^a-z0-9._-]+", "-", os.path.basename(os.path.realpath(root)).lower())
        name = slug.strip("-._")[:64] or "image"
    ignore = _ignore_patterns(root / ".dockerignore")
    request = {"dockerfile": text, "name": name, "build_args": dict(build_args or {}),
               "target": target}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for entry in sorted(dirnames + filenames):
                full = os.path.join(dirpath, entry)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                if _ignored(rel, ignore):
                    continue
                tar.add(full, arcname=f"context/{rel}", recursive=False)
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        data = json.dumps(request).encode()
        info = tarfile.TarInfo(DOCKERFILE_MEMBER)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return TAR, buf.getvalue()


def _ignore_patterns(path: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """``.dockerignore`` as ``(exclude?, regex)`` in order (a later match wins)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line[1:].strip() if keep else line
        pattern = os.path.normpath(pattern).lstrip("/").replace(os.sep, "/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                regex += ".*"
                i += 2
                if pattern.startswith("/", i):  # **/x: x at any depth, the top included
                    i += 1
                    regex = regex[:-2] + "(?:.*/)?"
                continue
            c = pattern[i]
            regex += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
            i += 1
        out.append((not keep, re.compile(regex + "(?:/.*)?")))
    return out


def _ignored(rel: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether ``rel`` (or a directory above it) is excluded; Dockerfile-relevant files
    (``.dockerignore``, the Dockerfile) go too: the daemon reads the text sent."""
    excluded = False
    for exclude, regex in patterns:
        if regex.fullmatch(rel):
            excluded = exclude
    return excluded
