# Generated from _async/__init__.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""The client's classes (see scripts/gen_sync.py for how the two variants relate)."""

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
