"""Every call corral makes into Ray, in one place (as ``runtime/syscalls.py`` is for libc).

Reading the cluster's directory (the internal KV) and node liveness goes through
Ray's GCS client directly: a process does not have to join the cluster as a driver
(~0.7 s and a core worker) to find a daemon, so ``corral ls`` with ``CORRAL_URL=ray://``
stays quick. Starting and stopping actors (``corral cluster up/down``) does join.
Both are Ray 2.60 interfaces (``ray==2.60.0`` is pinned by the ``ray`` extra).

On a cluster with Ray's token authentication, this process's token (``RAY_AUTH_MODE=token``
and ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, as for any Ray
client) goes with every GCS call; a GCS that refuses it is :func:`unauthorized`.
"""

from __future__ import annotations

import functools
import json
import socket
from collections import Counter
from typing import Any

from corral.errors import DaemonUnavailable, Unauthorized, Unsupported

NAMESPACE = "corral"
"""The Ray namespace of corral's actors and the internal-KV namespace of its directory."""
GCS_TIMEOUT_S = 5.0
INSTALL_HINT = "pip install 'corral[ray]' (on every node of the cluster)"
HOW_TO_AUTH = (
    "set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN (or in a file named "
    "by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token; `ray get-auth-token` on a node of the "
    "cluster prints it)"
)


def ray() -> Any:
    """The ``ray`` module, or :class:`Unsupported` saying how to install it."""
    try:
        import ray as ray_module
    except ImportError:
        raise Unsupported(f"running on a Ray cluster needs Ray: {INSTALL_HINT}") from None
    return ray_module


def resolve(address: str) -> str:
    """The GCS address (``host:port``) of the cluster at ``address`` (``auto``: the one
    this process is part of, else the one ``ray start`` last started on this host, else
    ``RAY_ADDRESS``)."""
    r = ray()
    if address == "auto" and r.is_initialized():
        return r.get_runtime_context().gcs_address
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address(address)
    except Exception as exc:  # a malformed address
        raise DaemonUnavailable(
            f"no Ray cluster at {address!r} ({exc}): give ray://HOST:PORT, the address "
            "`ray start --head` printed, or ray://auto on a node of the cluster"
        ) from None
    if not found:
        raise DaemonUnavailable(
            f"no Ray cluster found for ray://{address}: start one with `ray start --head`, "
            "or give its address as ray://HOST:PORT"
        )
    return found


@functools.lru_cache(maxsize=8)
def _gcs_client(address: str) -> Any:
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    return GcsClient(address=address)


def gcs(address: str) -> Any:
    """A GCS client of the cluster at ``address`` (resolved), checked to answer."""
    host, _, port = address.rpartition(":")
    try:  # Ray's own client waits ~40 s for an address where nothing listens
        socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        raise DaemonUnavailable(
            f"no Ray cluster answers at {address} ({getattr(exc, 'strerror', None) or exc}): "
            "start one with `ray start --head`, or give the address it printed "
            "(ray://HOST:PORT)",
            details={"url": f"ray://{address}"},
        ) from None
    if not _token_mode() and gcs_authenticated(address):  # refused: say why, before Ray
        raise unauthorized(address)  # logs its own complaint (from C++) on stderr
    try:
        client = _gcs_client(address)
    except Exception as exc:
        if is_auth_error(exc):
            raise unauthorized(address) from None
        raise DaemonUnavailable(
            f"no Ray cluster answers at {address} ({exc}): check the address "
            "(`ray status --address HOST:PORT`)", details={"url": f"ray://{address}"},
        ) from None
    node_states(client)  # fails fast (DaemonUnavailable) if nothing answers there
    return client


def node_states(client: Any) -> dict[str, dict[str, Any]]:
    """``{node_id: {"alive", "address"}}`` for every node the cluster ever had."""
    try:
        infos = client.get_all_node_info(timeout=GCS_TIMEOUT_S)
    except Exception as exc:
        if is_auth_error(exc):
            raise unauthorized(client.address) from None
        raise DaemonUnavailable(
            f"the Ray cluster at {client.address} does not answer ({type(exc).__name__}): "
            "check that it runs (`ray status --address ADDR`) and the address is right",
            details={"url": f"ray://{client.address}"},
        ) from None
    return {
        node_id.hex(): {"alive": info.state == 0, "address": info.node_manager_address}
        for node_id, info in infos.items()
    }


def unauthorized(address: str) -> Unauthorized:
    """What a client that Ray's GCS refused is told."""
    return Unauthorized(
        f"the Ray cluster at {address} requires Ray's token authentication and refused "
        f"this client (no token, or a wrong one): {HOW_TO_AUTH}",
        details={"url": f"ray://{address}"},
    )


