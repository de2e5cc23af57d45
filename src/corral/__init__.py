"""corral: self-hosted sandboxes for reinforcement learning.

Blocking::

    import corral

    with corral.Sandbox.create(image="python", memory_mb=512, timeout=600) as sb:
        r = sb.exec(["python3", "-c", "print(6*7)"], timeout=10)
        print(r.returncode, r.stdout)                      # 0 42

asyncio: the same API on :class:`AsyncSandbox` (``await``, ``async with``,
``async for``). Fan-out on threads: :func:`submit`, ``Sandbox.create_future``,
``sb.exec_future``, :func:`wait`, :func:`as_completed`. Sandboxes with shared
defaults, deleted together: :class:`Session`. Sandboxes kept started ahead of time,
one per episode: :class:`Pool` (``with pool.acquire() as sb``). A sandbox set up once,
started many times: ``snap = sb.snapshot()``, ``snap.restore()``, ``sb.fork(n)``. Images
built from a spec (base image plus cached ``run``/``copy``/``env``/``workdir`` steps)
or imported from an OCI archive: :class:`Image` (``Image.build("env.yaml")``).

Where the daemon is: ``CORRAL_URL`` / ``CORRAL_SOCKET`` (see ``corral.client._config``);
with neither, the SDK starts a shared local daemon itself.
"""

from corral._version import __version__
from corral.client._async import (
    AsyncClient,
    AsyncExecStream,
    AsyncFiles,
    AsyncImage,
    AsyncPool,
    AsyncProcess,
    AsyncSandbox,
    AsyncSession,
    AsyncSnapshot,
    AsyncVolume,
)
from corral.client._futures import Handle, as_completed, submit, wait
from corral.client._models import CommandResult, OutputChunk
from corral.client._sync import (
    Client,
    ExecStream,
    Files,
    Image,
    Pool,
    Process,
    Sandbox,
    Session,
    Snapshot,
    Volume,
)
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DaemonUnavailable,
    DockerfileError,
    ExecTimeout,
    FileError,
    FileNotFound,
    FileTooLarge,
    Forbidden,
    ImageBuildError,
    ImageImportError,
    ImageInUse,
    ImageNotFound,
    InternalError,
    InvalidArgument,
    InvalidState,
    LayerTransferError,
    LeaseNotFound,
    NotFound,
    PathOutsideSandbox,
    PortClosed,
    QuotaExceeded,
    RegistryAuthError,
    RegistryError,
    SandboxDiskFull,
    SandboxLost,
    SandboxNotFound,
    SandboxProtocolError,
    SandboxStartError,
    SandboxTimeout,
    SnapshotNotFound,
    SnapshotTooLarge,
    Unauthorized,
    Unsupported,
    VolumeNotFound,
)
from corral.image_schema import BuildEvent, BuildSpec, ImageInfo, PruneResult, PullEvent
from corral.network_schema import NetworkPolicy
from corral.pool_schema import PoolInfo
from corral.schema import (
    FileInfo,
    NetworkMode,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
    Storage,
)

__all__ = [
    "AsyncClient",
    "AsyncExecStream",
    "AsyncFiles",
    "AsyncImage",
    "AsyncPool",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncSnapshot",
    "AsyncVolume",
    "BuildEvent",
    "BuildSpec",
    "CapacityExceeded",
    "Client",
    "CommandResult",
    "CorralError",
    "DaemonUnavailable",
    "DockerfileError",
    "ExecStream",
    "ExecTimeout",
    "FileError",
    "FileInfo",
    "FileNotFound",
    "FileTooLarge",
    "Files",
    "Forbidden",
    "Handle",
    "Image",
    "ImageBuildError",
    "ImageImportError",
    "ImageInUse",
    "ImageInfo",
    "ImageNotFound",
    "InternalError",
    "InvalidArgument",
    "InvalidState",
    "LayerTransferError",
    "LeaseNotFound",
    "NetworkMode",
    "NetworkPolicy",
    "NotFound",
    "OutputChunk",
    "PathOutsideSandbox",
    "Pool",
    "PoolInfo",
    "PortClosed",
    "Process",
    "PruneResult",
    "PullEvent",
    "QuotaExceeded",
    "RegistryAuthError",
    "RegistryError",
    "Sandbox",
    "SandboxDiskFull",
    "SandboxInfo",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxProtocolError",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxState",
    "SandboxTimeout",
    "Session",
    "Snapshot",
    "SnapshotInfo",
    "SnapshotNotFound",
    "SnapshotTooLarge",
    "Storage",
    "Unauthorized",
    "Unsupported",
    "Volume",
    "VolumeNotFound",
    "__version__",
    "as_completed",
    "submit",
    "wait",
]
