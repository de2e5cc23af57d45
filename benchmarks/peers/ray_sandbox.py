"""Ray's own sandboxes (``ray.experimental.sandbox``, ray 2.60), in-process runtime.

They need three things bookworm does not have, all checked before anything starts:
``mkfs.erofs`` from erofs-utils 1.7 or later (Ray builds every image into an EROFS
file with ``mkfs.erofs --tar``; bookworm ships 1.5, which has no ``--tar``), a runsc
that can boot an EROFS root filesystem (Ray passes it through the
``dev.gvisor.spec.rootfs.*`` annotations, which bookworm's runsc 20221219 predates),
and the ``ray`` package itself. ``setup_ray_sandbox.py`` (run by ``make bench``) puts
trixie's erofs-utils and bookworm-backports' runsc in a private prefix
(:func:`tools_dir`); :func:`use_tools` puts them first on this process's PATH, which
is where Ray looks for them. Sandboxes are made with ``SandboxRuntime.create`` from a
flat tar of the corral image, with an explicit ``PATH`` (a flat tar carries no image
config). Ray writes to fixed paths under /tmp and can leave ``ray-sandbox-*`` cgroups
behind; :class:`RayLeftovers` removes what a run made (and only that).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from peers import Peer, Skip, first_line

RUNSC_EROFS_MARKER = b"dev.gvisor.spec.rootfs"
PATH = "/usr/local/bin:/usr/bin:/bin"
EROFS_MIN_VERSION = "1.7"  # mkfs.erofs --tar
RUNSC_MIN_VERSION = "0.0~20240101"  # bookworm's 0.0~20221219 cannot boot an EROFS root
TOOLS_FILE = "tools.json"


def tools_dir() -> Path:
    """Where ``setup_ray_sandbox.py`` keeps Ray's tools: ``CORRAL_RAY_SANDBOX_TOOLS``, else
    ``bench/ray-sandbox`` in corral's cache directory."""
    if os.environ.get("CORRAL_RAY_SANDBOX_TOOLS"):
        return Path(os.environ["CORRAL_RAY_SANDBOX_TOOLS"])
    from corral.runtime.paths import default_cache_dir

    return default_cache_dir() / "bench" / "ray-sandbox"


