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

Environment variables (read only here):
- ``CORRAL_DEBIAN_MIRROR``: the Debian mirror URL to build the default image from.
  Default: the first mirror of the host's release (``main`` component) found in the
  host's apt sources (``/etc/apt/sources.list.d/*.sources``, ``/etc/apt/sources.list``,
  ``/etc/apt/sources.list.d/*.list``).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.errors import ImageNotFound, InternalError, InvalidArgument
from corral.runtime import syscalls

DEFAULT_IMAGE = "python"
DEFAULT_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
# Bump when the post-processing of the default image changes: the recipe (and so the
# digest) of images built before says they are outdated.
DEFAULT_RECIPE_VERSION = 1
DEBOOTSTRAP_TIMEOUT = 30 * 60
MIRROR_ENV = "CORRAL_DEBIAN_MIRROR"

SANDBOX_USER = "sandbox"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_HOME = "/home/sandbox"
WORKSPACE = "/workspace"

MANIFEST = "manifest.json"
ROOTFS = "rootfs"
_TMP_PREFIX = ".tmp-"
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
# Files that stay private inside an image: no sandbox process needs them.
_PRIVATE_PATHS = ("etc/shadow", "etc/shadow-", "etc/gshadow", "etc/gshadow-", "root")
_PER_PACKAGE_LINE = re.compile(
    r"I: (Retrieving|Validating|Extracting|Unpacking|Configuring) (?!.*packages)")
_BUILD_ENV_PASSTHROUGH = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY",
                          "HTTPS_PROXY", "NO_PROXY")

Log = Callable[[str], Any]


@dataclass(frozen=True)
class Image:
    """One image in the store: a read-only root filesystem and what is known about it."""

    name: str
    rootfs: Path
    digest: str  # "sha256:<hex>" of the build inputs and the tree's listing
    created_at: float
    size_bytes: int
    python: str | None  # python3 inside the image, e.g. "/usr/bin/python3"


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid image name, else raise :class:`InvalidArgument`."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"invalid image name {name!r}: use 1-64 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            details={"image": name},
        )
    return name


class ImageStore:
    """The images of one host, kept under ``images_dir`` (``Layout.images_dir``).

    Example::

        store = ImageStore(layout.images_dir)
        image = store.ensure_default()      # builds "python" once, then cached
        image.rootfs / "usr/bin/python3"
    """

    def __init__(self, images_dir: Path) -> None:
        self.images_dir = Path(images_dir)

    # -- reading -------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        validate_name(name)
        return (self.images_dir / name / MANIFEST).is_file()

    def get(self, name: str) -> Image:
        """The image called ``name``; :class:`ImageNotFound` if there is none."""
        validate_name(name)
        image_dir = self.images_dir / name
        try:
            raw = (image_dir / MANIFEST).read_text()
        except FileNotFoundError:
            raise self._not_found(name) from None
        try:
            manifest = json.loads(raw)
            return Image(
                name=name,
                rootfs=image_dir / ROOTFS,
                digest=str(manifest["digest"]),
                created_at=float(manifest["created_at"]),
                size_bytes=int(manifest["size_bytes"]),
                python=manifest.get("python"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InternalError(
                f"image {name!r} has a damaged manifest ({exc}); remove {image_dir} and "
                "rebuild or re-add it",
                details={"image": name},
            ) from exc

    def list(self) -> list[Image]:
        """Every complete image, sorted by name (work in progress is never listed)."""
        images = []
        for name in self._names():
            with contextlib.suppress(ImageNotFound):
                images.append(self.get(name))
        return images

    def manifest(self, name: str) -> dict[str, Any]:
        """The full manifest of an image (source, debian release, ...), as stored."""
        self.get(name)
        return json.loads((self.images_dir / name / MANIFEST).read_text())

    # -- writing -------------------------------------------------------------------

    def remove(self, name: str) -> None:
        """Delete an image. Sandboxes still running on it must be stopped first."""
        validate_name(name)
        with self._store_lock():
            image_dir = self.images_dir / name
            if not image_dir.exists():
                raise self._not_found(name)
            # Out of sight in one rename, then deleted: a crash half-way through the
            # deletion leaves a stale tmp dir for the next cleanup, never half an image.
            doomed = self._new_tmp_dir(name, create=False)
            os.rename(image_dir, doomed)
        _remove_tree(doomed)

    def add_rootfs(self, name: str, rootfs_src: Path, *, move: bool = False,
                   source: dict[str, Any] | None = None) -> Image:
        """Register the directory tree ``rootfs_src`` as the image ``name``.

        The tree is copied (``cp -a``: owners, modes, links and device nodes kept), or
        moved when ``move`` is true (it must then be on the same filesystem as the
        store). The image appears at once and complete, or not at all. ``source`` is
        free-form provenance kept in the manifest and mixed into the digest.
        """
        validate_name(name)
        rootfs_src = Path(rootfs_src)
        if not rootfs_src.is_dir() or rootfs_src.is_symlink():
            raise InvalidArgument(f"cannot add image {name!r}: {rootfs_src} is not a directory",
                                  details={"image": name, "path": str(rootfs_src)})
        if self.exists(name):
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
            return self._publish(name, tmp, source=source or {"kind": "rootfs"})
        except BaseException:
            _remove_tree(tmp)
            raise

    def ensure_default(self, *, log: Log = print) -> Image:
        """Return the default image ``python``, building it first if it is missing.

        Safe against concurrent callers in any process: one builds, the others wait
        for it (an flock on ``.build-python.lock``) and then share the result.
        """
        name = DEFAULT_IMAGE
        if self.exists(name):
            return self._checked_default(log)
        self.images_dir.mkdir(parents=True, exist_ok=True)
        with _flock(self.images_dir / f".build-{name}.lock",
                    on_wait=lambda: log(f"waiting for another build of image {name!r}...")):
            if self.exists(name):
                return self._checked_default(log)
            return self._build_default(log)

    # -- internals -----------------------------------------------------------------

    def _checked_default(self, log: Log) -> Image:
        image = self.get(DEFAULT_IMAGE)
        recipe = self.manifest(DEFAULT_IMAGE).get("source", {}).get("recipe")
        if recipe != DEFAULT_RECIPE_VERSION:
            log(f"note: image {DEFAULT_IMAGE!r} was built by recipe {recipe}, the current one "
                f"is {DEFAULT_RECIPE_VERSION}; remove it (and its sandboxes) to rebuild it")
        return image

    def _build_default(self, log: Log) -> Image:
        started = time.monotonic()
        codename = host_codename()
        mirror = find_debian_mirror(codename)
        self._clean_stale()
        tmp = self._new_tmp_dir(DEFAULT_IMAGE)
        rootfs = tmp / ROOTFS
        log(f"building image {DEFAULT_IMAGE!r}: Debian {codename} + "
            f"{', '.join(DEFAULT_PACKAGES)} (takes a minute or two)")
        try:
            _debootstrap(codename, rootfs, mirror, log)
            log("post-processing the root filesystem...")
            _unmount_below(rootfs)
            python = postprocess_default_rootfs(rootfs)
            source = {
                "kind": "debootstrap",
                "recipe": DEFAULT_RECIPE_VERSION,
                "suite": codename,
                "variant": "minbase",
                "include": list(DEFAULT_PACKAGES),
                "packages": _installed_packages(rootfs),
            }
            image = self._publish(DEFAULT_IMAGE, tmp, source=source,
                                  extra={"debian": codename, "python": python})
        except BaseException:
            _remove_tree(tmp)
            raise
        log(f"image {DEFAULT_IMAGE!r} ready: {image.size_bytes / 1e6:.0f} MB in "
            f"{time.monotonic() - started:.0f} s ({image.rootfs})")
        return image

    def _publish(self, name: str, tmp: Path, *, source: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> Image:
        """Write the manifest into ``tmp`` and rename ``tmp`` to ``<images_dir>/<name>``."""
        rootfs = tmp / ROOTFS
        size, listing = _scan_tree(rootfs)
        extra = dict(extra or {})
        python = extra.pop("python", None) or find_python(rootfs)
        digest = "sha256:" + hashlib.sha256(
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
        with self._store_lock():
            final = self.images_dir / name
            if final.exists():
                raise self._exists(name)
            os.rename(tmp, final)
        _fsync_dir(self.images_dir)
        return self.get(name)

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
        available = ", ".join(self._names()) or "none yet"
        hint = (f"build the default image {DEFAULT_IMAGE!r} with "
                "`python -m corral.runtime.prepare` (as root)")
        return ImageNotFound(
            f"image {name!r} not found in {self.images_dir} (available: {available}); {hint}",
            details={"image": name, "available": list(self._names())},
        )

    def _exists(self, name: str) -> InvalidArgument:
        return InvalidArgument(f"image {name!r} already exists; remove it first to replace it",
                               details={"image": name})


# -- the default image -----------------------------------------------------------------


def host_codename(os_release: Path = Path("/etc/os-release")) -> str:
    """The host's release codename (``VERSION_CODENAME`` in os-release)."""
    try:
        text = Path(os_release).read_text()
    except OSError as exc:
        raise InternalError(f"cannot read {os_release} to find the host's release: {exc}") from exc
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "VERSION_CODENAME" and value.strip().strip("\"'"):
            return value.strip().strip("\"'")
    raise InternalError(f"{os_release} names no VERSION_CODENAME; corral builds its default "
                        "image with debootstrap on a Debian host")


def parse_deb822_sources(path: Path, codename: str) -> list[str]:
    """Mirror URIs in a deb822 ``.sources`` file that serve ``codename`` with ``main``."""
    uris: list[str] = []
    for stanza in _deb822_stanzas(Path(path).read_text()):
        if stanza.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in stanza.get("types", "").split():
            continue
        if codename not in stanza.get("suites", "").split():
            continue
        if "main" not in stanza.get("components", "").split():
            continue
        uris.extend(u for u in stanza.get("uris", "").split() if u not in uris)
    return uris


def parse_sources_list(path: Path, codename: str) -> list[str]:
    """Mirror URIs on ``deb URI codename ... main ...`` lines of a one-line-style list."""
    uris: list[str] = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        rest = line[4:].strip()
        if rest.startswith("["):  # options: deb [arch=amd64 signed-by=...] URI ...
            rest = rest.partition("]")[2]
        fields = rest.split()
        if (len(fields) >= 3 and fields[1] == codename and "main" in fields[2:]
                and fields[0] not in uris):
            uris.append(fields[0])
    return uris


def find_debian_mirror(codename: str, *, apt_dir: Path = Path("/etc/apt")) -> str:
    """The mirror to build from: ``$CORRAL_DEBIAN_MIRROR``, else the host's apt sources."""
    override = os.environ.get(MIRROR_ENV, "").strip()
    if override:
        return override
    apt_dir = Path(apt_dir)
    candidates: list[tuple[Callable[[Path, str], list[str]], Path]] = []
    candidates += [(parse_deb822_sources, p)
                   for p in sorted((apt_dir / "sources.list.d").glob("*.sources"))]
    candidates.append((parse_sources_list, apt_dir / "sources.list"))
    candidates += [(parse_sources_list, p)
                   for p in sorted((apt_dir / "sources.list.d").glob("*.list"))]
    for parse, path in candidates:
        try:
            uris = parse(path, codename)
        except OSError:
            continue
        for uri in uris:
            if uri.split(":", 1)[0] in ("http", "https", "file"):
                return uri
    raise InternalError(
        f"no Debian mirror for {codename!r} (component main) found in {apt_dir}; "
        f"set {MIRROR_ENV} to the URL of a Debian mirror",
        details={"suite": codename},
    )


def postprocess_default_rootfs(rootfs: Path) -> str | None:
    """Turn a fresh debootstrap tree into a sandbox image; return the python3 path."""
    rootfs = Path(rootfs)
    # Debian marks its python "externally managed" (PEP 668). Site-packages is not
    # writable by the sandbox user anyway, so without the marker pip falls back to a
    # user install in ~/.local, which is what a sandbox wants.
    for marker in glob.glob(str(rootfs / "usr/lib/python3*/EXTERNALLY-MANAGED")):
        os.unlink(marker)
    _add_sandbox_user(rootfs)
    _write_atomic(rootfs / "etc/hostname", "sandbox\n")
    _write_atomic(rootfs / "etc/hosts",
           "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    # debootstrap copies the host's resolv.conf in; sandboxes have no DNS by default.
    _write_atomic(rootfs / "etc/resolv.conf", "")
    # The build mirror is the host's business (it may be private, or carry credentials);
    # the sandbox user cannot run apt anyway and installs with ``pip`` into ~/.local.
    if (rootfs / "etc/apt").is_dir():
        _write_atomic(rootfs / "etc/apt/sources.list",
                      "# no package sources: use pip (user installs)\n")
    _shrink(rootfs)
    # Whatever the build left in /root or /home is not for sandboxes; the engine makes
    # the real home and workspace per sandbox, these are only mountpoints.
    for d in ("root", "home"):
        _empty_dir(rootfs / d)
    for d in (SANDBOX_HOME, WORKSPACE):
        (rootfs / d.lstrip("/")).mkdir(mode=0o755, parents=True, exist_ok=True)
    _make_world_readable(rootfs)
    return find_python(rootfs)


def find_python(rootfs: Path) -> str | None:
    """The path of python3 inside ``rootfs``, as the sandbox sees it, or ``None``."""
    for candidate in _PYTHON_CANDIDATES:
        path = Path(rootfs) / candidate.lstrip("/")
        for _ in range(16):  # follow links as inside the image (absolute = from rootfs)
            if not path.is_symlink():
                break
            target = os.readlink(path)
            path = (Path(rootfs) / target.lstrip("/")) if target.startswith("/") \
                else path.parent / target
        if path.is_file():
            return candidate
    return None


def _debootstrap(codename: str, target: Path, mirror: str, log: Log) -> None:
    if shutil.which("debootstrap") is None:
        raise InternalError("debootstrap is not installed; install it (apt-get install "
                            "debootstrap) to build the default image")
    cmd = ["debootstrap", "--variant=minbase", "--include=" + ",".join(DEFAULT_PACKAGES),
           codename, str(target), mirror]
    # A clean environment: nothing of the caller's (tokens, paths, locale) may end up in
    # the image through maintainer scripts.
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root",
           "DEBIAN_FRONTEND": "noninteractive"}
    env.update({k: os.environ[k] for k in _BUILD_ENV_PASSTHROUGH if k in os.environ})
    log(f"running debootstrap for {codename} into {target}")
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", env=env,
                            start_new_session=True)
    timer = threading.Timer(DEBOOTSTRAP_TIMEOUT, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            if _is_progress_line(line):
                log("  " + line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        output = "\n".join(tail)
        with contextlib.suppress(OSError):
            log_tail = (target / "debootstrap/debootstrap.log").read_text().splitlines()[-20:]
            output += "\n--- debootstrap.log ---\n" + "\n".join(log_tail)
        raise InternalError(
            f"debootstrap failed (exit {rc}) building the default image from {mirror}; "
            f"check the mirror (or set {MIRROR_ENV}) and the network. Last output:\n{output}",
            details={"exit_code": rc},
        )


def _is_progress_line(line: str) -> bool:
    """debootstrap's stage lines and warnings, not its lines about each package."""
    if line.startswith(("W:", "E:")):
        return True
    return line.startswith("I:") and not _PER_PACKAGE_LINE.match(line)


def _add_sandbox_user(rootfs: Path) -> None:
    days = int(time.time() // 86400)
    entries = {
        "etc/passwd": f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:{SANDBOX_USER}:"
                      f"{SANDBOX_HOME}:/bin/bash",
        "etc/group": f"{SANDBOX_USER}:x:{SANDBOX_GID}:",
        "etc/shadow": f"{SANDBOX_USER}:!:{days}:0:99999:7:::",
        "etc/gshadow": f"{SANDBOX_USER}:!::",
    }
    for rel, entry in entries.items():
        path = rootfs / rel
        if not path.exists() and rel.endswith("gshadow"):
            continue
        numeric_id = {"etc/passwd": SANDBOX_UID, "etc/group": SANDBOX_GID}.get(rel)
        kept = []
        for line in path.read_text().splitlines():
            fields = line.split(":")
            if fields[0] == SANDBOX_USER:
                continue
            if numeric_id is not None and len(fields) > 2 and fields[2] == str(numeric_id):
                continue  # whoever held id 1000 makes way for the sandbox user
            kept.append(line)
        st = path.stat()
        _write_atomic(path, "\n".join([*kept, entry]) + "\n", mode=stat.S_IMODE(st.st_mode))
        os.chown(path, st.st_uid, st.st_gid)  # /etc/shadow belongs to group shadow


def _shrink(rootfs: Path) -> None:
    """Drop what a sandbox never reads: package lists and caches, docs, translations."""
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin",
                    "var/cache/apt/archives/*.deb", "var/cache/apt/archives/partial/*",
                    "var/cache/debconf/*-old", "var/lib/dpkg/*-old",
                    "usr/share/man/*", "usr/share/info/*", "usr/share/lintian/*",
                    "var/log/*.log", "var/log/apt/*"):
        for path in glob.glob(str(rootfs / pattern)):
            if os.path.basename(path) in ("partial", "lock"):
                continue
            _rm(Path(path))
    # Docs go, copyright files stay (the licences travel with the binaries).
    doc = rootfs / "usr/share/doc"
    if doc.is_dir():
        for pkg in doc.iterdir():
            if pkg.is_dir() and not pkg.is_symlink():
                for child in pkg.iterdir():
                    if child.name != "copyright":
                        _rm(child)
    # Message catalogues only; locale.alias and the C.UTF-8 locale (usr/lib/locale) stay.
    locale = rootfs / "usr/share/locale"
    if locale.is_dir():
        for entry in locale.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                _rm(entry)


def _make_world_readable(rootfs: Path) -> None:
    """o+r on files, o+rx on directories: the sandbox user sees host root's as nobody's."""
    private = {rootfs / p for p in _PRIVATE_PATHS}
    for dirpath, dirnames, filenames in os.walk(rootfs):
        base = Path(dirpath)
        dirnames[:] = [d for d in dirnames if base / d not in private]
        for name in dirnames:
            _add_mode(base / name, 0o005)
        for name in filenames:
            if base / name not in private:
                _add_mode(base / name, 0o004)


def _add_mode(path: Path, bits: int) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o100:
        bits |= 0o001  # executables stay executable for everyone
    if stat.S_IMODE(st.st_mode) & bits != bits:
        os.chmod(path, stat.S_IMODE(st.st_mode) | bits)


def _installed_packages(rootfs: Path) -> list[str]:
    """``name:arch=version`` of every installed package, from dpkg's status file."""
    packages = []
    try:
        text = (rootfs / "var/lib/dpkg/status").read_text()
    except OSError:
        return []
    for stanza in _deb822_stanzas(text):
        if "installed" in stanza.get("status", "").split():
            packages.append(f"{stanza.get('package')}:{stanza.get('architecture')}="
                            f"{stanza.get('version')}")
    return sorted(packages)


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    """Parse deb822 text into stanzas of lower-cased field names (continuations joined)."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
            continue
        if raw[0] in " \t":
            if key is not None:
                current[key] += " " + raw.strip()
            continue
        name, sep, value = raw.partition(":")
        if sep:
            key = name.strip().lower()
            current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


# -- filesystem helpers --------------------------------------------------------------------


@contextlib.contextmanager
def _flock(path: Path, on_wait: Callable[[], Any] | None = None) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """tmp file + fsync + rename: ``path`` holds the old text or the new, never half.

    Inside a rootfs this is also safe from symlinks: the rename replaces a link at
    ``path`` instead of writing through it to wherever it points.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _empty_dir(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        if os.path.lexists(path):
            _rm(path)
        path.mkdir(mode=0o755)
        return
    for child in path.iterdir():
        _rm(child)


def _scan_tree(rootfs: Path) -> tuple[int, str]:
    """Apparent size (hard links once) and a sha256 of the tree's listing."""
    digest = hashlib.sha256()
    seen: set[tuple[int, int]] = set()
    size = 0
    for dirpath, dirnames, filenames in os.walk(rootfs):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, rootfs)
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            digest.update(f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0"
                          f"{st.st_mtime_ns}\0{link}\n".encode("utf-8", "surrogateescape"))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                size += st.st_size
    return size, digest.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, only not ours
    return True


def _mounts_below(path: Path) -> list[str]:
    return syscalls.mounts_under(str(path.resolve()) if path.exists() else str(path))


def _unmount_below(path: Path) -> None:
    """Unmount whatever an interrupted debootstrap left mounted (proc, sys, dev) in ``path``."""
    for mountpoint in _mounts_below(path):  # deepest first
        try:
            syscalls.umount(mountpoint, lazy=True)
        except OSError:
            pass


def _remove_tree(path: Path) -> None:
    """Delete ``path``; refuses to descend into anything still mounted below it."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink():
        _unmount_below(path)
        if _mounts_below(path):
            raise InternalError(f"cannot delete {path}: something is still mounted below it",
                                details={"path": str(path)})
    _rm(path)


def _rm(path: Path) -> None:
    """Delete a file, link or tree inside a rootfs that has nothing mounted in it."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        os.unlink(path)
