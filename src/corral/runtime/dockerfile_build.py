"""Running a parsed Dockerfile (:mod:`.dockerfile`): its stages built in order.

Each stage is one :class:`~corral.runtime.image_build.ImageBuild` whose base is the
stage's ``FROM`` (pulled first when it is a registry reference); earlier stages become
images named ``<name>.stage<N>`` (kept, so that their steps stay cached), the last (or
``target``) is the image ``name``. What a ``COPY``/``ADD`` takes is put where the build
reads it: a path of the context (never outside it), a tar archive unpacked with the
OCI import's rules (:func:`corral.runtime.oci_layers.apply_layer`), or files exported from an
earlier stage or another image through a sandbox of it (as root of its user namespace,
so that root's files are readable; bounded by :data:`MAX_EXPORT_BYTES`).

Example::

    result = await build_dockerfile(engine, Path("task"), name="task")
    result.image.workdir, result.stats.built
"""

from __future__ import annotations

import asyncio
import bz2
import gzip
import lzma
import os
import posixpath
import shlex
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from corral.errors import (
    CorralError,
    DockerfileError,
    FileNotFound,
    ImageBuildError,
    ImageImportError,
    InvalidArgument,
)
from corral.image_schema import BuildEvent, BuildStats, relative_copy_source
from corral.runtime.distribution import is_reference
from corral.runtime.dockerfile import Source, Stage, parse_dockerfile
from corral.runtime.fsutil import _remove_tree
from corral.runtime.image_build import BUILD_TAG, BuildResult, ImageBuild, host_cpus
from corral.runtime.image_pull import SCRATCH, ensure_scratch, pull_image
from corral.runtime.layer_codec import copy_bounded, expansion_limit
from corral.runtime.oci_layers import apply_layer
from corral.runtime.ownership import UNSET, OwnerArg
from corral.schema import NetworkMode, SandboxSpec

MAX_EXPORT_BYTES = 4 << 30
OnEvent = Callable[[BuildEvent], Any]


def stage_name(name: str, index: int) -> str:
    return f"{name[:50]}.stage{index}"


async def build_dockerfile(
    engine: Any, context: Path, *, name: str, dockerfile: str | None = None,
    text: str | None = None, build_args: dict[str, str] | None = None,
    target: str | None = None, on_event: OnEvent | None = None,
    cpus: float | None = None, host_network: bool = True, owner: OwnerArg = UNSET,
) -> BuildResult:
    """Build the Dockerfile ``text`` (else the file ``dockerfile``, default
    ``context/Dockerfile``) into the image ``name`` for ``owner`` (whose build cache and
    sandboxes it uses); ``target`` stops at that stage."""
    acting: str | None = engine.owners.of(owner)
    context = Path(context)
    if text is None:
        path = context / (dockerfile or "Dockerfile")
        try:
            text = await asyncio.to_thread(path.read_text)
        except OSError as exc:
            raise InvalidArgument(f"cannot read the Dockerfile {path}: {exc.strerror}",
                                  details={"path": str(path)}) from None
    stages = await asyncio.to_thread(parse_dockerfile, text, build_args, context)
    last = len(stages) - 1
    if target is not None:
        found = [s.index for s in stages if s.alias == target.lower()]
        if not found:
            raise DockerfileError(f"no stage named {target!r} in the Dockerfile",
                                  details={"target": target})
        last = found[0]
    names: dict[int, str] = {}
    cached = built = steps = 0
    seconds = 0.0
    result: BuildResult | None = None
    for stage in stages[:last + 1]:
        names[stage.index] = name if stage.index == last else stage_name(name, stage.index)
        if on_event is not None:
            on_event(BuildEvent(type="log", line=f"stage {stage.index + 1}/{last + 1}: "
                                f"FROM {stage.base} -> {names[stage.index]}"))
        result = await _build_stage(engine, stage, names, context, on_event,
                                    cpus=cpus, host_network=host_network, owner=acting)
        cached += result.stats.cached
        built += result.stats.built
        steps += result.stats.steps
        seconds += result.stats.seconds
    assert result is not None
    return BuildResult(result.image, BuildStats(steps=steps, cached=cached, built=built,
                                                seconds=round(seconds, 3)))


