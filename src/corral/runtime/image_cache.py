"""The layers of built images, the build cache that finds them, and their collection.

Built images share one host-wide layer store (the same :class:`LayerStore` format as
snapshots, under the image cache so that every engine on the host, whatever its state
directory, can start sandboxes from them)::

    <images_dir>/
        .layers/<id>/tree         committed layers (content-addressed, see layers.py)
        .build-cache/<key>.json   a build step's cache key -> the layer it made
        .build.lock               flock: builds hold it shared, collection exclusive
        .retired-<name>-<rand>/   an image replaced while sandboxes still used it

What keeps a layer: the manifest of an image that lists it, a cache entry, or a
mount anywhere on the host that holds it as a lower layer (a sandbox of any engine:
see :class:`Mounted`). Collection is mark-and-sweep over those three, so it cannot drift from the
truth the way a stored count could after a crash. The build cache outlives the images
it built (a rebuild of a deleted image's spec is instant) until :func:`collect` drops
the entries no image uses, which deleting an image does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.runtime.layers import LayerStore
from corral.runtime.treecopy import discard_tree, sweep

LAYERS = ".layers"
CACHE = ".build-cache"
BUILD_LOCK = ".build.lock"
RETIRED = ".retired-"
MANIFEST = "manifest.json"
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class CacheEntry:
    """A build step done before: the layer it committed."""

    key: str
    layer_id: str
    digest: str
    size_bytes: int
    instruction: str


def layer_store(images_dir: Path) -> LayerStore:
    root = Path(images_dir) / LAYERS
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return LayerStore(root)


# ------------------------------------------------------------------ build cache


def cache_get(images_dir: Path, key: str) -> CacheEntry | None:
    """The entry for ``key`` if it exists and its layer is still on disk."""
    try:
        data = json.loads((Path(images_dir) / CACHE / f"{key}.json").read_text())
        entry = CacheEntry(key, data["layer"], data["digest"], int(data["size_bytes"]),
                           data.get("instruction", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (Path(images_dir) / LAYERS / entry.layer_id / "manifest.json").is_file():
        return None
    return entry


def cache_put(images_dir: Path, entry: CacheEntry) -> None:
    """Record an entry, atomically (a crash leaves the old state or the new one)."""
    d = Path(images_dir) / CACHE
    d.mkdir(mode=0o700, exist_ok=True)
    body = {"layer": entry.layer_id, "digest": entry.digest, "size_bytes": entry.size_bytes,
            "instruction": entry.instruction, "created_at": time.time()}
    tmp = d / f".{entry.key}.{os.getpid()}.{secrets.token_hex(3)}"
    tmp.write_text(json.dumps(body))
    os.rename(tmp, d / f"{entry.key}.json")


def _cache_entries(images_dir: Path) -> dict[str, str]:
    """``{key: layer id}`` of every cache entry."""
    found = {}
    d = Path(images_dir) / CACHE
    with contextlib.suppress(FileNotFoundError):
        for p in d.iterdir():
            key = p.name.removesuffix(".json")
            if not _KEY_RE.fullmatch(key):
                continue
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                found[key] = json.loads(p.read_text())["layer"]
    return found


# ---------------------------------------------------------------- what is in use


@dataclass(frozen=True)
class Mounted:
    """What the mounts of every mount namespace on the host hold, read at one moment.

    A sandbox's launcher attaches a clone of each of its lower layers in its private
    mount namespace (``agent/launch.c``), and mounts the overlay on those under
    relative names. So what a sandbox uses shows as the *root* of a mount: the
    directory, as a path inside its filesystem, of a clone or bind mount. Kept as
    ``(device, path)``: that path stays right when the directory is renamed (a retired
    image) and needs no view of the mounter's namespace. Overlays mounted by absolute
    path (older launchers) count by their ``lowerdir=``.
    """

    roots: frozenset[tuple[str, str]]  # ("major:minor", path in that filesystem)
    lowers: frozenset[str]  # absolute lowerdir= paths
    host: tuple[tuple[str, str, str], ...]  # this namespace's (device, mount point, root)


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mounted_lowers() -> Mounted:
    """Read every mount namespace on the host once, through one of its processes.

    Sandboxes mount their root in private namespaces that the host's own mount table
    never shows. Costs about a millisecond per namespace: for deletions, not creates.
    """
    seen: set[int] = set()
    roots: set[tuple[str, str]] = set()
    lowers: set[str] = set()
    host: list[tuple[str, str, str]] = []
    for pid in ["self", *os.listdir("/proc")]:
        if not (pid == "self" or pid.isdigit()):
            continue
        try:
            ns = os.stat(f"/proc/{pid}/ns/mnt").st_ino
            if ns in seen:
                continue
            with open(f"/proc/{pid}/mountinfo") as f:
                table = f.read()
        except OSError:
            continue  # gone, or a kernel thread
        seen.add(ns)
        for line in table.splitlines():
            head, sep, tail = line.partition(" - ")
            fields = head.split(" ")
            if not sep or len(fields) < 5:
                continue
            dev, root, point = fields[2], _unescape(fields[3]), _unescape(fields[4])
            if pid == "self":
                host.append((dev, point, root))
            if root != "/":
                roots.add((dev, root))
            if not tail.startswith("overlay "):
                continue
            for opt in tail.split(" ", 2)[-1].split(","):
                if opt.startswith("lowerdir="):
                    lowers.update(p for p in _unescape(opt[9:]).split(":") if p.startswith("/"))
    return Mounted(frozenset(roots), frozenset(lowers), tuple(host))


def _in_filesystem(path: Path, host: tuple[tuple[str, str, str], ...]) -> tuple[str, str] | None:
    """``(device, path inside its filesystem)`` of an existing ``path``, from the mounts
    of our own namespace (the deepest mount point above it on its device)."""
    try:
        real = os.path.realpath(path, strict=True)
        st = os.stat(real)
    except OSError:
        return None
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    best: tuple[str, str] | None = None
    for d, point, root in host:
        if d != dev or not (real == point or real.startswith(point.rstrip("/") + "/")):
            continue
        if best is None or len(point) > len(best[0]):
            best = (point, root)
    if best is None:
        return None
    point, root = best
    return dev, root.rstrip("/") + real[len(point.rstrip("/")):] or "/"


def in_use(path: Path, mounted: Mounted | None = None) -> bool:
    """Whether a mount anywhere on the host holds ``path`` or something below it (a
    sandbox's lower layer), by :func:`mounted_lowers`."""
    mounted = mounted_lowers() if mounted is None else mounted
    prefix = str(path).rstrip("/") + "/"
    if any((p + "/").startswith(prefix) for p in mounted.lowers):
        return True
    where = _in_filesystem(Path(path), mounted.host)
    if where is None:
        return False
    dev, rel = where
    rel_prefix = rel.rstrip("/") + "/"
    return any(d == dev and (r + "/").startswith(rel_prefix) for d, r in mounted.roots)


# ------------------------------------------------------------------ collection


@contextlib.contextmanager
def build_lock(images_dir: Path, *, exclusive: bool = False,
               wait: bool = True) -> Iterator[bool]:
    """Builds hold this shared; collection holds it exclusive, so that it never takes
    the cache entries or layers of a build still running. Yields whether it got it."""
    Path(images_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(images_dir) / BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def hold_build_lock(images_dir: Path) -> int:
    """Take the build lock shared (blocks while a collection runs); close the returned
    descriptor to let go."""
    Path(images_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(images_dir) / BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def clean_stale_layers(images_dir: Path) -> None:
    """Remove what crashed builds left in the layer store and the build cache (a
    half-written entry), if no build runs now."""
    if not (Path(images_dir) / LAYERS).is_dir():
        return  # nothing was ever built here
    with build_lock(images_dir, exclusive=True, wait=False) as got:
        if got:
            sweep(layer_store(images_dir).root, lambda n: n.startswith((".tmp-", ".trash-")))
            sweep(Path(images_dir) / CACHE, lambda n: n.startswith("."))


def manifests(images_dir: Path) -> dict[str, dict[str, Any]]:
    """``{directory name: manifest}`` of every published image (retired ones too)."""
    found = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(images_dir):
            if entry.name.startswith(".") and not entry.name.startswith(RETIRED):
                continue
            with contextlib.suppress(OSError, ValueError):
                found[entry.name] = json.loads(Path(entry.path, MANIFEST).read_text())
    return found


def retire(images_dir: Path, image_dir: Path, name: str) -> Path:
    """Move the replaced image ``name``, now at ``image_dir``, out of the way (one
    rename); :func:`collect` deletes it once no sandbox mounts it. Call with the
    store's lock held."""
    target = Path(images_dir) / f"{RETIRED}{name}-{secrets.token_hex(4)}"
    os.rename(image_dir, target)
    return target


def _collect_pulled_roots(images_dir: Path, found: dict[str, dict[str, Any]],
                          lowers: Mounted) -> list[str]:
    """Delete the roots pulled from peers for built images (``pulled_root``, see
    :mod:`corral.runtime.root_travel`) that no image is built on any more (a retired
    one included) and no sandbox mounts."""
    used = {(m.get("root") or {}).get("image") for m in found.values()}
    removed = []
    for name, manifest in found.items():
        if (name.startswith(RETIRED) or not manifest.get("pulled_root") or name in used
                or in_use(images_dir / name, lowers)):
            continue
        doomed = images_dir / f".tmp-{name}-0-{secrets.token_hex(4)}"  # swept if we die
        with contextlib.suppress(OSError):
            os.rename(images_dir / name, doomed)
            discard_tree(doomed)  # iterative: an imported tree may be thousands deep
            removed.append(name)
    return removed


def collect(images_dir: Path) -> list[str]:
    """Drop the build cache no image uses, then every layer nothing keeps (see the
    module docstring), and the retired images no sandbox mounts any more. Does nothing
    while a build runs (its steps are not in any manifest yet). Returns what went."""
    images_dir = Path(images_dir)
    removed: list[str] = []
    try:
        names = os.listdir(images_dir)
    except FileNotFoundError:
        return removed
    if not any(n in (LAYERS, CACHE) or n.startswith(RETIRED) for n in names):
        return removed  # nothing was ever built or replaced here
    with build_lock(images_dir, exclusive=True, wait=False) as got:
        if not got:
            return removed
        lowers = mounted_lowers()
        found = manifests(images_dir)
        for name, manifest in found.items():
            if not name.startswith(RETIRED):
                continue
            # Mounts name the rootfs by the path it had before it was retired, which
            # the image now under that name may share: keep it while either is used.
            original = images_dir / str(manifest.get("name", "?")) / "rootfs"
            if not (in_use(images_dir / name, lowers) or in_use(original, lowers)):
                discard_tree(images_dir / name)
                removed.append(name)
        live = {n: m for n, m in found.items() if not n.startswith(RETIRED)}
        removed += _collect_pulled_roots(images_dir, found, lowers)
        live = {n: m for n, m in live.items() if n not in removed}
        keys = {k for m in live.values() for k in (m.get("source", {}) or {}).get("keys", [])}
        keep = {layer["id"] for m in live.values() for layer in m.get("layers", [])}
        for key, layer_id in _cache_entries(images_dir).items():
            if key in keys:
                keep.add(layer_id)
            else:
                (images_dir / CACHE / f"{key}.json").unlink(missing_ok=True)
        store = layer_store(images_dir)
        for p in store.root.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                sweep(store.root, p.name.__eq__)  # no build runs: nobody's work
            elif p.name not in keep and not in_use(p, lowers):
                store.remove(p.name)
                removed.append(p.name)
    return removed
