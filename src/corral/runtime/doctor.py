"""Is this machine ready to run corral? The probes of ``corral doctor``.

Each check is the engine's own probe where it has one (cgroups: :func:`cgroups.detect`;
seccomp: :func:`seccomp.build_filter`; room: :mod:`.storage`'s minimum; the agent:
:func:`agentbuild.agent_path`; images: :class:`ImageStore`), and reads only: nothing
is created, built or mounted. A failing check says how to fix it.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from corral.errors import CorralError
from corral.runtime import cgroups, criu, seccomp, storage
from corral.runtime import gpus as gpu_inventory
from corral.runtime.agentbuild import agent_path
from corral.runtime.images import DEFAULT_IMAGE, ImageStore
from corral.runtime.paths import Layout, default_cache_dir, default_state_dir

OK, WARN, FAIL = "OK", "WARN", "FAIL"
MIN_KERNEL = (5, 19)  # idmapped overlay lower layers; cgroup.kill, memory.peak
LOW_DISK_BYTES = 2 << 30
LOW_MEMORY_BYTES = 1 << 30
INSTALL = "run scripts/install.sh (or: make install), which installs what corral needs"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def kernel(release: str | None = None) -> Check:
    release = release or platform.release()
    try:
        version = tuple(int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return Check("kernel", WARN, f"Linux {release}: cannot tell its version")
    if version >= MIN_KERNEL:
        return Check("kernel", OK, f"Linux {release} (idmapped mounts, cgroup.kill)")
    need = ".".join(map(str, MIN_KERNEL))
    return Check("kernel", FAIL, f"Linux {release} is older than {need}",
                 f"boot a Linux {need} or newer kernel (idmapped overlay layers need it)")


def user_namespaces(proc_sys: str = "/proc/sys") -> Check:
    limit = _read(f"{proc_sys}/user/max_user_namespaces")
    if limit is not None and limit.isdigit() and int(limit) == 0:
        return Check("user namespaces", FAIL, "user.max_user_namespaces is 0: none may be made",
                     "sysctl -w user.max_user_namespaces=15000 (and in /etc/sysctl.d/ to keep it)")
    notes = []
    if _read(f"{proc_sys}/kernel/unprivileged_userns_clone") == "0":
        notes.append("kernel.unprivileged_userns_clone=0 (root may still make them)")
    if _read(f"{proc_sys}/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return Check("user namespaces", WARN,
                     "kernel.apparmor_restrict_unprivileged_userns=1: AppArmor may refuse "
                     "bubblewrap's namespaces",
                     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor "
                     "profile allowing userns for /usr/bin/bwrap")
    if limit is None:
        return Check("user namespaces", FAIL, "the kernel has no user namespaces",
                     "boot a kernel built with CONFIG_USER_NS=y")
    detail = f"user.max_user_namespaces={limit}" + (f"; {notes[0]}" if notes else "")
    return Check("user namespaces", OK, detail)


def overlayfs(filesystems: str = "/proc/filesystems") -> Check:
    text = _read(filesystems) or ""
    if any(line.split()[-1:] == ["overlay"] for line in text.splitlines()):
        return Check("overlayfs", OK, "overlay is in /proc/filesystems")
    if Path(f"/lib/modules/{platform.release()}/kernel/fs/overlayfs").exists():
        return Check("overlayfs", WARN, "the overlay module is not loaded yet (loaded on use)",
                     "modprobe overlay")
    return Check("overlayfs", FAIL, "the kernel has no overlay filesystem",
                 "modprobe overlay, or boot a kernel with CONFIG_OVERLAY_FS")


def cgroup_controllers(mountinfo: str = cgroups.MOUNTINFO) -> Check:
    try:
        driver = cgroups.detect(mountinfo=mountinfo)
    except CorralError as exc:
        return Check("cgroups", FAIL, exc.message,
                     "boot with systemd.unified_cgroup_hierarchy=1 (cgroup v2) or mount the "
                     f"v1 controllers {', '.join(cgroups.V1_CONTROLLERS)}")
    controllers = cgroups.V2_CONTROLLERS if driver.version == 2 else cgroups.V1_CONTROLLERS
    return Check("cgroups", OK, f"cgroup v{driver.version} with {', '.join(controllers)}")


def seccomp_filter(status: str = "/proc/self/status") -> Check:
    text = _read(status) or ""
    if "Seccomp:" not in text:
        return Check("seccomp", FAIL, "the kernel has no seccomp",
                     "boot a kernel built with CONFIG_SECCOMP_FILTER=y")
    try:
        seccomp.build_filter()
    except CorralError as exc:
        return Check("seccomp", FAIL, exc.message, "corral supports x86_64 and aarch64")
    return Check("seccomp", OK, f"filter built for {platform.machine()}")


def bubblewrap() -> Check:
    path = shutil.which("bwrap")
    if path is None:
        return Check("bubblewrap", FAIL, "bwrap is not on PATH",
                     f"apt-get install bubblewrap (or dnf install bubblewrap); {INSTALL}")
    return Check("bubblewrap", OK, path)


def nftables() -> Check:
    """Sandboxes with an egress policy need nft and ip (docs/network.md); the rest not."""
    missing = [tool for tool in ("nft", "ip") if shutil.which(tool) is None]
    if missing:
        return Check("nftables", WARN, f"{' and '.join(missing)} not on PATH: sandboxes with "
                     "a network policy cannot start (network='none' and 'host' can)",
                     f"apt-get install nftables iproute2; {INSTALL}")
    return Check("nftables", OK, shutil.which("nft") or "nft")


def gpus(backend: "gpu_inventory.GpuBackend | None" = None) -> Check:
    """The NVIDIA GPUs sandboxes could get (``gpus=``), and the driver's files found."""
    backend = backend if backend is not None else gpu_inventory.detect()
    found = backend.devices()
    if not found:
        if Path("/dev/nvidiactl").exists():
            return Check("gpus", WARN, "an NVIDIA driver is loaded but NVML found no GPU "
                         "usable by corral: gpus= fails", "pip install nvidia-ml-py")
        return Check("gpus", OK, "no NVIDIA GPU on this host: sandboxes asking for gpus= "
                     "fail with invalid_argument; everything else works")
    files = backend.driver_files()
    names = ", ".join(f"{g.index}: {g.name}" for g in found)
    detail = (f"{len(found)} GPU(s) ({names}); driver {files.version}: "
              f"{len(files.libraries)} libraries, {len(files.tools)} tools, "
              f"{len(files.control_nodes)} control nodes")
    if not any(soname.startswith("libcuda.so") for _, soname in files.libraries):
        return Check("gpus", WARN, detail + "; libcuda not found in the ldconfig cache: "
                     "CUDA will not load inside", "run ldconfig; check the driver install")
    return Check("gpus", OK, detail)