async def _build_stage(engine: Any, stage: Stage, names: dict[int, str], context: Path,
                       on_event: OnEvent | None, *, cpus: float | None,
                       host_network: bool, owner: str | None) -> BuildResult:
    base = await _base(engine, stage.base, names)
    steps = list(stage.steps)
    workdir = engine.images.get(base).workdir
    shift = 0
    if workdir and workdir != "/" and any("run" in s for s in steps):
        # the base's WorkingDir may be missing from its files (Docker makes it): made
        # before the first step that runs there
        made = [{"workdir": "/"}, {"run": f"mkdir -p {shlex.quote(workdir)}", "user": "root"},
                {"workdir": workdir}]
        steps[:0] = made
        shift = len(made)
    if not any("run" in s or "copy" in s for s in steps):
        # nothing changes files: the stage is its base with metadata
        steps.append({"run": "true", "user": "root"})
    work = await asyncio.to_thread(engine.images.work_dir, "dockerfile")
    try:
        sources: dict[int, str] = {}
        for i, src in stage.sources.items():
            path = await _source(engine, src, names, context, work / f"s{i}", owner)
            sources[i + shift + 1] = str(path)
        meta = {k: v for k, v in stage.meta.items() if not k.startswith("_")}
        build = ImageBuild(engine, {"base": base, "steps": steps}, name=names[stage.index],
                           context=context, sources=sources, cpus=cpus or host_cpus(),
                           host_network=host_network, meta=meta, owner=owner)
        return await build.run(on_event)
    finally:
        await asyncio.to_thread(_remove_tree, work)


async def _base(engine: Any, base: str, names: dict[int, str]) -> str:
    if base.startswith("stage:"):
        return names[int(base.split(":", 1)[1])]
    if base == SCRATCH:
        await asyncio.to_thread(ensure_scratch, engine.images)
        return SCRATCH
    if is_reference(base):
        image = await asyncio.to_thread(pull_image, engine.images, base, if_missing=True)
        return image.name
    return base


async def _source(engine: Any, src: Source, names: dict[int, str], context: Path,
                  work: Path, owner: str | None) -> Path:
    """The host path a copy step reads for ``src``."""
    if src.stage is not None or src.image is not None:
        image = names[src.stage] if src.stage is not None else await _base(
            engine, src.image or "", names)
        work.mkdir(mode=0o700)
        return await _export(engine, image, src.path, work, owner)
    rel = relative_copy_source(src.path.lstrip("/") if src.path.startswith("/") else src.path)
    path = context / rel
    real, root = os.path.realpath(path), os.path.realpath(context)
    if real != root and not real.startswith(root + os.sep):
        raise InvalidArgument(f"COPY source {src.path!r} leads outside the build context",
                              details={"src": src.path})
    if not os.path.lexists(path):
        raise InvalidArgument(f"COPY source {src.path!r} is not in the build context",
                              details={"src": src.path})
    if not src.unpack:
        return path
    work.mkdir(mode=0o700)
    await asyncio.to_thread(_unpack_tar, path, work)
    return work / "tree"


def _unpack_tar(archive: Path, work: Path) -> None:
    plain = work / "archive.tar"
    with open(archive, "rb") as f:
        head = f.read(6)
    opener = (gzip.open if head.startswith(b"\x1f\x8b") else bz2.open if head.startswith(b"BZh")
              else lzma.open if head.startswith(b"\xfd7zXZ") else open)
    with opener(archive, "rb") as fin, open(plain, "wb") as fout:
        try:  # bounded: a small bzip2 or xz of zeros expands to terabytes
            copy_bounded(fin, fout, expansion_limit(plain), f"ADD {archive.name}")
        except ImageImportError as exc:
            raise ImageBuildError(exc.message, details=exc.details) from None
    tree = work / "tree"
    tree.mkdir(mode=0o755)
    apply_layer(tree, plain)  # no path or link out of the tree, no device, no set-id bit
    plain.unlink()


