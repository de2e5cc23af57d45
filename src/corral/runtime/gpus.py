"""GPUs for sandboxes: the host's NVIDIA GPUs, who holds which, and what a sandbox that
holds some is given.

Three parts, kept apart so that each can be tested without the others:

- an **inventory** (:class:`GpuBackend`): the host's GPUs, found through NVML
  (:class:`NvmlBackend`, ``nvidia-ml-py``, never by parsing ``nvidia-smi``), or a
  :class:`StaticBackend` given the devices and driver files outright (hosts whose NVML
  cannot be loaded; tests, with character devices they made);
- the **assignment** (:class:`GpuAllocator`): exclusive by default, shared between
  sandboxes only when a sandbox asks for it (``gpu_shared=True``; a GPU held
  exclusively is never shared, a shared one never given exclusively);
- the **grant** (:class:`GpuGrant`): what a sandbox holding GPUs gets — its device
  nodes (``/dev/nvidia<minor>`` of its GPUs only, plus ``nvidiactl``, ``nvidia-uvm``
  and ``nvidia-uvm-tools``), the driver's user-space libraries bound read-only under
  ``/usr/local/nvidia/lib64`` and its tools (``nvidia-smi``) under
  ``/usr/local/nvidia/bin``, found the way ``nvidia-container-cli`` finds them (the
  ldconfig cache, filtered by the driver's version), and the environment
  (``CUDA_VISIBLE_DEVICES``, ``NVIDIA_VISIBLE_DEVICES``, ``LD_LIBRARY_PATH``, ``PATH``).

Why device access stays limited to the assigned GPUs: a sandbox's ``/dev`` is its own
(bubblewrap's ``--dev``), it holds only the nodes bound here, and nothing inside can make
another (no ``CAP_MKNOD``, and device nodes made in a user namespace cannot be opened).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from corral.errors import InvalidArgument, NoGpuCapacity, Unsupported

log = logging.getLogger("corral.runtime")

LIB_DIR = "/usr/local/nvidia/lib64"  # where a sandbox finds the driver's libraries
BIN_DIR = "/usr/local/nvidia/bin"  # and its tools
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
# The driver's user-space libraries a compute or utility job loads (nvidia-container-cli's
# "utility" and "compute" sets); matched by soname prefix in the ldconfig cache.
DRIVER_LIBS = (
    "libnvidia-ml.so", "libnvidia-cfg.so", "libcuda.so", "libcudadebugger.so",
    "libnvidia-opencl.so", "libnvidia-gpucomp.so", "libnvidia-ptxjitcompiler.so",
    "libnvidia-fatbinaryloader.so", "libnvidia-allocator.so", "libnvidia-compiler.so",
    "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so", "libnvidia-nvvm.so",
)
DRIVER_TOOLS = ("nvidia-smi", "nvidia-debugdump")
_LDCONFIG_LINE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")


@dataclass(frozen=True)
class GpuDevice:
    """One GPU: its index (NVML's order), identity, and its device node on the host."""

    index: int
    uuid: str
    name: str
    minor: int
    memory_mb: int
    node: Path  # the host's /dev/nvidia<minor>

    @property
    def sandbox_node(self) -> str:
        return f"/dev/nvidia{self.minor}"


@dataclass(frozen=True)
class DriverFiles:
    """The driver's files a sandbox gets: control nodes, libraries, tools (host paths,
    each with the name it has inside), and the driver's version."""

    version: str | None = None
    control_nodes: tuple[tuple[Path, str], ...] = ()  # (host node, /dev/NAME)
    libraries: tuple[tuple[Path, str], ...] = ()  # (host file, soname)
    tools: tuple[tuple[Path, str], ...] = ()  # (host file, name)


class GpuBackend(Protocol):
    """Where the inventory comes from."""

    def devices(self) -> list[GpuDevice]: ...

    def driver_files(self) -> DriverFiles: ...

    def memory_used_mb(self, pids: Iterable[int]) -> dict[int, int]:
        """MiB of GPU memory the processes ``pids`` hold, by GPU index."""
        ...

    def utilization(self, indices: Iterable[int]) -> dict[int, int]:
        """Percent of the last sample period each GPU was busy, by GPU index."""
        ...


@dataclass
class StaticBackend:
    """An inventory given outright: no NVML (a host whose NVML cannot be loaded, or tests
    with character devices they made)."""

    gpus: list[GpuDevice] = field(default_factory=list)
    files: DriverFiles = field(default_factory=DriverFiles)

    def devices(self) -> list[GpuDevice]:
        return list(self.gpus)

    def driver_files(self) -> DriverFiles:
        return self.files

    def memory_used_mb(self, pids: Iterable[int]) -> dict[int, int]:
        return {}

    def utilization(self, indices: Iterable[int]) -> dict[int, int]:
        return {}


class NvmlBackend:
    """The host's GPUs through NVML (``pip install nvidia-ml-py``), loaded lazily."""

    def __init__(self, dev_dir: Path = Path("/dev")) -> None:
        try:
            import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError as exc:
            raise Unsupported("GPU support needs NVML's bindings: pip install nvidia-ml-py") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise Unsupported(f"no NVIDIA driver on this host (NVML: {exc})") from exc
        self._nvml: Any = pynvml
        self.dev_dir = dev_dir

    def _handles(self) -> list[Any]:
        n = self._nvml
        return [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]

    def devices(self) -> list[GpuDevice]:
        n = self._nvml
        out = []
        for i, h in enumerate(self._handles()):
            minor = n.nvmlDeviceGetMinorNumber(h)
            out.append(GpuDevice(
                index=i, uuid=_text(n.nvmlDeviceGetUUID(h)), name=_text(n.nvmlDeviceGetName(h)),
                minor=minor, memory_mb=int(n.nvmlDeviceGetMemoryInfo(h).total) >> 20,
                node=self.dev_dir / f"nvidia{minor}"))
        return out

    def driver_files(self) -> DriverFiles:
        version = _text(self._nvml.nvmlSystemGetDriverVersion())
        return find_driver_files(version, self.dev_dir)

    def memory_used_mb(self, pids: Iterable[int]) -> dict[int, int]:
        n, wanted, used = self._nvml, set(pids), {}
        for i, h in enumerate(self._handles()):
            procs = n.nvmlDeviceGetComputeRunningProcesses(h)
            mine = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in wanted)
            if mine:
                used[i] = mine >> 20
        return used

    def utilization(self, indices: Iterable[int]) -> dict[int, int]:
        n, handles = self._nvml, self._handles()
        return {i: int(n.nvmlDeviceGetUtilizationRates(handles[i]).gpu)
                for i in indices if 0 <= i < len(handles)}


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def detect() -> GpuBackend:
    """NVML's inventory where a driver and ``nvidia-ml-py`` are there, else an empty one."""
    if not Path("/dev/nvidiactl").exists():
        return StaticBackend()
    try:
        return NvmlBackend()
    except Unsupported as exc:
        log.warning("GPUs present but not usable by corral: %s", exc.message)
        return StaticBackend()