def root() -> Check:
    if os.geteuid() == 0:
        return Check("root", OK, "running as root (the daemon needs it)")
    return Check("root", WARN, "not root: the daemon must run as root, and some checks "
                 "need it", "sudo corral doctor")


def agent(layout: Layout) -> Check:
    path = agent_path(layout)
    if path.exists():
        return Check("agent", OK, str(path))
    if shutil.which("gcc") or shutil.which("cc"):
        return Check("agent", WARN, "not built yet: the daemon builds it when it starts",
                     "python -m corral.runtime.prepare (builds it and the images now)")
    return Check("agent", FAIL, "not built, and there is no C compiler to build it",
                 f"apt-get install gcc libc6-dev; {INSTALL}")


def images(layout: Layout) -> Check:
    if not layout.images_dir.exists():
        names: list[str] = []
    else:
        try:
            names = [i.name for i in ImageStore(layout.images_dir).list()]
        except (OSError, CorralError) as exc:
            return Check("images", WARN, f"cannot read {layout.images_dir}: {exc}",
                         "sudo corral doctor")
    if DEFAULT_IMAGE in names:
        return Check("images", OK, ", ".join(names))
    return Check("images", WARN,
                 f"no {DEFAULT_IMAGE!r} image yet: the first create builds it (minutes)",
                 "python -m corral.runtime.prepare (needs debootstrap and a Debian mirror)")


