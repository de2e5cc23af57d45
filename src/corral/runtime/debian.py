"""The default image: Debian (the host's release) by ``debootstrap``, made fit for sandboxes.

Post-processing adds the ``sandbox`` user (uid 1000), removes what a sandbox never
reads (package lists, docs, translations), makes every file world-readable (the
sandbox user sees host root's files as nobody's) and removes the PEP 668 marker, so
``pip install`` in a sandbox falls back to a user install in ``~/.local``.

Environment variables (read only here):
- ``CORRAL_DEBIAN_MIRROR``: the Debian mirror URL to build the default image from.
  Default: the first mirror of the host's release (``main`` component) found in the
  host's apt sources (``/etc/apt/sources.list.d/*.sources``, ``/etc/apt/sources.list``,
  ``/etc/apt/sources.list.d/*.list``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.errors import InternalError
from corral.runtime.fsutil import _empty_dir, _rm, _write_atomic
from corral.runtime.treecopy import ENTER, LEAVE, Walk, fd_path

DEFAULT_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
DEBOOTSTRAP_TIMEOUT = 30 * 60
MIRROR_ENV = "CORRAL_DEBIAN_MIRROR"

SANDBOX_USER = "sandbox"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_HOME = "/home/sandbox"
WORKSPACE = "/workspace"

_PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
# Files that stay private inside an image: no sandbox process needs them.
_PRIVATE_PATHS = ("etc/shadow", "etc/shadow-", "etc/gshadow", "etc/gshadow-", "root")
_PER_PACKAGE_LINE = re.compile(
    r"I: (Retrieving|Validating|Extracting|Unpacking|Configuring) (?!.*packages)")
_BUILD_ENV_PASSTHROUGH = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY",
                          "HTTPS_PROXY", "NO_PROXY")

Log = Callable[[str], Any]


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


def _debootstrap(
    codename: str, target: Path, mirror: str, log: Log, packages: tuple[str, ...] = DEFAULT_PACKAGES
) -> None:
    cmd = ["debootstrap", "--variant=minbase", "--include=" + ",".join(packages),
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
                            start_new_session=True, umask=0o022)  # not the caller's (077?)
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
            f"debootstrap failed (exit {rc}) building an image from {mirror}; "
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
    """o+r on files, o+rx on directories: the sandbox user sees host root's as nobody's.
    Iterative and descriptor-relative (:class:`~corral.runtime.treecopy.Walk`): an
    image's tree may be thousands of levels deep (os.walk recursed past Python's limit:
    an import or a pull was a 500)."""
    private = {tuple(p.split("/")) for p in _PRIVATE_PATHS if "/" in p}
    tops = frozenset(p for p in _PRIVATE_PATHS if "/" not in p)
    walk = Walk(rootfs, skip=tops, max_depth=None)
    for event, parent, name, st, fd in walk:
        if event == LEAVE or parent == -1 or stat.S_ISLNK(st.st_mode):
            continue
        if event == ENTER:
            _add_mode(st, 0o005, fd)
        elif len(walk.names) != 1 or (walk.names[0], name) not in private:
            _add_mode(st, 0o004, fd_path(parent, name))


def _add_mode(st: os.stat_result, bits: int, where: int | str) -> None:
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o100:
        bits |= 0o001  # executables stay executable for everyone
    if stat.S_IMODE(st.st_mode) & bits != bits:
        os.chmod(where, stat.S_IMODE(st.st_mode) | bits)


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


