"""Declarative image builds: a base image plus steps, cached step by step like Docker's.

Each step that changes files (``run``, ``copy``) runs in a real sandbox started on the
base image plus the layers of the steps before it; what it wrote (the sandbox's
writable layer) is committed as a layer of the host-wide image layer store
(:mod:`corral.runtime.image_cache`, the format of :mod:`corral.runtime.layers`).
``env`` and ``workdir`` steps change no file: they set what later steps, and
sandboxes made from the image, get by default.

Caching: a step's key is the sha256 of its parent's key and the step itself (for
``copy``, of the copied files' names, modes and contents too); the parent of the first
step is the base image's digest (and a tenant's name: a tenant may exec in its own
step's sandbox, so what its builds cache serves its builds only), and after a layer step the chain continues from the
layer's digest, so a step rebuilt with a different result invalidates those after it.
Rebuilding an unchanged spec finds every key and runs nothing; changing step k runs
k and what follows. A failed step leaves no sandbox and no layer; the steps before it
stay cached (fix the step, build again, and only it onwards runs).

Steps run as the sandbox user: ``pip install`` goes to the user site (``~/.local``),
which sandboxes from the image import from. A ``run`` step with ``user: root`` runs as
root of the build sandbox's user namespace (``apt-get install``; no host privilege:
:mod:`corral.runtime.rootbuild`), and what it writes is root's in the image. Only ``run`` steps have the
network (``network="host"``; a tenant's only where its sandboxes may have it too,
``--allow-host-network``, else none), with the host's CA bundle mounted read-only at
:data:`BUILD_CA_PATH` (the host may reach package indexes through a TLS-intercepting
proxy) and ``SSL_CERT_FILE``/``PIP_CERT``/``REQUESTS_CA_BUNDLE`` pointing at it.

Environment variables (read here, and passed to ``run`` steps when set, except values
that are ``file:`` URLs, which mean nothing inside a sandbox): ``HTTP_PROXY``,
``HTTPS_PROXY``, ``NO_PROXY`` (and their lower-case forms), ``PIP_INDEX_URL``,
``PIP_EXTRA_INDEX_URL``, ``PIP_TRUSTED_HOST``; ``SSL_CERT_FILE`` names the CA bundle
(default: :func:`ssl.get_default_verify_paths`).

Example::

    result = await build_image(engine, {"base": "python", "steps": [
        {"run": "pip install six==1.16.0"}, {"env": {"MODE": "fast"}}]}, name="six")
    result.image.name, result.stats.cached, result.stats.built      # "six", 0, 1
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import posixpath
import ssl
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.errors import FileError, ImageBuildError, InvalidArgument
from corral.image_schema import (
    BuildEvent,
    BuildSpec,
    BuildStats,
    CopyStep,
    EnvStep,
    RunStep,
    WorkdirStep,
    read_build_spec,
    relative_copy_source,
    validate_image_name,
)
from corral.runtime import image_cache, rootbuild
from corral.runtime.cgroups import Cgroup
from corral.runtime.image_cache import CacheEntry
from corral.runtime.images import Image
from corral.runtime.layers import LayerStore
from corral.runtime.ownership import UNSET, OwnerArg
from corral.runtime.rootfs import AGENT_DIR
from corral.runtime.storage import room_above_reserve
from corral.runtime.treecopy import Budget, listings
from corral.schema import DEFAULT_WORKDIR, NetworkMode, SandboxSpec

if TYPE_CHECKING:
    from corral.runtime.engine import Engine

BUILD_CA_PATH = f"/{AGENT_DIR}/build/ca-certificates.crt"
BUILD_PIDS = 4096
BUILD_INODES = 1 << 20  # files a step may write (pip installs of large packages)
BUILD_TAG = "corral-build"
MAX_STEP_OUTPUT = 64 << 20
MAX_COPY_PATH = 4095  # bytes of a copied file's path in the sandbox (Linux's PATH_MAX)
MAX_COPY_DEPTH = 256  # levels of directories in a copy source (docs/images.md)
TAIL_LINES = 40
TAIL_CHARS = 8000
_KEY_FORMAT = b"corral-build-1\n"
_CA_COPY = ".build-ca.pem"
_PASSTHROUGH = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
                "no_proxy", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")

OnEvent = Callable[[BuildEvent], Any]


@dataclass(frozen=True)
class BuildResult:
    """The image built (or found unchanged) and what the build did."""

    image: Image
    stats: BuildStats


async def build_image(
    engine: Engine, spec: BuildSpec | dict[str, Any] | str | os.PathLike[str], *,
    name: str | None = None, context: str | os.PathLike[str] | None = None,
    on_event: OnEvent | None = None, context_only: bool = False, owner: OwnerArg = UNSET,
) -> BuildResult:
    """Build ``spec`` (a :class:`BuildSpec`, a dict, or the path of a YAML file) into the
    image ``name`` (else the spec's ``name``), replacing an image of that name.

    ``copy`` sources are relative to ``context`` (default: the spec file's directory);
    with ``context_only`` (the daemon, building what a client sent) they must stay
    inside it. ``on_event`` gets each :class:`BuildEvent` (steps, output lines).
    Raises :class:`ImageBuildError` naming the failed step, with its output.
    """
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        spec = read_build_spec(path)
        context = path.parent if context is None else context
    build = ImageBuild(engine, spec, name=name, context=context, context_only=context_only,
                       owner=owner)
    return await build.run(on_event)


class ImageBuild:
    """One build, checked when made (bad spec, unknown base image, missing ``copy``
    sources: errors before any work), run by :meth:`run`."""

    def __init__(self, engine: Engine, spec: BuildSpec | dict[str, Any], *,
                 name: str | None = None, context: str | os.PathLike[str] | None = None,
                 context_only: bool = False, sources: dict[int, str] | None = None,
                 cpus: float | None = None, host_network: bool = True,
                 meta: dict[str, Any] | None = None, owner: OwnerArg = UNSET) -> None:
        self.spec = spec = BuildSpec.parse(spec)
        # what a Dockerfile records besides files (user, cmd, entrypoint, labels, ports)
        self.meta = dict(meta or {})
        # run steps' network: the host's, unless the caller may not have it (a tenant on
        # a daemon without --allow-host-network): then none, as its sandboxes
        self.host_network = host_network
        # whose build cache it reads and fills: a tenant can exec in its own step's
        # sandbox and plant files in the layer, so its entries serve its builds only
        self.owner = engine.owners.of(owner)
        name = name or spec.name
        if not name:
            raise InvalidArgument("the image needs a name: pass name= or set name: in the spec")
        self.name = validate_image_name(name)
        self.engine = engine
        self.store = engine.images
        self.context = None if context is None else Path(context)
        self.context_only = context_only
        self.cpus = cpus or host_cpus()  # each step's sandbox (a tenant's: its max_cpus)
        self.on_event: OnEvent | None = None
        self.base = self.store.get(spec.base)
        self.sources = {i: self._copy_source(s, (sources or {}).get(i + 1))
                        for i, s in enumerate(spec.steps) if isinstance(s, CopyStep)}
        self.layers: LayerStore = image_cache.layer_store(self.store.images_dir)
        self.cached = 0
        self.built = 0
        self.replaced = False

    def emit(self, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(BuildEvent(**fields))

    async def run(self, on_event: OnEvent | None = None) -> BuildResult:
        """Build; ``on_event`` gets each :class:`BuildEvent` (steps, output lines)."""
        self.on_event = on_event
        started = time.monotonic()
        spec, images_dir, base, sources = self.spec, self.store.images_dir, self.base, self.sources
        base_layers = self.store.manifest(base.name).get("layers", []) if base.layers else []
        await asyncio.to_thread(image_cache.clean_stale_layers, images_dir)
        lock = await asyncio.to_thread(image_cache.hold_build_lock, images_dir)
        try:
            env, workdir = dict(base.env), base.workdir
            parent = _hash(_KEY_FORMAT, base.digest.encode(), *(
                () if self.owner is None else (b"tenant\0" + self.owner.encode(),)))
            made: list[CacheEntry] = []  # bottom first
            keys: list[str] = []
            for i, step in enumerate(spec.steps):
                text = step.describe()
                canonical = json.dumps(step.model_dump(mode="json", exclude_none=True),
                                       sort_keys=True).encode()
                if isinstance(step, (EnvStep, WorkdirStep)):
                    if isinstance(step, EnvStep):
                        env.update(step.env)
                    else:
                        workdir = step.workdir
                    parent = _hash(parent.encode(), canonical)
                    self.emit(type="step", step=i + 1, total=len(spec.steps), instruction=text)
                    continue
                if isinstance(step, CopyStep):
                    # By what is copied where, not by the source's path on some host
                    source, dest = sources[i], step.source.dest
                    content = (await asyncio.to_thread(_scan_source, source))[1]
                    kept = source.name if dest.endswith("/") and source.is_file() else None
                    canonical = json.dumps({"copy": {"dest": dest, "name": kept,
                                                     "content": content},
                                            **({"user": "root"} if step.as_root else {})
                                            }).encode()
                key = _hash(parent.encode(), canonical)
                entry = image_cache.cache_get(images_dir, key)
                self.emit(type="step", step=i + 1, total=len(spec.steps), instruction=text,
                          cached=entry is not None)
                if entry is None:
                    chain = Image(
                        name=base.name, rootfs=base.rootfs, digest="", created_at=0,
                        size_bytes=0, python=base.python,
                        layers=tuple(self.layers.path(e.layer_id) for e in reversed(made))
                        + base.layers)
                    entry = await self._run_step(i, step, key, chain, env,
                                                 workdir or DEFAULT_WORKDIR, sources.get(i))
                    self.built += 1
                else:
                    self.cached += 1
                made.append(entry)
                keys.append(key)
                parent = _hash(key.encode(), entry.digest.encode())
            image = await asyncio.to_thread(self._publish, base, base_layers, made, keys,
                                            env, workdir)
        finally:
            os.close(lock)
        if self.replaced:  # now that no build of ours holds the lock: what it superseded
            await asyncio.to_thread(image_cache.collect, images_dir)
        stats = BuildStats(steps=len(spec.steps), cached=self.cached, built=self.built,
                           seconds=round(time.monotonic() - started, 3))
        return BuildResult(image, stats)

    # ------------------------------------------------------------------ a step

    async def _run_step(self, index: int, step: RunStep | CopyStep, key: str, chain: Image,
                        env: dict[str, str], workdir: str, source: Path | None) -> CacheEntry:
        """Run one step in a fresh sandbox and commit what it wrote as a layer."""
        engine, spec = self.engine, self.spec
        run = isinstance(step, RunStep)
        as_root = step.as_root
        ca = await asyncio.to_thread(_ca_bundle, self.store.images_dir) if run else None
        binds = [(str(ca), BUILD_CA_PATH)] if ca else []
        if as_root:
            binds += await asyncio.to_thread(rootbuild.apt_files, self.store.images_dir,
                                             self.base.rootfs)
        sb_spec = SandboxSpec(
            image=spec.base, memory_mb=spec.memory_mb, disk_mb=spec.disk_mb, pids=BUILD_PIDS,
            inodes=BUILD_INODES,
            cpus=self.cpus, timeout=spec.step_timeout + 600,
            workdir=workdir,
            network=NetworkMode.HOST if run and self.host_network else NetworkMode.NONE,
            tags=[BUILD_TAG, f"image={self.name}"],
        )
        sb_spec = engine.owners.stamp(sb_spec, self.owner)  # the building tenant's: it runs its steps
        info = await engine.create(sb_spec, image_override=chain, ro_binds=binds, owner=self.owner,
                                   build_root=as_root)
        staged: Path | None = None
        try:
            if isinstance(step, RunStep):
                extra = {**_build_env(ca is not None), **(rootbuild.step_env() if as_root else {})}
                await self._run(index, step, info.id, {**env, **extra}, workdir)
            else:
                assert source is not None
                await self._copy(index, step, info.id, source, workdir)
            budget = Budget.for_spec(sb_spec, f"build step {index + 1} of {self.name}")
            # its layer is bounded by disk_mb and never takes the disk below its reserve
            budget.room = await asyncio.to_thread(room_above_reserve, self.store.images_dir)
            staged = await asyncio.to_thread(_stage_frozen, self.layers, engine.upper_dir(info.id),
                                             engine.cgroup(info.id), budget,
                                             engine.owner_ids(info.id))
        finally:
            await engine.delete(info.id, owner=self.owner)
        try:
            if as_root:  # no set-id bit or file capability leaves a root step
                await asyncio.to_thread(rootbuild.strip_privileges, staged)
            sealed = await asyncio.to_thread(self.layers.seal, staged)
            layer, new = await asyncio.to_thread(self.layers.install, sealed)
        except BaseException:
            await asyncio.to_thread(self.layers.discard, staged)
            raise
        entry = CacheEntry(key, layer.id, layer.digest, layer.size_bytes, step.describe())
        try:
            await asyncio.to_thread(image_cache.cache_put, self.store.images_dir, entry)
        except BaseException:
            if new:
                await asyncio.to_thread(self.layers.remove, layer.id)
            raise
        return entry

    async def _run(self, index: int, step: RunStep, sid: str, env: dict[str, str],
                   workdir: str) -> None:
        tail = _Tail(lambda line: self.emit(type="log", step=index + 1, line=line))
        result = None
        async for ev in self.engine.exec_stream(
            sid, ["/bin/sh", "-c", step.run], timeout=self.spec.step_timeout, env=env,
            cwd=workdir, max_output=MAX_STEP_OUTPUT, owner=self.owner,
        ):
            if ev.kind == "exit":
                result = ev.result
            elif ev.dropped:  # a long log: its head went by, its end follows
                tail.flush()
                tail.feed(f"[... {ev.dropped} bytes of {ev.kind} left out ...]\n".encode())
            else:
                tail.feed(ev.data)
        tail.flush()
        if result is not None and result.ok:
            return
        if result is None:
            why = "its command's stream ended without an exit status"
        elif result.timed_out:
            why = f"it ran out of its {self.spec.step_timeout:g} s (raise step_timeout)"
        elif result.oom_killed:
            why = f"it ran out of memory ({self.spec.memory_mb} MB; raise memory_mb)"
        else:
            why = f"exit status {result.returncode}"
        raise self._failed(index, why, tail.text(), result.returncode if result else None)

    async def _copy(self, index: int, step: CopyStep, sid: str, source: Path,
                    workdir: str) -> None:
        entries, _ = await asyncio.to_thread(_scan_source, source)
        dest = step.source.dest
        if not dest.startswith("/"):
            dest = posixpath.join(workdir, dest)
        is_file = len(entries) == 1 and entries[0][1] == "f" and entries[0][0] == ""
        if is_file and dest.endswith("/"):
            dest = posixpath.join(dest, source.name)
        dest = posixpath.normpath(dest)
        self._check_copy(index, entries, dest)
        try:
            for rel, kind, mode, link in entries:
                target = posixpath.join(dest, rel) if rel else dest
                where = source / rel if rel else source
                if kind == "d":
                    await self.engine.mkdir(sid, target, parents=True, mode=mode | 0o700,
                                            owner=self.owner)
                elif kind == "f":
                    if not rel:
                        await self.engine.mkdir(sid, posixpath.dirname(target) or "/",
                                                owner=self.owner)
                    data = await asyncio.to_thread(where.read_bytes)
                    await self.engine.write_file(sid, target, data, mode=mode,
                                                 owner=self.owner)
                else:
                    made = await self.engine.exec(sid, ["ln", "-sfn", link or "", target],
                                                  owner=self.owner)
                    if not made.ok:
                        raise self._failed(index, f"cannot make the link {target}",
                                           made.stderr.decode(errors="replace"), made.returncode)
        except FileError as exc:
            raise self._failed(
                index, f"{exc.message} (the sandbox user copies: the destination must be "
                "writable by it, e.g. under /app, /workspace or /home/sandbox)", "", None,
            ) from None

    def _check_copy(self, index: int, entries: list[tuple[str, str, int, str | None]],
                    dest: str) -> None:
        """Refuse, before anything is copied, a source deeper than :data:`MAX_COPY_DEPTH`
        (each entry is made by one request whose path the sandbox resolves name by
        name: 1100 levels took minutes) or a path the sandbox cannot hold."""
        depth = max(rel.count("/") + 1 if rel else 0 for rel, *_ in entries)
        if depth > MAX_COPY_DEPTH:
            raise self._failed(
                index, f"the source has directories {depth} levels deep, more than "
                f"the {MAX_COPY_DEPTH} a copy may have: copy an archive of it and unpack it "
                "in a run step", "", None)
        longest = max((posixpath.join(dest, rel) if rel else dest for rel, *_ in entries),
                      key=lambda p: len(p.encode("utf-8", "surrogateescape")))
        size = len(longest.encode("utf-8", "surrogateescape"))
        if size > MAX_COPY_PATH:
            raise self._failed(
                index, f"the copied path {longest[:120]!r}... would be {size} bytes, more "
                f"than a path may have in a sandbox ({MAX_COPY_PATH}): shorten the "
                "source's directories or copy to a shorter destination", "", None)

    def _failed(self, index: int, why: str, output: str, code: int | None) -> ImageBuildError:
        text = self.spec.describe(index)
        total = len(self.spec.steps)
        shown = f":\n{output}" if output else ""
        return ImageBuildError(
            f"building image {self.name!r}: step {index + 1}/{total} ({text}) failed: "
            f"{why}{shown}",
            details={"image": self.name, "step": index + 1, "instruction": text,
                     "returncode": code, "output": output},
        )

    # -------------------------------------------------------------- sources

    def _copy_source(self, step: CopyStep, sent_as: str | None) -> Path:
        """Where a copy step's source is: ``sent_as`` (in the context), else its src."""
        src = sent_as or step.source.src
        if self.context_only or not Path(src).is_absolute():
            rel = relative_copy_source(src)
            if self.context is None:
                raise InvalidArgument(
                    f"copy {src!r}: relative sources need a build context: pass context= "
                    "(or build from a spec file: its directory is the context)")
            path = self.context / rel
        else:
            path = Path(src)
        if not os.path.lexists(path):
            raise InvalidArgument(f"copy source {src!r} does not exist ({path})",
                                  details={"src": src})
        if not os.path.exists(path):  # followed like cp: a loop, or a dangling link
            raise InvalidArgument(f"copy source {src!r} is a symbolic link that leads nowhere "
                                  "(a loop or a missing target): copy what it points to",
                                  details={"src": src})
        if self.context_only:  # a link in a sent context may not lead out of it
            assert self.context is not None  # a context_only source is resolved in it above
            real, root = os.path.realpath(path), os.path.realpath(self.context)
            if real != root and not real.startswith(root + os.sep):
                raise InvalidArgument(f"copy source {src!r} leads outside the build context",
                                      details={"src": src})
        return path

    # -------------------------------------------------------------- publish

    def _publish(self, base: Image, base_layers: list[dict[str, Any]], made: list[CacheEntry],
                 keys: list[str], env: dict[str, str], workdir: str | None) -> Image:
        layers: list[dict[str, Any]] = []
        for e in reversed(made):
            layers.append({"id": e.layer_id, "digest": e.digest, "size_bytes": e.size_bytes})
        seen: set[str] = set()  # a layer in both lists once, where it first appears
        unique: list[dict[str, Any]] = []
        for x in [*layers, *base_layers]:
            if x["id"] not in seen:
                seen.add(x["id"])
                unique.append(x)
        layers = unique
        root = {"image": base.root_image or base.name, "digest": base.root_digest or base.digest}
        digest = "sha256:" + _hash(json.dumps(
            {"root": root, "layers": [x["digest"] for x in layers], "env": env,
             "workdir": workdir, **({"meta": self.meta} if self.meta else {})},
            sort_keys=True).encode())
        if self.store.exists(self.name):
            old = self.store.manifest(self.name)
            if old.get("digest") == digest and old.get("source", {}).get("keys") == keys:
                return self.store.get(self.name)  # nothing changed: keep it as it is
            self.replaced = True
        root_size = self.store.get(root["image"]).size_bytes
        manifest = {
            "digest": digest, "size_bytes": root_size + sum(x["size_bytes"] for x in layers),
            "python": base.python, "base": self.spec.base, "root": root, "layers": layers,
            "env": env, "workdir": workdir, **self.meta,
            "source": {"kind": "build", "spec": self.spec.model_dump(mode="json"),
                       "keys": keys},
        }
        return self.store.publish_built(self.name, manifest)


# ---------------------------------------------------------------------- helpers


def host_cpus() -> float:
    """The CPUs a build step gets by default: all of the host's."""
    return float(min(os.cpu_count() or 1, 256))


def _hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "big") + p)
    return h.hexdigest()


