"""Images: the read-only root filesystems that sandboxes start from.

A sandbox's root is an overlayfs whose lower layer is an image's ``rootfs``. The
sandbox runs as uid 1000 (``sandbox``) in a user namespace where the host's root
owns nothing it can write, so an image's files are world-readable, its directories
world-traversable, and nothing in it is writable from inside.

On disk, one image is one directory, published by a single ``rename`` once complete
(so an interrupted build or copy never leaves half an image behind)::

    <images_dir>/
        .lock                     flock: publishing and removing images
        .build-<name>.lock        flock: one build of <name> at a time
        .tmp-<name>-<pid>-<rand>/ work in progress (removed once <pid> is gone)
        <name>/
            manifest.json         name, digest, created_at, size_bytes, python, ...
            rootfs/

The default image ``python`` is Debian (the host's release) with python3, pip, venv
and CA certificates, built by ``debootstrap`` on first use and cached afterwards.

Images of kind ``built`` (:mod:`corral.runtime.image_build`) have no ``rootfs`` of
their own: their manifest names the image whose rootfs lies at the bottom and the
layers above it (in ``.layers``, see :mod:`corral.runtime.image_cache`), plus the
``env`` and ``workdir`` that sandboxes made from them get by default. Replacing an
image swaps the directories in one step (``RENAME_EXCHANGE``); the old one is deleted
once no sandbox mounts it.

The Debian part (mirror, debootstrap, post-processing) is :mod:`corral.runtime.debian`.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import ImageInUse, ImageNotFound, InternalError, InvalidArgument, InvalidState
from corral.image_schema import IMAGE_NAME_RE as _NAME_RE
from corral.image_schema import ImageInfo
from corral.image_schema import validate_image_name as validate_name
from corral.runtime import cache_seed, image_cache, syscalls
from corral.runtime.debian import (  # re-exported: the default image's recipe
    DEFAULT_PACKAGES,
    MIRROR_ENV,
    SANDBOX_GID,
    SANDBOX_HOME,
    SANDBOX_UID,
    SANDBOX_USER,
    WORKSPACE,
    Log,
    _debootstrap,
    _installed_packages,
    find_debian_mirror,
    find_python,
    host_codename,
    parse_deb822_sources,
    parse_sources_list,
    postprocess_default_rootfs,
)
from corral.runtime.fsutil import (
    _flock,
    _fsync_dir,
    _pid_alive,
    _remove_tree,
    _scan_tree,
    _unmount_below,
    _write_atomic,
)
from corral.schema import SandboxSpec

__all__ = [  # with what corral.runtime.debian and image_schema lend this module
    "DEFAULT_IMAGE", "DEFAULT_PACKAGES", "DEFAULT_RECIPE_VERSION", "MANIFEST", "MIRROR_ENV",
    "ROOTFS", "SANDBOX_GID", "SANDBOX_HOME", "SANDBOX_UID", "SANDBOX_USER", "WORKSPACE",
    "Image", "ImageStore", "find_debian_mirror", "find_python", "host_codename",
    "parse_deb822_sources", "parse_sources_list", "postprocess_default_rootfs",
    "validate_name",
]

DEFAULT_IMAGE = "python"
BUILTIN_DIR = Path(__file__).parent / "builtin"  # the built-in image specs
# Bump when the post-processing of the default image changes: the recipe (and so the
# digest) of images built before says they are outdated.
DEFAULT_RECIPE_VERSION = 1

MANIFEST = "manifest.json"
ROOTFS = "rootfs"
_TMP_PREFIX = ".tmp-"

_NAMES_SHOWN = 20  # image names an ImageNotFound message lists (details: all)


@dataclass(frozen=True)
class Image:
    """One image in the store: a read-only root filesystem and what is known about it."""

    name: str
    rootfs: Path
    digest: str  # "sha256:<hex>" of the build inputs and the tree's listing
    created_at: float
    size_bytes: int
    python: str | None  # python3 inside the image, e.g. "/usr/bin/python3"
    kind: str = "rootfs"  # "debootstrap", "rootfs", "oci" or "built"
    layers: tuple[Path, ...] = ()  # built: the layer trees above ``rootfs``, top first
    layer_ids: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, compare=False)
    workdir: str | None = None  # the default workdir of its sandboxes (None: /workspace)
    user: str | None = None  # who its commands run as by default (runtime.users; None: 1000)
    entrypoint: tuple[str, ...] = ()  # Dockerfile ENTRYPOINT / OCI Entrypoint
    cmd: tuple[str, ...] = ()  # Dockerfile CMD / OCI Cmd
    base: str | None = None  # built: the image its spec started from
    root_image: str | None = None  # built: the image whose rootfs ``rootfs`` is...
    root_digest: str | None = None  # ...and its digest when this one was built

    @property
    def lowers(self) -> list[Path]:
        """The overlay lower layers of its sandboxes, top first."""
        return [*self.layers, self.rootfs]

    def apply_defaults(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with this image's ``env`` below its own and its ``workdir`` unless
        the spec set one."""
        update: dict[str, Any] = {}
        if self.env:
            update["env"] = {**self.env, **spec.env}
        if self.workdir and "workdir" not in spec.model_fields_set:
            update["workdir"] = self.workdir
        return spec.model_copy(update=update) if update else spec

    def info(self) -> ImageInfo:
        return ImageInfo(
            name=self.name, kind=self.kind, digest=self.digest, created_at=self.created_at,
            size_bytes=self.size_bytes, base=self.base, layers=list(self.layer_ids),
            env=dict(self.env), workdir=self.workdir, python=self.python,
        )


