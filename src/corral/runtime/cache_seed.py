"""A cache of its own, seeded from the host's: the daemons of a local cluster.

Several daemons on one host (``corral cluster up`` on one machine, or beside the host's
single-host daemon) must not share one image cache: an image one builds, pulls or
removes would appear on, or vanish from, the others, and a tenant's image would cross
between daemons. Each gets its own cache instead, *seeded* with the host's prepared
images by hard links (:func:`seed_cache`):

- no bytes are copied (the 2 GB of built-in images cost inodes' links, in about a
  second), and nothing needs building again on the node;
- image trees are only ever read (they are overlay's read-only lower layers), so a
  shared inode is never written through;
- every name is the daemon's own: removing or pruning an image in one cache unlinks
  that cache's names only, so what another daemon uses (its manifest, its layers, the
  files its sandboxes have mounted) stays whole. Build caches, locks and pulls in
  flight stay per daemon.

Only the prepared images are linked (the default image, ``scratch`` and the built-in
specs, with the images and layers they stand on), never images a tenant made on the
host's daemon, plus the agent binaries and CRIU (``bin``, ``criu``, ``share``). The
tools are linked before the daemon starts, the default image (about 8,000 links) in
the background once it answers, the other built-in images (30,000 more) when first
asked for: a node's start waits for no image. A cache that cannot hard-link to the host's (another file system) is left
empty and the daemon prepares what it needs as on a fresh host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

from corral.runtime import image_cache

__all__ = ["prepared_images", "seed_cache", "seed_image"]

_TOOLS = ("bin", "criu", "share")  # the agent binaries, the CRIU build, shared files


def prepared_images(images_dir: Path, roots: list[str]) -> dict[str, list[str]]:
    """``{image: its layer ids}`` of the images ``roots`` under ``images_dir`` and every
    image they stand on (``base``, ``root``), as their manifests say."""
    names, found = list(roots), {}
    while names:
        name = names.pop()
        if name in found or name.startswith(".") or "/" in name:
            continue
        try:
            manifest = json.loads((images_dir / name / image_cache.MANIFEST).read_text())
        except (OSError, ValueError):
            continue  # not prepared on this host
        found[name] = [str(layer.get("id")) for layer in manifest.get("layers") or []]
        names += [n for n in (manifest.get("base"), (manifest.get("root") or {}).get("image"))
                  if isinstance(n, str)]
    return found


def _link_tree(source: Path, target: Path) -> None:
    """``target``, a copy of ``source`` made of hard links (``cp -al``), or nothing."""
    if target.exists() or not source.exists():
        return
    partial = target.with_name(f".seeding-{target.name}-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(partial, ignore_errors=True)
    done = subprocess.run(["cp", "-al", "--no-target-directory", str(source), str(partial)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise OSError(errno.EXDEV if "link" in done.stderr.lower() else errno.EIO,
                      f"cannot link {source}: {done.stderr.strip()[-300:]}")
    for lock in partial.glob("*.lock") if partial.is_dir() else ():
        lock.unlink()  # a lock is the daemon's own (flock follows the inode)
    try:
        os.rename(partial, target)
    except OSError:  # another thread linked it first
        shutil.rmtree(partial, ignore_errors=True)


def _same_fs(source: Path, target: Path) -> bool:
    return os.stat(source).st_dev == os.stat(target).st_dev


def seed_image(source_images: Path, target_images: Path, name: str, roots: list[str]) -> bool:
    """Link the prepared image ``name`` (one of ``roots``' closure) and what it stands on
    from ``source_images`` where ``target_images`` lacks them; whether it is there now."""
    if not source_images.is_dir() or not _same_fs(source_images, target_images):
        return False
    prepared = prepared_images(source_images, roots)
    if name not in prepared:
        return False
    wanted = prepared_images(source_images, [name])
    (target_images / image_cache.LAYERS).mkdir(exist_ok=True, mode=0o700)
    # Shared, as a build holds it: the host's collection cannot remove a layer meanwhile.
    with open(source_images / image_cache.BUILD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        for each, layers in sorted(wanted.items()):
            if (target_images / each).exists():
                continue
            for layer in layers:
                with contextlib.suppress(FileNotFoundError):
                    _link_tree(source_images / image_cache.LAYERS / layer,
                               target_images / image_cache.LAYERS / layer)
            _link_tree(source_images / each, target_images / each)
    return (target_images / name / image_cache.MANIFEST).is_file()


def seed_cache(source: Path, target: Path, images: list[str]) -> list[str]:
    """Make the cache ``target`` and link into it what it lacks of ``source``'s tools
    and of its prepared ``images`` (the rest come when first asked for: see
    :meth:`~corral.runtime.images.ImageStore.get`); the names linked. ``[]`` when
    ``target`` is ``source`` or the two are on different file systems."""
    source, target = Path(source).absolute(), Path(target).absolute()
    if source == target or not (source / "images").is_dir():
        return []
    target.mkdir(parents=True, exist_ok=True, mode=0o711)
    (target / "images").mkdir(exist_ok=True, mode=0o700)
    if not _same_fs(source, target):
        return []
    linked: list[str] = []
    for tool in _TOOLS:
        if not (target / tool).exists() and (source / tool).exists():
            _link_tree(source / tool, target / tool)
            linked.append(tool)
    for name in images:
        if not (target / "images" / name).exists() and seed_image(
                source / "images", target / "images", name, images):
            linked.append(name)
    return linked