def _scan_source(path: Path) -> tuple[list[tuple[str, str, int, str | None]], str]:
    """The entries of a copy source (``(relative path, "f"|"d"|"l", mode, link)``,
    parents first) and the sha256 of their names, modes and contents. Iterative and
    descriptor-relative (:func:`~corral.runtime.treecopy.listings`): a sent context
    may be thousands of levels deep (os.walk recursed past Python's limit: a 500)."""
    h = hashlib.sha256(b"corral-copy-1\n")
    entries: list[tuple[str, str, int, str | None]] = []

    def add(rel: str, dir_fd: int | None, name: str, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            entries.append((rel, "d", mode, None))
            data = b""
        elif stat.S_ISREG(st.st_mode):
            entries.append((rel, "f", mode, None))
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if rel else 0),
                         dir_fd=dir_fd)
            with open(fd, "rb") as f:
                data = hashlib.file_digest(f, "sha256").hexdigest().encode()
        elif stat.S_ISLNK(st.st_mode):
            link = os.readlink(name, dir_fd=dir_fd)
            entries.append((rel, "l", 0o777, link))
            data = os.fsencode(link)
        else:
            where = os.path.join(path, rel) if rel else str(path)
            raise InvalidArgument(f"cannot copy {where}: only files, directories and "
                                  "symbolic links can be copied into an image",
                                  details={"path": where})
        h.update(b"\0".join([os.fsencode(rel), entries[-1][1].encode(), b"%o" % mode, data])
                 + b"\n")

    top = os.stat(path)  # a link given as the source itself is followed, like cp
    add("", None, str(path), top)
    if stat.S_ISDIR(top.st_mode):
        for rel, dir_fd, name, st in listings(os.path.realpath(path)):
            add(rel, dir_fd, name, st)
    return entries, h.hexdigest()