def prepared_names() -> list[str]:
    """The images a host is prepared with (``python -m corral.runtime.prepare``): the
    default image, ``scratch`` and the built-in specs (the images they stand on follow)."""
    return [DEFAULT_IMAGE, "scratch", *sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))]


class ImageStore:
    """The images of one host, kept under ``images_dir`` (``Layout.images_dir``).

    Example::

        store = ImageStore(layout.images_dir)
        image = store.ensure_default()      # builds "python" once, then cached
        image.rootfs / "usr/bin/python3"
    """

    def __init__(self, images_dir: Path, *, seed_from: Path | None = None) -> None:
        self.images_dir = Path(images_dir)
        # Another cache's images dir whose prepared images this one links in when first
        # asked for (a cluster node's own cache: runtime/cache_seed.py)
        self.seed_from = seed_from
        # name -> (manifest's (inode, mtime, size), Image): a create reads no JSON
        self._cache: dict[str, tuple[tuple[int, int, int], Image]] = {}

    # -- reading -------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        validate_name(name)
        return (self.images_dir / name / MANIFEST).is_file()

    def get(self, name: str, *, check_base: bool = True) -> Image:
        """The image called ``name``; :class:`ImageNotFound` if there is none, and
        :class:`InvalidState` for a built image whose base image was replaced since
        (unless ``check_base`` is false: listing and deleting it still work)."""
        validate_name(name)
        path = self.images_dir / name / MANIFEST
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not self.seed(name):
                raise self._not_found(name) from None
            st = os.stat(path)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(name)
        if cached is not None and cached[0] == key:
            image = cached[1]
        else:
            image = self._load(name)
            self._cache[name] = (key, image)
        if image.root_image is not None and check_base:
            root = self.get(image.root_image)
            if root.digest != image.root_digest:
                raise InvalidState(
                    f"image {name!r} was built on image {image.root_image!r}, which was "
                    f"replaced since: build {name!r} again",
                    details={"image": name, "base": image.root_image},
                )
        return image

    def _load(self, name: str) -> Image:
        image_dir = self.images_dir / name
        try:
            raw = (image_dir / MANIFEST).read_text()
        except FileNotFoundError:
            raise self._not_found(name) from None
        try:
            manifest = json.loads(raw)
            kind = manifest.get("kind") or (
                "debootstrap" if manifest.get("source", {}).get("kind") == "debootstrap"
                else "rootfs")
            common = {
                "name": name, "digest": str(manifest["digest"]),
                "created_at": float(manifest["created_at"]),
                "size_bytes": int(manifest["size_bytes"]), "python": manifest.get("python"),
                "kind": kind, "env": dict(manifest.get("env") or {}),
                "workdir": manifest.get("workdir"), "user": _text(manifest.get("user")),
                "entrypoint": _strings(manifest.get("entrypoint")),
                "cmd": _strings(manifest.get("cmd")),
            }
            if kind != "built":
                return Image(rootfs=image_dir / ROOTFS, **common)
            root = manifest["root"]
            ids = tuple(str(layer["id"]) for layer in manifest["layers"])
            store = image_cache.layer_store(self.images_dir)
            missing = [i for i in ids if not store.path(i).is_dir()]
            if missing:
                raise InternalError(
                    f"image {name!r} lost its layer {missing[0]} (deleted by hand?): "
                    f"remove the image and build it again", details={"image": name})
            return Image(
                rootfs=self.images_dir / root["image"] / ROOTFS, layers=tuple(
                    store.path(i) for i in ids), layer_ids=ids, base=manifest.get("base"),
                root_image=str(root["image"]), root_digest=str(root["digest"]), **common)
        except (ValueError, KeyError, TypeError) as exc:
            raise InternalError(
                f"image {name!r} has a damaged manifest ({exc}); remove {image_dir} and "
                "rebuild or re-add it",
                details={"image": name},
            ) from exc

    def list(self) -> list[Image]:
        """Every complete image, sorted by name (work in progress is never listed)."""
        images = []
        for name in prepared_names() if self.seed_from is not None else ():
            self.seed(name)
        for name in self._names():
            with contextlib.suppress(ImageNotFound):
                images.append(self.get(name, check_base=False))
        return images

    def seed(self, name: str) -> bool:
        """Link the prepared image ``name`` in from :attr:`seed_from`; whether it is here."""
        if self.seed_from is None:
            return False
        return cache_seed.seed_image(self.seed_from, self.images_dir, name, prepared_names())

    def manifest(self, name: str) -> dict[str, Any]:
        """The full manifest of an image (source, debian release, ...), as stored."""
        self.get(name)
        manifest: dict[str, Any] = json.loads((self.images_dir / name / MANIFEST).read_text())
        return manifest

    # -- writing -------------------------------------------------------------------

    def remove(self, name: str) -> None:
        """Delete an image; :class:`ImageInUse` while built images stand on it, or
        while sandboxes (of any engine on the host) run on its root filesystem. The
        layers and build cache only it used go too (see :func:`image_cache.collect`)."""
        validate_name(name)
        with self._store_lock():
            image_dir = self.images_dir / name
            if not image_dir.exists():
                raise self._not_found(name)
            self._refuse_if_base(name, "remove")
            # A built image's layers stay while mounted (collect checks), its rootfs
            # is another image's: only a root filesystem of its own can be in use.
            if image_cache.in_use(image_dir / ROOTFS):
                raise ImageInUse(
                    f"image {name!r} is in use by running sandboxes: delete them first",
                    details={"image": name})
            # Out of sight in one rename, then deleted: a crash half-way through the
            # deletion leaves a stale tmp dir for the next cleanup, never half an image.
            doomed = self._new_tmp_dir(name, create=False)
            os.rename(image_dir, doomed)
        self._cache.pop(name, None)
        _remove_tree(doomed)
        image_cache.collect(self.images_dir)

    def _refuse_if_base(self, name: str, what: str) -> None:
        users = sorted(n for n, m in image_cache.manifests(self.images_dir).items()
                       if not n.startswith(".") and (m.get("root") or {}).get("image") == name)
        if users:
            raise ImageInUse(
                f"cannot {what} image {name!r}: image(s) {', '.join(users)} are built on it; "
                "remove those first", details={"image": name, "images": users})

    def work_dir(self, label: str) -> Path:
        """A private directory in the store for an import or a build context; a crash
        leaves it to the next cleanup. The caller removes it."""
        self._clean_stale()
        return self._new_tmp_dir(validate_name(label))

    def publish_built(self, name: str, manifest: dict[str, Any]) -> Image:
        """Publish a built image (a manifest, no rootfs), replacing one of that name."""
        validate_name(name)
        self._clean_stale()
        tmp = self._new_tmp_dir(name)
        try:
            manifest = {**manifest, "name": name, "kind": "built", "created_at": time.time()}
            _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.chmod(tmp, 0o755)
            self._install(name, tmp, replace=True)
        except BaseException:
            _remove_tree(tmp)
            raise
        return self.get(name)

    def add_rootfs(self, name: str, rootfs_src: Path, *, move: bool = False,
                   source: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                   replace: bool = False) -> Image:
        """Register the directory tree ``rootfs_src`` as the image ``name``.

        The tree is copied (``cp -a``: owners, modes, links and device nodes kept), or
        moved when ``move`` is true (it must then be on the same filesystem as the
        store). The image appears at once and complete, or not at all. ``source`` is
        free-form provenance kept in the manifest and mixed into the digest; ``extra``
        goes into the manifest as is (``kind``, ``env``, ``workdir``). With
        ``replace``, an image of that name is swapped out for the new one.
        """
        validate_name(name)
        rootfs_src = Path(rootfs_src)
        if not rootfs_src.is_dir() or rootfs_src.is_symlink():
            raise InvalidArgument(f"cannot add image {name!r}: {rootfs_src} is not a directory",
                                  details={"image": name, "path": str(rootfs_src)})
        if self.exists(name) and not replace:
            raise self._exists(name)
        self._clean_stale()
        tmp = self._new_tmp_dir(name)
        try:
            rootfs = tmp / ROOTFS
            if move:
                try:
                    os.rename(rootfs_src, rootfs)
                except OSError as exc:
                    raise InvalidArgument(
                        f"cannot move {rootfs_src} into the image store ({exc.strerror}); "
                        "add it with move=False to copy it instead",
                        details={"image": name, "path": str(rootfs_src)},
                    ) from exc
            else:
                cp = subprocess.run(["cp", "-a", "--reflink=auto", "--", str(rootfs_src),
                                     str(rootfs)], capture_output=True, text=True, check=False)
                if cp.returncode != 0:
                    raise InternalError(f"copying {rootfs_src} into image {name!r} failed: "
                                        f"{cp.stderr.strip()}", details={"image": name})
            os.chmod(rootfs, 0o755)
            return self._publish(name, tmp, source=source or {"kind": "rootfs"}, extra=extra,
                                 replace=replace)
        except BaseException:
            _remove_tree(tmp)
            raise

    def ensure_default(self, *, log: Log = print) -> Image:
        """Return the default image ``python``, building it first if it is missing.

        Safe against concurrent callers in any process: one builds, the others wait
        for it (an flock on ``.build-python.lock``) and then share the result.
        """
        return self._ensure(DEFAULT_IMAGE, DEFAULT_PACKAGES, lambda: self._build_default(log), log)

    # -- internals -----------------------------------------------------------------

    def _ensure(
        self, name: str, packages: tuple[str, ...], build: Callable[[], Image], log: Log
    ) -> Image:
        if self.exists(name):
            return self._checked_debian(name, packages, log)
        self.images_dir.mkdir(parents=True, exist_ok=True)
        with _flock(self.images_dir / f".build-{name}.lock",
                    on_wait=lambda: log(f"waiting for another build of image {name!r}...")):
            if self.exists(name):
                return self._checked_debian(name, packages, log)
            return build()

    def _checked_debian(self, name: str, packages: tuple[str, ...], log: Log) -> Image:
        image = self.get(name)
        source = self.manifest(name).get("source", {})
        recipe = source.get("recipe")
        if recipe != DEFAULT_RECIPE_VERSION:
            log(f"note: image {name!r} was built by recipe {recipe}, the current one "
                f"is {DEFAULT_RECIPE_VERSION}; remove it (and its sandboxes) to rebuild it")
        elif source.get("include") != list(packages):
            log(f"note: image {name!r} was built with {', '.join(source.get('include') or [])}; "
                f"the current list is {', '.join(packages)}: remove it (and its sandboxes) "
                "to rebuild it")
        return image

    def _build_default(self, log: Log) -> Image:
        return self._build_debian(DEFAULT_IMAGE, DEFAULT_PACKAGES, log)

    def _build_debian(self, name: str, packages: tuple[str, ...], log: Log) -> Image:
        started = time.monotonic()
        if shutil.which("debootstrap") is None:
            raise InternalError(f"debootstrap is not installed; install it (apt-get install "
                                f"debootstrap) to build the image {name!r}")
        codename = host_codename()
        mirror = find_debian_mirror(codename)
        self._clean_stale()
        tmp = self._new_tmp_dir(name)
        rootfs = tmp / ROOTFS
        log(f"building image {name!r}: Debian {codename} + "
            f"{', '.join(packages)} (takes a minute or two)")
        try:
            _debootstrap(codename, rootfs, mirror, log, packages)
            log("post-processing the root filesystem...")
            _unmount_below(rootfs)
            python = postprocess_default_rootfs(rootfs)
            source = {
                "kind": "debootstrap",
                "recipe": DEFAULT_RECIPE_VERSION,
                "suite": codename,
                "variant": "minbase",
                "include": list(packages),
                "packages": _installed_packages(rootfs),
            }
            image = self._publish(name, tmp, source=source,
                                  extra={"debian": codename, "python": python})
        except BaseException:
            _remove_tree(tmp)
            raise
        log(f"image {name!r} ready: {image.size_bytes / 1e6:.0f} MB in "
            f"{time.monotonic() - started:.0f} s ({image.rootfs})")
        return image

    def _publish(self, name: str, tmp: Path, *, source: dict[str, Any],
                 extra: dict[str, Any] | None = None, replace: bool = False) -> Image:
        """Write the manifest into ``tmp`` and rename ``tmp`` to ``<images_dir>/<name>``."""
        rootfs = tmp / ROOTFS
        size, listing = _scan_tree(rootfs)
        extra = dict(extra or {})
        python = extra.pop("python", None) or find_python(rootfs)
        digest = extra.pop("digest", None) or "sha256:" + hashlib.sha256(  # or a peer's
            json.dumps({"source": source, "tree": listing}, sort_keys=True).encode()
        ).hexdigest()
        manifest = {
            "name": name,
            "digest": digest,
            "created_at": time.time(),
            "size_bytes": size,
            "python": python,
            **extra,
            "source": source,
        }
        _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)
        self._install(name, tmp, replace=replace)
        return self.get(name)

    def _install(self, name: str, tmp: Path, *, replace: bool) -> None:
        """Give the finished directory ``tmp`` its name; with ``replace``, swap it with
        the image of that name in one step and retire the old one."""
        retired = None
        with self._store_lock():
            final = self.images_dir / name
            if not final.exists():
                os.rename(tmp, final)
            elif not replace:
                raise self._exists(name)
            else:
                if (self.images_dir / name / ROOTFS).is_dir():  # built ones stand on these
                    self._refuse_if_base(name, "replace")
                syscalls.rename_exchange(str(tmp), str(final))
                retired = image_cache.retire(self.images_dir, tmp, name)
        _fsync_dir(self.images_dir)
        self._cache.pop(name, None)
        if retired is not None:
            image_cache.collect(self.images_dir)  # deleted now unless sandboxes use it

    def _names(self) -> tuple[str, ...]:
        """Names of complete images (a manifest is written last, before publishing)."""
        try:
            entries = os.listdir(self.images_dir)
        except FileNotFoundError:
            return ()
        return tuple(sorted(n for n in entries if _NAME_RE.fullmatch(n)
                            and (self.images_dir / n / MANIFEST).is_file()))

    def _new_tmp_dir(self, name: str, *, create: bool = True) -> Path:
        self.images_dir.mkdir(parents=True, exist_ok=True)
        path = self.images_dir / f"{_TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
        if create:
            path.mkdir(mode=0o700)
        return path

    def sweep_debris(self) -> None:
        """What killed work left: tmp dirs of builds, copies and imports whose process is
        gone, and staged layers of crashed builds (unless a build runs now). Called
        when an engine starts (:mod:`corral.runtime.startup`), so that a build killed
        with its daemon does not keep its partial layer until the next image operation."""
        self._clean_stale()
        image_cache.clean_stale_layers(self.images_dir)

    def _clean_stale(self) -> None:
        """Delete the tmp dirs of builds, copies and removals whose process is gone."""
        try:
            entries = os.listdir(self.images_dir)
        except FileNotFoundError:
            return
        for entry in entries:
            if not entry.startswith(_TMP_PREFIX):
                continue
            try:
                pid = int(entry.rsplit("-", 2)[-2])
            except (ValueError, IndexError):
                pid = 0  # not a name we made: nobody is working on it
            # Our own pid: another thread of this process is still working on it.
            if pid == os.getpid() or (pid > 0 and _pid_alive(pid)):
                continue
            _remove_tree(self.images_dir / entry)

    @contextlib.contextmanager
    def _store_lock(self) -> Iterator[None]:
        self.images_dir.mkdir(parents=True, exist_ok=True)
        with _flock(self.images_dir / ".lock"):
            yield

    def _not_found(self, name: str) -> ImageNotFound:
        # What a tenant may read: names and what to do, never a path of the host.
        names = list(self._names())
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        if close:
            hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
        elif name == DEFAULT_IMAGE:
            hint = ("the default image is not built yet: build it on the daemon's host "
                    "with `python -m corral.runtime.prepare` (as root)")
        else:
            hint = ("`corral image ls` lists the images; build one with `corral image build "
                    "SPEC.yaml` or import one with `corral image import`")
        shown = ", ".join(names[:_NAMES_SHOWN]) or "none yet"
        if len(names) > _NAMES_SHOWN:
            shown += f", and {len(names) - _NAMES_SHOWN} more"
        return ImageNotFound(
            f"image {name!r} not found (available: {shown}): {hint}",
            details={"image": name, "available": names, "did_you_mean": close},
        )

    def _exists(self, name: str) -> InvalidArgument:
        return InvalidArgument(f"image {name!r} already exists; remove it first to replace it",
                               details={"image": name})


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return ()