async def _export(engine: Any, image: str, path: str, work: Path, owner: str | None) -> Path:
    """Copy ``path`` of ``image`` to ``work`` through a sandbox of it (``owner``'s); the
    copy's path (a file keeps its name, a directory's contents are ``work/tree``)."""
    spec = SandboxSpec(image=image, memory_mb=256, network=NetworkMode.NONE,
                       tags=[BUILD_TAG, f"export={image}"[:60]], tenant=owner)
    info = await engine.create(spec, build_root=True, owner=owner)
    budget = [MAX_EXPORT_BYTES]
    try:
        try:
            top = await engine.stat(info.id, path, owner=owner)
            if top.is_symlink:
                # The source itself a link: followed inside the image, as Docker does.
                # Exported as a link, the copy step would follow it on the host (as root:
                # a stage's ``ln -s /etc/shadow /x`` copied the host's file in).
                top = replace(top, is_symlink=False, mode=0o755,
                              is_dir=await _is_dir(engine, info.id, top.path, owner))
        except FileNotFound:
            raise ImageBuildError(f"COPY --from: {path} does not exist in {image}",
                                  details={"image": image, "path": path}) from None
        if top.is_dir:
            dest = work / "tree"
            dest.mkdir(mode=0o755)
            await _export_dir(engine, info.id, top.path, dest, budget, owner)
            return dest
        dest = work / (posixpath.basename(top.path.rstrip("/")) or "file")
        await _export_one(engine, info.id, top, dest, budget, owner)
        return dest
    finally:
        await engine.delete(info.id, owner=owner)


async def _is_dir(engine: Any, sid: str, path: str, owner: str | None) -> bool:
    """Whether ``path`` is (or links to) a directory in the sandbox; FileNotFound if it
    leads nowhere there."""
    try:
        await engine.list_dir(sid, path, owner=owner)
    except FileNotFound:
        raise
    except CorralError:  # ENOTDIR: a file
        return False
    return True


async def _export_dir(engine: Any, sid: str, path: str, dest: Path, budget: list[int],
                      owner: str | None) -> None:
    pending = [(path, dest)]
    while pending:  # iterative: a deep tree is no recursion
        here, there = pending.pop()
        for entry in await engine.list_dir(sid, here, owner=owner):
            target = there / entry.name
            if entry.is_dir and not entry.is_symlink:
                target.mkdir(mode=(entry.mode & 0o7777) | 0o700)
                pending.append((entry.path, target))
            else:
                await _export_one(engine, sid, entry, target, budget, owner)


async def _export_one(engine: Any, sid: str, entry: Any, dest: Path, budget: list[int],
                      owner: str | None) -> None:
    if entry.is_symlink:
        done = await engine.exec(sid, ["readlink", entry.path], owner=owner)
        if done.returncode == 0:
            os.symlink(done.stdout.decode().rstrip("\n"), dest)
        return
    budget[0] -= entry.size
    if budget[0] < 0:
        raise ImageBuildError(f"COPY --from copies more than {MAX_EXPORT_BYTES} bytes",
                              details={"path": entry.path})
    data = await engine.read_file(sid, entry.path, max_bytes=MAX_EXPORT_BYTES, owner=owner)
    budget[0] -= max(0, len(data) - entry.size)  # a followed link's size is its target's
    if budget[0] < 0:
        raise ImageBuildError(f"COPY --from copies more than {MAX_EXPORT_BYTES} bytes",
                              details={"path": entry.path})
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(dest, entry.mode & 0o777)