def _stage_frozen(layers: LayerStore, upper: Path, cgroup: Cgroup, budget: Budget,
                  ids: dict[int, int]) -> Path:
    """Copy a build sandbox's writable layer with its processes frozen (a daemon a step
    left running cannot change it meanwhile), within its limits, its files owned as in
    every layer (``ids``: its uid to the canonical one); ``/.corral`` stays out."""
    cgroup.freeze()
    try:
        return layers.stage(upper, skip=(AGENT_DIR,), budget=budget, ids=ids)
    finally:
        cgroup.thaw()


def host_ca_bundle() -> Path | None:
    """The host's CA bundle: ``$SSL_CERT_FILE``, else OpenSSL's default file."""
    paths = ssl.get_default_verify_paths()
    for candidate in (os.environ.get("SSL_CERT_FILE"), paths.cafile, paths.openssl_cafile):
        if candidate and os.path.isfile(candidate):
            return Path(candidate)
    return None


def _ca_bundle(images_dir: Path) -> Path | None:
    """A world-readable copy of the host's CA bundle in the cache's ``share`` directory,
    which the unprivileged sandbox launcher can bind wherever the original lies."""
    found = host_ca_bundle()
    if found is None:
        return None
    return rootbuild.share_copy(images_dir, _CA_COPY, found.read_bytes())