# ------------------------------------------------------------------ driver files


def parse_ldconfig(text: str, arch: str = "x86-64") -> dict[str, Path]:
    """``ldconfig -p``'s cache listing as soname → path, for one architecture (the first
    entry of a name wins, as the dynamic loader's order)."""
    found: dict[str, Path] = {}
    for line in text.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m and arch in m.group(2):
            found.setdefault(m.group(1), Path(m.group(3)))
    return found


def find_driver_files(version: str | None, dev_dir: Path = Path("/dev"),
                      ldconfig_text: str | None = None) -> DriverFiles:
    """The driver's libraries and tools as ``nvidia-container-cli`` finds them: the
    ldconfig cache's entries for :data:`DRIVER_LIBS`, kept only where the file they
    resolve to carries the driver's ``version`` (a stale library of another driver would
    fail inside); :data:`DRIVER_TOOLS` from ``PATH``; the control nodes that exist."""
    if ldconfig_text is None:
        ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
        try:
            ldconfig_text = subprocess.run([ldconfig, "-p"], capture_output=True, text=True,
                                           timeout=10, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            ldconfig_text = ""
    cache = parse_ldconfig(ldconfig_text)
    if not any(s.startswith("libcuda.so") for s in cache):
        # a driver installed outside the cache (a read-only driver directory named by
        # LD_LIBRARY_PATH, as some GPU machines have): look where the loader would
        cache = {**scan_library_dirs(_loader_dirs()), **cache}
    libs = []
    for soname, path in sorted(cache.items()):
        if not soname.startswith(DRIVER_LIBS):
            continue
        real = Path(os.path.realpath(path))
        if version and not real.name.endswith(version) and soname != real.name:
            log.info("GPU: skipping %s (%s is not driver %s's)", soname, real, version)
            continue
        if not real.name.startswith(soname.split(".so")[0] + ".so"):  # a link elsewhere
            log.warning("GPU: skipping %s: it resolves to %s, not a library of its name",
                        soname, real)
            continue
        if real.is_file() and _trusted(real):
            libs.append((real, soname))
    tools = [(Path(p), name) for name in DRIVER_TOOLS if (p := shutil.which(name))]
    nodes = [(dev_dir / n, f"/dev/{n}") for n in CONTROL_NODES if _is_chardev(dev_dir / n)]
    return DriverFiles(version, tuple(nodes), tuple(libs), tuple(tools))


def _loader_dirs() -> list[Path]:
    """Where the dynamic loader looks besides its cache: ``LD_LIBRARY_PATH``'s
    directories, then the driver's and the distribution's usual ones."""
    named = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d.startswith("/")]
    return [Path(d) for d in (*named, LIB_DIR, "/usr/lib/x86_64-linux-gnu", "/usr/lib64")]


