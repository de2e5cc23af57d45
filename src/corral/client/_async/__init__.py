"""The client's classes (see scripts/gen_sync.py for how the two variants relate).

Each is imported from its module on first use (:mod:`corral._lazy`): a process that
uses sandboxes does not pay for images, pools, networks or volumes."""

from typing import TYPE_CHECKING

from corral._lazy import attach

if TYPE_CHECKING:
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
else:
    __getattr__, __dir__ = attach(__name__, {
        "AsyncClient": "corral.client._async._client",
        "AsyncExecStream": "corral.client._async._stream",
        "AsyncFiles": "corral.client._async._files",
        "AsyncImage": "corral.client._async._image",
        "AsyncNetwork": "corral.client._async._network",
        "AsyncPool": "corral.client._async._pool",
        "AsyncProcess": "corral.client._async._process",
        "AsyncSandbox": "corral.client._async._sandbox",
        "AsyncSession": "corral.client._async._session",
        "AsyncSnapshot": "corral.client._async._sandbox",
        "AsyncVolume": "corral.client._async._volume",
    })

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