def _token_mode() -> bool:
    """Whether this process sends Ray's token (``RAY_AUTH_MODE=token``)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

    return bool(get_authentication_mode() == AuthenticationMode.TOKEN)


def is_auth_error(exc: BaseException) -> bool:
    """True if ``exc`` is Ray's GCS refusing this client's token."""
    from ray.exceptions import AuthenticationError

    return isinstance(exc, AuthenticationError) or "InvalidAuthToken" in str(exc)


def gcs_authenticated(address: str) -> bool:
    """Whether the GCS at ``address`` (``host:port``) refuses a client without a token:
    one call without credentials (Ray's own client would send this process's token)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=GCS_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            raise DaemonUnavailable(
                f"the Ray cluster at {address} does not answer ({exc.code().name}): check "
                "that it runs (`ray status --address ADDR`)", details={"url": f"ray://{address}"},
            ) from None
    return False


def kv_get(client: Any, key: str) -> bytes | None:
    return client.internal_kv_get(key.encode(), NAMESPACE.encode(), timeout=GCS_TIMEOUT_S)


def kv_put(client: Any, key: str, value: bytes, *, overwrite: bool = True) -> bool:
    """Store ``value``; with ``overwrite=False`` an existing value is kept. True if added."""
    added = client.internal_kv_put(
        key.encode(), value, overwrite, NAMESPACE.encode(), timeout=GCS_TIMEOUT_S
    )
    return bool(added)


def kv_keys(client: Any, prefix: str) -> list[str]:
    keys = client.internal_kv_keys(prefix.encode(), NAMESPACE.encode(), timeout=GCS_TIMEOUT_S)
    return sorted(k.decode() for k in keys)


def kv_del(client: Any, key: str) -> None:
    client.internal_kv_del(key.encode(), False, NAMESPACE.encode(), timeout=GCS_TIMEOUT_S)


RESOURCE_REQUEST_KEY = b"autoscaler_resource_request"
"""Where Ray's v1 autoscaler reads ``request_resources`` (``ray_constants.
AUTOSCALER_RESOURCE_REQUEST_CHANNEL``, default KV namespace); v2 reads the GCS's
cluster resource constraint. :func:`request_resources` sets both, as Ray's does."""


def request_resources(client: Any, bundles: list[dict[str, float]]) -> None:
    """What ``ray.autoscaler.sdk.request_resources(bundles=...)`` does, through the GCS
    client (no driver needed): the autoscaler keeps room for ``bundles`` until the next
    call replaces them (``[]``: none)."""
    shapes = Counter(tuple(sorted(b.items())) for b in bundles)
    client.request_cluster_resource_constraint(
        [dict(s) for s in shapes], [{} for _ in shapes], list(shapes.values()),
        timeout_s=GCS_TIMEOUT_S,
    )
    client.internal_kv_put(RESOURCE_REQUEST_KEY, json.dumps(bundles).encode(), True, None,
                           timeout=GCS_TIMEOUT_S)


def resource_constraint(client: Any) -> list[dict[str, float]]:
    """The bundles the cluster's resource constraint holds, as Ray's autoscaler (v2) reads
    them from the GCS (one dict per bundle)."""
    from ray.core.generated.autoscaler_pb2 import GetClusterResourceStateReply

    reply = GetClusterResourceStateReply()
    reply.ParseFromString(client.get_cluster_resource_state(timeout_s=GCS_TIMEOUT_S))
    out: list[dict[str, float]] = []
    for constraint in reply.cluster_resource_state.cluster_resource_constraints:
        for by_count in constraint.resource_requests:
            bundle = dict(by_count.request.resources_bundle)
            out.extend(dict(bundle) for _ in range(by_count.count))
    return out


def resource_request_v1(client: Any) -> list[dict[str, float]]:
    """The bundles Ray's v1 autoscaler would read (``request_resources``' KV channel)."""
    raw = client.internal_kv_get(RESOURCE_REQUEST_KEY, None, timeout=GCS_TIMEOUT_S)
    return list(json.loads(raw)) if raw else []


def worker_node() -> str | None:
    """The node id of this process if it is a Ray task or actor (not a driver): where a
    sandbox is "local" to it."""
    r = ray()
    if not r.is_initialized():
        return None
    from ray._private.worker import WORKER_MODE, global_worker

    if global_worker.mode != WORKER_MODE:
        return None
    return r.get_runtime_context().get_node_id()
