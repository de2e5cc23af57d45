"""How Tensorlake's sandbox objects map onto corral's, both ways.

Shared by the lifecycle routes (:mod:`.tensorlake`) and the in-sandbox routes
(:mod:`.tensorlake_sandbox`). Contract checked against the ``tensorlake`` client
0.5.16x (its Python models and the Rust core they wrap).

**Settings** (environment variables of the daemon, read once when it starts):

- ``CORRAL_COMPAT_DEFAULT_IMAGE`` (default ``rl``): the corral image a Tensorlake
  create gets when it names no image ("the default managed environment"), and what
  ``tensorlake/ubuntu-minimal`` means. ``rl`` has python3, gymnasium and numpy.
- ``CORRAL_COMPAT_IMAGE_MAP``: more names, ``tl-name=corral-image`` pairs separated
  by commas, e.g. ``my-team/agent-env=python,tensorlake/ubuntu-minimal=python``.
  A name that is neither mapped nor a corral image is refused (404).
- ``CORRAL_COMPAT_NETWORK`` (default ``none``): the network of sandboxes whose create
  does not turn internet access off. Tensorlake allows internet by default; corral does
  not, unless this is ``host``.

**Names and namespaces** are kept as tags: ``tensorlake.ns=<namespace>`` on every
sandbox and pool made through the front-end, ``tensorlake.name=<name>`` on named
sandboxes. Namespaces are a boundary: see :mod:`.tensorlake_scope`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from corral.errors import (
    ImageNotFound,
    InvalidArgument,
    Unsupported,
)
from corral.pool_schema import POOL_TAG_KEY
from corral.runtime.distribution import is_reference
from corral.runtime.engine import Engine
from corral.schema import NetworkMode, SandboxInfo, SandboxState, SnapshotInfo
from corral.server.compat._wire import compat_network, name_pairs

DEFAULT_IMAGE = "rl"
# Tensorlake's stock image names, meaning "the default image" unless mapped otherwise.
STOCK_IMAGES = ("tensorlake/ubuntu-minimal",)
TAG = "tensorlake"
NS_TAG = "tensorlake.ns="
NAME_TAG = "tensorlake.name="
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")

# corral state -> Tensorlake SandboxStatus value.
STATUS = {
    SandboxState.PENDING: "pending",
    SandboxState.RUNNING: "running",
    SandboxState.PAUSED: "suspended",
    SandboxState.STOPPING: "terminated",
    SandboxState.STOPPED: "terminated",
    SandboxState.FAILED: "failed",
}


@dataclass(frozen=True)
class TensorlakeSettings:
    """The front-end's configuration (see the module docstring)."""

    default_image: str = DEFAULT_IMAGE
    image_map: Mapping[str, str] = field(default_factory=dict)
    network: NetworkMode = NetworkMode.NONE

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "TensorlakeSettings":
        """Settings from ``CORRAL_COMPAT_*``; :class:`InvalidArgument` if one is malformed
        (the daemon then refuses to start, saying which)."""
        default = environ.get("CORRAL_COMPAT_DEFAULT_IMAGE", "").strip() or DEFAULT_IMAGE
        mapping = {name: default for name in STOCK_IMAGES}
        mapping.update(name_pairs(environ, "CORRAL_COMPAT_IMAGE_MAP",
                                  "tensorlake/ubuntu-minimal=python,my/env=rl"))
        network = compat_network(environ)
        return cls(default_image=default, image_map=mapping, network=network)

    def image(self, requested: str | None) -> str:
        """The corral image for a Tensorlake image name (None: the default)."""
        if requested is None:
            return self.default_image
        return self.image_map.get(requested, requested)


def settings(request: Request) -> TensorlakeSettings:
    return request.app.state.tensorlake_settings


def check_image(engine: Engine, requested: str | None, image: str) -> None:
    """:class:`ImageNotFound` now, saying how to map a Tensorlake name, if ``image`` is
    not a corral image (a registry reference is pulled on first use instead)."""
    if is_reference(image):
        return
    try:
        engine.images.get(image)
    except (ImageNotFound, InvalidArgument):  # unknown, or not even a corral image name
        raise ImageNotFound(
            f"no corral image for Tensorlake image {requested!r}: use a corral image name "
            "(e.g. 'python' or 'rl'), or map it when starting the daemon with "
            f"CORRAL_COMPAT_IMAGE_MAP='{requested}=python'",
            details={"image": requested},
        ) from None