def live_checkpoints(layout: Layout, *, run_check: bool | None = None) -> Check:
    """Whether ``sb.checkpoint()`` can work here: the cached CRIU (docs/live.md) found and
    ``criu check`` passing (run only as root: it needs to be)."""
    found = criu.find(layout.cache_dir)
    if found is None:
        need = ".".join(map(str, criu.MIN_VERSION))
        return Check("live checkpoints", WARN,
                     f"no CRIU >= {need} under {layout.cache_dir / 'criu'}: checkpoint() "
                     "fails with 'unsupported'; everything else works", criu.BUILD)
    if run_check is None:
        run_check = os.geteuid() == 0
    if not run_check:
        return Check("live checkpoints", WARN,
                     f"CRIU {found.version_text} at {found.path}; `criu check` needs root",
                     "sudo corral doctor")
    ok, output = criu.check(found)
    if ok and not found.redumps:
        return Check("live checkpoints", WARN,
                     f"CRIU {found.version_text} at {found.path} passed criu check but lacks "
                     "corral's patch: a restored copy cannot be checkpointed again", criu.BUILD)
    if ok:
        return Check("live checkpoints", OK,
                     f"CRIU {found.version_text} at {found.path}: criu check passed")
    return Check("live checkpoints", WARN,
                 f"CRIU {found.version_text}: criu check failed ({output})",
                 "a kernel with CONFIG_CHECKPOINT_RESTORE=y; see `criu check --all` and "
                 "docs/live.md")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk(name: str, path: Path) -> Check:
    where = _existing(path)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    text = f"{free / (1 << 30):.1f} GiB free under {path}"
    if free < storage.MIN_FREE_BYTES or (st.f_files and st.f_favail < storage.MIN_FREE_INODES):
        return Check(name, FAIL, text, f"free space on the filesystem of {where}")
    if free < LOW_DISK_BYTES:
        return Check(name, WARN, text, f"free space on the filesystem of {where} "
                     "(images and sandboxes' files need several GiB)")
    return Check(name, OK, text)


def memory(meminfo: str = "/proc/meminfo") -> Check:
    fields = {}
    for line in (_read(meminfo) or "").splitlines():
        key, _, value = line.partition(":")
        if value.split():
            fields[key] = int(value.split()[0]) * 1024
    available = fields.get("MemAvailable")
    if available is None:
        return Check("memory", WARN, f"cannot read MemAvailable from {meminfo}")
    text = f"{available / (1 << 30):.1f} GiB available of {fields.get('MemTotal', 0) / (1 << 30):.1f}"
    if available < LOW_MEMORY_BYTES:
        return Check("memory", WARN, text, "free memory: every sandbox needs its memory_mb")
    return Check("memory", OK, text)


def run_checks(state_dir: Path | None = None, cache_dir: Path | None = None) -> list[Check]:
    """Every check of the host (the daemon's is the CLI's: it needs a client)."""
    layout = Layout(Path(state_dir or default_state_dir()).absolute(),
                    Path(cache_dir or default_cache_dir()).absolute())
    return [
        root(), kernel(), user_namespaces(), overlayfs(), cgroup_controllers(),
        seccomp_filter(), bubblewrap(), nftables(), agent(layout), images(layout),
        disk("state dir", layout.state_dir), disk("cache dir", layout.cache_dir), memory(),
        gpus(), live_checkpoints(layout),
    ]