def scan_library_dirs(dirs: Iterable[Path]) -> dict[str, Path]:
    """soname → path for the driver's libraries found in ``dirs`` (the first directory
    that has a name wins, the loader's order): files named ``<lib>.so.<N>``."""
    found: dict[str, Path] = {}
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            if (name.startswith(DRIVER_LIBS) and re.fullmatch(r"[\w.+-]+\.so\.\d+", name)
                    and name not in found and _trusted(Path(os.path.realpath(d / name)))):
                found[name] = d / name  # (one others could write: the next directory's)
    return found


def _trusted(real: Path) -> bool:
    """Whether a library may be bound into every GPU sandbox: it and its directory are
    the admin's (root's, or the daemon's own user's) and nobody else may write them —
    a library a host user could plant or replace (a directory of LD_LIBRARY_PATH
    open to others) would run in every tenant's GPU processes. On a read-only file
    system (a driver's squashfs, whoever its files name as owner) nobody writes them."""
    for p in (real, real.parent):
        try:
            st = p.stat()
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                continue
        except OSError:
            return False
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            log.warning("GPU: skipping %s: %s is not the admin's alone (owner uid %d, "
                        "mode %o)", real.name, p, st.st_uid, st.st_mode & 0o7777)
            return False
    return True


def _is_chardev(p: Path) -> bool:
    try:
        return stat.S_ISCHR(p.stat().st_mode)
    except OSError:
        return False


# ------------------------------------------------------------------ assignment


@dataclass(frozen=True)
class GpuGrant:
    """What one sandbox was given: its GPUs and the driver's files."""

    gpus: tuple[GpuDevice, ...]
    files: DriverFiles
    shared: bool = False

    def bwrap_args(self) -> list[str]:
        """bubblewrap options (after ``--dev /dev``): the device nodes, the libraries and
        tools read-only."""
        args: list[str] = []
        for gpu in self.gpus:
            args += ["--dev-bind", str(gpu.node), gpu.sandbox_node]
        for host, inside in self.files.control_nodes:
            args += ["--dev-bind", str(host), inside]
        for host, soname in self.files.libraries:
            args += ["--ro-bind", str(host), f"{LIB_DIR}/{soname}"]
        for host, name in self.files.tools:
            args += ["--ro-bind", str(host), f"{BIN_DIR}/{name}"]
        return args

    def device_nodes(self) -> list[Path]:
        """The host's device nodes this grant opens (for the device cgroup)."""
        return [g.node for g in self.gpus] + [host for host, _ in self.files.control_nodes]

    def mount_points(self) -> list[str]:
        """The files bwrap binds the driver's files onto (made by the launcher)."""
        return ([f"{LIB_DIR}/{soname}" for _, soname in self.files.libraries]
                + [f"{BIN_DIR}/{name}" for _, name in self.files.tools])

    def env(self, spec_env: Mapping[str, str]) -> dict[str, str]:
        """The environment a sandbox holding these GPUs gets, over ``spec_env`` (the
        library and tool directories go before the spec's own paths)."""
        ids = ",".join(g.uuid for g in self.gpus)
        env = {"CUDA_VISIBLE_DEVICES": ids, "NVIDIA_VISIBLE_DEVICES": ids,
               "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
               "CORRAL_GPUS": ",".join(str(g.index) for g in self.gpus)}
        lib = spec_env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{LIB_DIR}:{lib}" if lib else LIB_DIR
        env["PATH"] = f"{BIN_DIR}:{spec_env.get('PATH') or DEFAULT_PATH}"
        if self.files.version:
            env["NVIDIA_DRIVER_VERSION"] = self.files.version
        return {**spec_env, **env}