# -------------------------------------------------------------- request bodies

MAX_TEXT = 4096  # characters of one string of a request body
MAX_ITEMS = 256  # elements of one list (or entries of one mapping) of a request body


class Body(BaseModel):
    """A Tensorlake request body. Fields a newer client adds are ignored, as Tensorlake's
    server does; the known ones are strict (no ``"512"`` for 512, no ``true`` for 1, no
    ``1`` for true) and bounded, else 400 ``invalid_argument``."""

    model_config = ConfigDict(extra="ignore", strict=True)


Text = Annotated[str, Field(max_length=MAX_TEXT)]


def items(default: Any = None) -> Any:
    """A list (or mapping) field of at most :data:`MAX_ITEMS` entries."""
    if callable(default):
        return Field(default_factory=default, max_length=MAX_ITEMS)
    return Field(default, max_length=MAX_ITEMS)


# ------------------------------------------------------------------- identity


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"invalid sandbox name {name[:100]!r}: use 1-100 ASCII letters, digits or _.-, "
            "starting with a letter or digit (e.g. 'agent-7')"
        )
    return name


def tag_value(info: SandboxInfo, prefix: str) -> str | None:
    for tag in info.spec.tags:
        if tag.startswith(prefix):
            return tag[len(prefix) :]
    return None


# ---------------------------------------------------------------- conversions


def resources(cpus: float, memory_mb: int, disk_mb: int) -> dict[str, Any]:
    return {"cpus": cpus, "memory_mb": memory_mb, "disk_mb": disk_mb}


def sandbox_json(info: SandboxInfo, ns: str, url: str) -> dict[str, Any]:
    """A corral sandbox as Tensorlake's ``SandboxInfo``."""
    spec = info.spec
    status = STATUS[info.state]
    body: dict[str, Any] = {
        "id": info.id,
        "namespace": tag_value(info, NS_TAG) or ns,
        "status": status,
        "image": spec.image,
        "resources": resources(spec.cpus, spec.memory_mb, spec.disk_mb),
        "timeout_secs": int(spec.timeout),
        "created_at": info.created_at,
        "name": tag_value(info, NAME_TAG),
        "pool_id": tag_value(info, POOL_TAG_KEY + "="),
        "allow_unauthenticated_access": False,
        "exposed_ports": [],
        "network_policy": {
            "allow_internet_access": spec.network == NetworkMode.HOST,
            "allow_out": [],
            "deny_out": [],
        },
    }
    if status == "running":
        body["sandbox_url"] = url
    if info.ended_at is not None:
        body["terminated_at"] = info.ended_at
    if info.state.terminal and info.reason:
        body["termination_reason"] = info.reason
    return body


def created_json(info: SandboxInfo, url: str) -> dict[str, Any]:
    """A new (or claimed) sandbox as Tensorlake's ``CreateSandboxResponse``."""
    body: dict[str, Any] = {"sandbox_id": info.id, "status": STATUS[info.state]}
    if body["status"] == "running":
        body["sandbox_url"] = url
    name = tag_value(info, NAME_TAG)
    if name is not None:
        body["name"] = name
    return body


def snapshot_json(snap: SnapshotInfo, ns: str) -> dict[str, Any]:
    """A corral snapshot as Tensorlake's ``SnapshotInfo`` (always a filesystem snapshot,
    complete as soon as it exists)."""
    return {
        "id": snap.id,
        "namespace": ns,
        "sandbox_id": snap.source_sandbox or "",
        "status": "completed",
        "base_image": snap.image,
        "snapshot_type": "filesystem",
        "size_bytes": snap.size_bytes,
        "created_at": snap.created_at,
    }


def refuse(what: str, hint: str) -> Unsupported:
    """The error for a Tensorlake option corral cannot honour (never silently ignored)."""
    return Unsupported(f"corral's Tensorlake front-end does not support {what}: {hint}")