def tools_bin() -> str | None:
    """The bin directory ``setup_ray_sandbox.py`` filled, if it did."""
    try:
        found = json.loads((tools_dir() / TOOLS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return found.get("bin") if isinstance(found, dict) else None


def use_tools() -> None:
    """Put the private tools first on PATH (Ray finds runsc and mkfs.erofs there); processes
    started afterwards (a Ray cluster's raylets and workers) inherit it."""
    extra = tools_bin()
    path = os.environ.get("PATH", "")
    if extra and extra not in path.split(os.pathsep):
        os.environ["PATH"] = extra + os.pathsep + path


def flat_tar(rootfs: Path, tar: Path) -> None:
    """The image's root as a flat tar (what Ray's ``image=`` takes). GNU tar's status 1
    only says a file changed while it was read (its times, when another process touches
    the shared image): the tar is still whole."""
    r = subprocess.run(["tar", "-C", str(rootfs), "--warning=no-file-changed", "-cf", str(tar),
                        "."], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        tar.unlink(missing_ok=True)
        raise RuntimeError(f"tar of {rootfs} failed: {r.stderr.strip()[-300:]}")


def runsc_boots_erofs(runsc: str) -> bool:
    return binary_contains(os.path.realpath(runsc), RUNSC_EROFS_MARKER)


def binary_contains(path: str, needle: bytes, chunk: int = 1 << 22) -> bool:
    tail = b""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if needle in tail + block:
                return True
            tail = block[-len(needle):]
    return False


def missing_prerequisites() -> list[str]:
    use_tools()
    problems = []
    hint = ("" if tools_bin() else
            f" (python3 benchmarks/setup_ray_sandbox.py fetches it into {tools_dir()})")
    mkfs = shutil.which("mkfs.erofs") or shutil.which("mkfs.erofs", path="/usr/sbin:/sbin")
    if not mkfs:
        problems.append("mkfs.erofs is not installed (Ray needs erofs-utils >= 1.7; "
                        "Debian 12 has 1.5, Debian 13 has a new enough one)" + hint)
    else:
        helptext = subprocess.run([mkfs, "--help"], capture_output=True, text=True)
        if "--tar" not in helptext.stdout + helptext.stderr:
            problems.append(f"{mkfs} ({first_line([mkfs, '--version']) or 'old'}) has no "
                            "--tar: Ray needs erofs-utils >= 1.7, Debian 12 has 1.5" + hint)
    runsc = shutil.which("runsc")
    if not runsc:
        problems.append("runsc is not installed" + hint)
    elif not runsc_boots_erofs(runsc):
        problems.append(f"{first_line([runsc, '--version']) or 'this runsc'} cannot boot an "
                        "EROFS root (no dev.gvisor.spec.rootfs annotations): Ray needs a newer "
                        "runsc (bookworm-backports or gVisor's own release)" + hint)
    if importlib.util.find_spec("ray") is None:
        problems.append("the ray package is not installed (pip install -e '.[ray]')")
    return problems


FIXED_DIRS = ("/tmp/ray/sandbox/images", "/tmp/ray/sandbox", "/tmp/runsc")
CGROUP_GLOBS = ("/sys/fs/cgroup/*/ray-sandbox-*", "/sys/fs/cgroup/*/*/ray-sandbox-*")
SANDBOX_ID = re.compile(r"ray-sandbox-[0-9a-f]{12}")


def _listing(d: str) -> set[str] | None:
    try:
        return set(os.listdir(d))
    except OSError:
        return None


def _cgroups() -> set[str]:
    return {p for pattern in CGROUP_GLOBS for p in glob.glob(pattern)}


def _runsc_pids(ids: set[str]) -> list[int]:
    """Live processes whose command line names one of ``ids`` (sandboxes of this run)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "runsc" in cmd and any(i in cmd for i in ids):
            found.append(int(entry))
    return found


class RayLeftovers:
    """What Ray's sandboxes leave on the host, as it stood before this run. Only entries
    that are new *and* named after this run (a sandbox id it made, its image's name) are
    removed: others may be using Ray's sandboxes on this host at the same time."""

    def __init__(self, image_name: str) -> None:
        self.before = {d: _listing(d) for d in FIXED_DIRS}
        self.cgroups = _cgroups()
        self.image_name = image_name
        self.ids: set[str] = set()  # sandbox ids this run made

    @contextlib.contextmanager
    def noting(self) -> Iterator[None]:
        """Note the ids a failed create names (Ray says which sandbox timed out)."""
        try:
            yield
        except Exception as exc:
            self.ids.update(SANDBOX_ID.findall(str(exc)))
            raise

    def ours(self, name: str) -> bool:
        return self.image_name in name or any(i in name for i in self.ids)

    def new_cgroups(self) -> list[str]:
        return sorted((cg for cg in _cgroups() - self.cgroups if self.ours(os.path.basename(cg))),
                      key=len, reverse=True)

    def clean(self) -> list[str]:
        """Remove what appeared since ``__init__``; say what had to be removed by force."""
        forced = []
        for pid in _runsc_pids(self.ids):  # a create that timed out can leave these
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                forced.append(f"runsc process {pid}")
        for sid in self.ids:  # runsc's own state for a container it did not delete
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(["runsc", "--root", "/tmp/runsc", "delete", "-force", sid],
                               capture_output=True, timeout=10)
        for d, before in self.before.items():
            now = _listing(d)
            if now is None:
                continue
            for name in sorted(now - (before or set())):
                if not self.ours(name):
                    continue
                path = os.path.join(d, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        for d, before in self.before.items():  # directories this run created, if now empty
            if before is None:
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        new = self.new_cgroups()
        if new:  # Ray leaves these behind even after a clean delete, now and then
            names = sorted({os.path.basename(cg) for cg in new})
            forced.append(f"{len(new)} cgroups of {', '.join(names)}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # a cgroup empties once its processes are reaped
            left = self.new_cgroups()
            for cg in left:
                with contextlib.suppress(OSError):
                    os.rmdir(cg)
            if not self.new_cgroups():
                break
            time.sleep(0.1)
        forced += [f"cgroup {cg} (could not be removed)" for cg in self.new_cgroups()]
        return forced


class RaySandboxPeer(Peer):
    name = "ray_sandbox"
    title = "Ray sandboxes (in-process runtime)"
    slow = True

    def check(self) -> None:
        problems = missing_prerequisites()
        if problems:
            raise Skip("; ".join(problems))

    def version(self) -> str:
        import ray

        return f"ray {ray.__version__}"

    def setup(self) -> None:
        from ray.experimental.sandbox.runtime import SandboxRuntime

        # a name of this run's own: Ray caches the built image under the tar's name
        self.tar = self.ctx.workdir / f"corral-peer-{os.getpid()}.tar"
        flat_tar(Path(self.ctx.rootfs), self.tar)
        self.leftovers = RayLeftovers(self.tar.stem)
        self.rt = SandboxRuntime()
        self.rt.pull_image(str(self.tar), timeout_seconds=300)  # the EROFS build, once

    def teardown(self) -> None:
        self.leftovers.clean()

    def _create(self) -> str:
        with self.leftovers.noting():
            sid: str = self.rt.create(image=str(self.tar), env={"PATH": PATH},
                                      timeout_seconds=60)
        self.leftovers.ids.add(sid)
        return sid

    def cycle(self) -> None:
        sid = self._create()
        try:
            self.exec_true(sid)
        finally:
            self.rt.delete(sid)

    def start_idle(self) -> str:
        return self._create()

    def exec_true(self, handle: str) -> None:
        r = self.rt.exec(handle, ["true"], timeout=30)
        if r.exit_code != 0:
            raise RuntimeError(f"true failed in Ray sandbox {handle}: {r!r}")

    def stop_idle(self, handles: list[Any]) -> None:
        for sid in handles:
            self.rt.delete(sid)


PEER = RaySandboxPeer