GpuRequest = int | str | Sequence[str] | None


class GpuAllocator:
    """Who holds which GPU. Not thread-safe: the engine calls it from its event loop."""

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._gpus = {g.index: g for g in backend.devices()}
        self._files: DriverFiles | None = None
        self._exclusive: dict[int, str] = {}  # GPU index → sandbox
        self._shared: dict[int, set[str]] = {}  # GPU index → sandboxes sharing it
        self._held: dict[str, tuple[int, ...]] = {}
        self.listeners: set[Callable[[], None]] = set()  # called when GPUs are released

    @property
    def total(self) -> int:
        return len(self._gpus)

    def free(self, *, shared: bool = False) -> list[int]:
        """Indices a new exclusive (or, with ``shared``, shared) holder could get."""
        if shared:
            return [i for i in self._gpus if i not in self._exclusive]
        return [i for i in self._gpus if i not in self._exclusive and not self._shared.get(i)]

    def describe(self) -> list[dict[str, Any]]:
        """The inventory with each GPU's holders (for ``info`` and ``corral doctor``)."""
        return [{"index": g.index, "uuid": g.uuid, "name": g.name, "memory_mb": g.memory_mb,
                 "exclusive": self._exclusive.get(g.index),
                 "shared": sorted(self._shared.get(g.index, ()))}
                for g in self._gpus.values()]

    def count(self, request: GpuRequest) -> int:
        """How many GPUs ``request`` would hold (what a tenant's ``max_gpus`` counts)."""
        if request is None or request == 0:
            return 0
        if isinstance(request, str):
            return max(self.total, 1) if request == "all" else 1
        if isinstance(request, int):
            return request
        return len(list(request))

    def check(self, request: GpuRequest, *, shared: bool = False) -> None:
        """:meth:`assign`'s refusal (:class:`NoGpuCapacity`, :class:`InvalidArgument`),
        if it would refuse now; nothing is held."""
        self._pick(request, shared)

    def assign(self, sandbox_id: str, request: GpuRequest, *, shared: bool = False) -> GpuGrant | None:
        """Give ``sandbox_id`` the GPUs it asked for (a count, ``"all"``, or indices or
        UUIDs), or raise :class:`NoGpuCapacity` / :class:`InvalidArgument` holding none."""
        wanted = self._pick(request, shared)
        if not wanted:
            return None
        for i in wanted:
            if shared:
                self._shared.setdefault(i, set()).add(sandbox_id)
            else:
                self._exclusive[i] = sandbox_id
        self._held[sandbox_id] = tuple(wanted)
        if self._files is None:
            self._files = self.backend.driver_files()
        return GpuGrant(tuple(self._gpus[i] for i in wanted), self._files, shared)

    def _pick(self, request: GpuRequest, shared: bool) -> list[int]:
        if request is None or request == 0:
            return []
        if not self._gpus:  # the caller's to fix (ask another host), not the daemon's fault
            raise InvalidArgument("gpus=: this host has no usable NVIDIA GPU; create the "
                                  "sandbox without gpus= or on a GPU host (`corral doctor` "
                                  "says what it found)", details={"requested": request})
        free = self.free(shared=shared)
        asked: int | str | list[str]
        if isinstance(request, str):
            if request != "all":
                raise InvalidArgument(f"gpus={request!r}: give a count, 'all' or a list")
            asked, wanted = request, list(self._gpus)
        elif isinstance(request, int):
            if request > self.total:
                raise InvalidArgument(f"gpus={request}: this host has {self.total} GPU(s)")
            asked, wanted = request, free[:request]
        else:
            asked = list(request)
            wanted = [self._resolve(r) for r in asked]
        if len(wanted) < (asked if isinstance(asked, int) else 1) or any(
                i not in free for i in wanted):
            raise self._no_capacity(asked, free)
        return wanted

    async def wait_for_room(self, request: GpuRequest, *, shared: bool = False,
                            timeout: float = 0.0) -> None:
        """Return once :meth:`assign` of ``request`` would succeed, waiting up to
        ``timeout`` seconds for GPU sandboxes to end; then :class:`NoGpuCapacity` (with
        what is free). The create that follows may still lose a race: assign decides."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while True:
            try:
                self.check(request, shared=shared)
                return
            except NoGpuCapacity:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
                woken: asyncio.Future[None] = loop.create_future()

                def wake(f: asyncio.Future[None] = woken) -> None:
                    if not f.done():
                        f.set_result(None)
                self.listeners.add(wake)
                try:
                    await asyncio.wait({woken}, timeout=min(remaining, 5.0))
                finally:
                    self.listeners.discard(wake)

    def usage(self, sandbox_id: str, pids: Iterable[int]) -> dict[str, Any]:
        """What a sandbox holding GPUs uses of them now: its processes' GPU memory (MiB)
        and its GPUs' busy percent (a shared GPU's is every sharer's); {} if none."""
        held = self._held.get(sandbox_id)
        if not held:
            return {}
        memory = self.backend.memory_used_mb(pids)
        busy = self.backend.utilization(held)
        return {"gpus": list(held), "gpu_memory_mb": sum(memory.values()),
                "gpu_utilization": (sum(busy.values()) / len(busy)) if busy else None}

    def release(self, sandbox_id: str) -> None:
        held = self._held.pop(sandbox_id, ())
        for i in held:
            if self._exclusive.get(i) == sandbox_id:
                del self._exclusive[i]
            holders = self._shared.get(i)
            if holders is not None:
                holders.discard(sandbox_id)
                if not holders:
                    del self._shared[i]
        if held:
            for wake in list(self.listeners):  # creates waiting for a free GPU
                wake()

    def holding(self) -> dict[str, int]:
        """How many sandboxes hold how much GPU: ``{"2": 1}`` is one sandbox with two;
        a sandbox sharing a GPU with ``k - 1`` others holds ``1/k`` of it (what a Ray
        cluster's autoscaler is shown: :mod:`corral.cluster.autoscale`)."""
        out: dict[str, int] = {}
        for sandbox_id, held in self._held.items():
            amount = sum(1.0 if self._exclusive.get(i) == sandbox_id
                         else 1.0 / max(1, len(self._shared.get(i, ()))) for i in held)
            key = f"{round(amount, 4):g}"
            out[key] = out.get(key, 0) + 1
        return out

    def held_by(self, sandbox_id: str) -> tuple[int, ...]:
        return self._held.get(sandbox_id, ())

    def _resolve(self, ref: str) -> int:
        for g in self._gpus.values():
            if ref in (str(g.index), g.uuid):
                return g.index
        raise InvalidArgument(f"no GPU {ref!r} on this host: it has "
                              f"{', '.join(str(i) for i in self._gpus)} (indices or UUIDs)")

    def _no_capacity(self, requested: Any, free: list[int]) -> NoGpuCapacity:
        # the admin's view: which GPUs are free (a tenant's: tenant_view)
        return NoGpuCapacity(
            f"not enough free GPUs for gpus={requested!r}: free {free or 'none'} of "
            f"{self.total}; wait for a sandbox to end, ask for fewer, or share "
            "(gpu_shared=True)",
            details={"requested": requested, "free": free, "total": self.total})


def tenant_view(exc: NoGpuCapacity) -> NoGpuCapacity:
    """``exc`` as a tenant may read it: what it asked for and the host's total (as
    ``GET /v1/info`` tells it), not which or how many GPUs are free, which would tell it
    what other tenants hold. (A tenant can still learn whether ``k`` are free by asking
    for ``k``: the answer to its own create, no more.)"""
    details: dict[str, Any] = {k: exc.details[k] for k in ("requested", "total", "waiting") if k in exc.details}
    waiting = exc.details.get("waiting")
    return NoGpuCapacity(
        f"not enough free GPUs for gpus={exc.details.get('requested')!r} on this host (it "
        f"has {exc.details.get('total')}); wait for one of your GPU sandboxes or another "
        "tenant's to end (create with a wait), ask for fewer, or share (gpu_shared=True)"
        + (f" (not waited for: this tenant has {waiting} creates waiting already, the "
           "daemon's queue_size)" if waiting is not None else ""),
        details=details)
