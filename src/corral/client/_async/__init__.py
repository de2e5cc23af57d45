"""The client's classes (see scripts/gen_sync.py for how the two variants relate)."""

from corral.client._async._client import AsyncClient
from corral.client._async._files import AsyncFiles
from corral.client._async._image import AsyncImage
from corral.client._async._network import AsyncNetwork
from corral.client._async._pool import AsyncPool
from corral.client._async._process import AsyncProcess
from corral.client._async._sandbox import AsyncSandbox, AsyncSnapshot
from corral.client._async._session import AsyncSession
from corral.client._async._stream import AsyncExecStream
from corral.client._async._volume import AsyncVolume

__all__ = [
    "AsyncClient",
    "AsyncExecStream",
    "AsyncFiles",
    "AsyncImage",
    "AsyncNetwork",
    "AsyncPool",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncSnapshot",
    "AsyncVolume",
]