def _build_env(with_ca: bool) -> dict[str, str]:
    """What ``run`` steps get besides the image's env (never stored in the image)."""
    env = {"PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    if with_ca:
        env.update({k: BUILD_CA_PATH for k in ("SSL_CERT_FILE", "PIP_CERT",
                                                "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")})
    for k in _PASSTHROUGH:
        kept = [v for v in os.environ.get(k, "").split() if not v.lower().startswith("file:")]
        if kept:
            env[k] = " ".join(kept) if k.startswith("PIP_") else kept[0]
    return env


class _Tail:
    """A command's output as lines (for the log) and its last lines (for errors)."""

    def __init__(self, on_line: Callable[[str], Any]) -> None:
        self.on_line = on_line
        self.partial = ""
        self.lines: deque[str] = deque(maxlen=TAIL_LINES)

    def feed(self, data: bytes) -> None:
        text = self.partial + data.decode("utf-8", "replace").replace("\r\n", "\n")
        *done, self.partial = text.replace("\r", "\n").split("\n")
        for line in done:
            self._line(line)

    def flush(self) -> None:
        if self.partial:
            self._line(self.partial)
            self.partial = ""

    def _line(self, line: str) -> None:
        if not line.strip():
            return
        self.lines.append(line)
        self.on_line(line)

    def text(self) -> str:
        return "\n".join(self.lines)[-TAIL_CHARS:]
