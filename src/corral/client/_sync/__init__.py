# Generated from _async/__init__.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""The client's classes (see scripts/gen_sync.py for how the two variants relate).

Each is imported from its module on first use (:mod:`corral._lazy`): a process that
uses sandboxes does not pay for images, pools, networks or volumes."""

from typing import TYPE_CHECKING

from corral._lazy import attach

if TYPE_CHECKING:
    from corral.client._sync._client import Client
    from corral.client._sync._files import Files
    from corral.client._sync._image import Image
    from corral.client._sync._network import Network
    from corral.client._sync._pool import Pool
    from corral.client._sync._process import Process
    from corral.client._sync._sandbox import Sandbox, Snapshot
    from corral.client._sync._session import Session
    from corral.client._sync._stream import ExecStream
    from corral.client._sync._volume import Volume
else:
    __getattr__, __dir__ = attach(__name__, {
        "Client": "corral.client._sync._client",
        "ExecStream": "corral.client._sync._stream",
        "Files": "corral.client._sync._files",
        "Image": "corral.client._sync._image",
        "Network": "corral.client._sync._network",
        "Pool": "corral.client._sync._pool",
        "Process": "corral.client._sync._process",
        "Sandbox": "corral.client._sync._sandbox",
        "Session": "corral.client._sync._session",
        "Snapshot": "corral.client._sync._sandbox",
        "Volume": "corral.client._sync._volume",
    })

__all__ = [
    "Client",
    "ExecStream",
    "Files",
    "Image",
    "Network",
    "Pool",
    "Process",
    "Sandbox",
    "Session",
    "Snapshot",
    "Volume",
]
