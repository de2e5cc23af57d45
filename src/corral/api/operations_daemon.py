"""The declarations of the daemon-wide endpoints (images, tokens, leases, cluster,
evaluation runs): the second half of :data:`corral.api.operations.OPERATIONS`."""

from __future__ import annotations

from corral.api.daemon_models import (
    ClusterNodes,
    EvalList,
    EvalReport,
    EvalRun,
    FetchRequest,
    FetchStats,
    ImageFetchRequest,
    NodeProof,
    PeerImage,
    PeerSnapshot,
    PeerVolume,
    RefreshReply,
    RefreshRequest,
    TokenCreated,
    TokenInfo,
    TokenList,
    TokenRequest,
    TokenUpdate,
    VolumeFetchRequest,
)
from corral.api.operation import (
    NDJSON,
    RAW,
    Access,
    Operation,
    Query,
    Routing,
)
from corral.errors import (
    DockerfileError,
    FileTooLarge,
    ImageBuildError,
    ImageImportError,
    ImageInUse,
    ImageNotFound,
    InvalidArgument,
    InvalidState,
    LayerTransferError,
    NotFound,
    QuotaExceeded,
    RegistryAuthError,
    RegistryError,
    SnapshotNotFound,
    StorageFull,
    VolumeNotFound,
)
from corral.image_schema import (
    BuildEvent,
    BuildRequest,
    ImageInfo,
    PruneResult,
    PullEvent,
    PullRequest,
)
from corral.schema import SnapshotInfo
from corral.volume_schema import VolumeInfo

_BODY = (InvalidArgument, FileTooLarge)  # a body: parsed, checked, bounded (--max-upload-bytes)


DAEMON_OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "get_image", "GET", "/v1/images/{name}", "One image", reply=ImageInfo,
        errors=(ImageNotFound,), routing=Routing.HOME,
    ),
    Operation(
        "delete_image", "DELETE", "/v1/images/{name}",
        "Delete an image (idempotent; refused while sandboxes, snapshots or images use it)",
        status=204, errors=(ImageNotFound, ImageInUse), access=Access.IMAGES,
        routing=Routing.HOME,
    ),
    Operation(
        "build_image", "POST", "/v1/images/build",
        "Build an image from a spec (JSON, or a tar with build.json and context/), streaming its "
        "log",
        body=BuildRequest, reply=(NDJSON, BuildEvent), parse_body=False,
        errors=(*_BODY, ImageNotFound, ImageBuildError, DockerfileError, StorageFull),
        access=Access.IMAGES, routing=Routing.HOME,
    ),
    Operation(
        "build_dockerfile_route", "POST", "/v1/images/dockerfile",
        "Build a Dockerfile (a tar with dockerfile.json and context/), streaming its log",
        body=RAW, reply=(NDJSON, BuildEvent),
        errors=(*_BODY, ImageNotFound, ImageBuildError, DockerfileError, StorageFull),
        access=Access.IMAGES, routing=Routing.HOME,
    ),
    Operation(
        "pull_image_route", "POST", "/v1/images/pull",
        "Pull an image from an OCI/Docker registry, streaming its progress", body=PullRequest,
        reply=(NDJSON, PullEvent), parse_body=False,
        errors=(*_BODY, ImageNotFound, RegistryError, RegistryAuthError, StorageFull),
        access=Access.IMAGES, routing=Routing.HOME,
    ),
    Operation(
        "prune_images", "POST", "/v1/images/prune",
        "Delete the layers no image, cache entry or sandbox holds", reply=PruneResult,
        access=Access.IMAGES, routing=Routing.HOME,
    ),
    Operation(
        "import_image_route", "POST", "/v1/images/import",
        "Import a docker save tarball or an OCI image layout (as a tar)", body=RAW,
        reply=ImageInfo, status=201,
        query=(
            Query("name", "string", "the image's name (one of that name is replaced)",
                  required=True, min_length=1),
        ),
        errors=(*_BODY, ImageNotFound, ImageImportError, StorageFull), access=Access.IMAGES,
        routing=Routing.HOME,
    ),
    Operation(
        "create_token", "POST", "/v1/tokens", "Make a tenant token (admin only; shown once)",
        body=TokenRequest,
        reply=TokenCreated, status=201, errors=(*_BODY,),
        access=Access.ADMIN, routing=Routing.HOME,
    ),
    Operation(
        "list_tokens", "GET", "/v1/tokens", "List tenants: quotas and use (admin only)",
        reply=TokenList, access=Access.ADMIN,
        routing=Routing.HOME,
    ),
    Operation(
        "update_token", "PATCH", "/v1/tokens/{name}",
        "Change a tenant's quotas (admin only; fields left out stay)",
        body=TokenUpdate,
        reply=TokenInfo, errors=(*_BODY, NotFound),
        access=Access.ADMIN, routing=Routing.HOME,
    ),
    Operation(
        "revoke_token", "DELETE", "/v1/tokens/{name}",
        "Revoke a tenant token: refused from its next request (admin only)", status=204,
        errors=(NotFound,), access=Access.ADMIN, routing=Routing.HOME,
    ),
    Operation(
        "get_snapshot", "GET", "/v1/snapshots/{id_or_name}", "One snapshot, by id or name",
        reply=SnapshotInfo, errors=(SnapshotNotFound,), routing=Routing.HOLDER,
    ),
    Operation(
        "fetch_snapshot", "POST", "/v1/peer/snapshots/fetch",
        "Cluster: make a snapshot of another node restorable here (fetches its layers)",
        body=FetchRequest, reply=SnapshotInfo,
        errors=(*_BODY, SnapshotNotFound, NotFound, LayerTransferError, StorageFull),
        access=Access.ADMIN, routing=Routing.NODE,
    ),
    Operation(
        "peer_snapshot", "GET", "/v1/peer/snapshots/{id_or_name}",
        "Cluster: a snapshot's layers and digests, for another node to fetch",
        reply=PeerSnapshot,
        query=(Query("owner", "string", "find it as this tenant does (its own only)"),),
        errors=(InvalidArgument, SnapshotNotFound, NotFound, LayerTransferError),
        access=Access.PEER, routing=Routing.NODE,
    ),
    Operation(
        "refresh_tenants", "POST", "/v1/peer/tenants/refresh",
        "Cluster: read the cluster's tenant registry again now",
        body=RefreshRequest,
        reply=RefreshReply,
        errors=(*_BODY, NotFound, LayerTransferError), access=Access.PEER, routing=Routing.NODE,
    ),
    Operation(
        "node_proof", "GET", "/v1/cluster/proof",
        "Cluster: a node's daemon proves who it is before any credential is sent (answered "
        "without one, ahead of the door, by a daemon started with a node key)",
        reply=NodeProof,
        query=(Query("nonce", "string", "the client's nonce: 64 hex digits", required=True),),
        errors=(InvalidArgument, NotFound), access=Access.ANYONE, routing=Routing.NODE,
    ),
    Operation(
        "cluster_nodes", "GET", "/v1/cluster/nodes",
        "Cluster: every alive node's daemon (id, URL, capacity), for a cluster client",
        reply=ClusterNodes,
        errors=(NotFound, LayerTransferError), routing=Routing.NODE,
    ),
    Operation(
        "fetch_own_snapshot", "POST", "/v1/cluster/snapshots/fetch",
        "Cluster: make a snapshot of yours on another node restorable here",
        body=FetchRequest, reply=SnapshotInfo,
        errors=(*_BODY, SnapshotNotFound, NotFound, LayerTransferError, StorageFull),
        routing=Routing.NODE,
    ),
    Operation(
        "fetch_own_image", "POST", "/v1/cluster/images/fetch",
        "Cluster: make a built image of another node usable here",
        body=ImageFetchRequest, reply=ImageInfo,
        errors=(*_BODY, NotFound, LayerTransferError, StorageFull), routing=Routing.NODE,
    ),
    Operation(
        "fetch_own_volume", "POST", "/v1/cluster/volumes/fetch",
        "Cluster: make a volume of yours on another node usable here (a copy of it)",
        body=VolumeFetchRequest, reply=VolumeInfo,
        errors=(*_BODY, VolumeNotFound, InvalidState, NotFound, LayerTransferError,
                StorageFull, QuotaExceeded), routing=Routing.NODE,
    ),
    Operation(
        "peer_volume", "GET", "/v1/peer/volumes/{name}",
        "Cluster: a volume described for another node to copy (?owner=TENANT: as that "
        "tenant finds it)", reply=PeerVolume,
        query=(Query("owner", "string", "the tenant whose volume it is"),),
        errors=(VolumeNotFound, InvalidState, NotFound, LayerTransferError),
        access=Access.PEER, routing=Routing.NODE,
    ),
    Operation(
        "peer_layer", "GET", "/v1/peer/layers/{digest}",
        "Cluster: one layer of a snapshot held here, as a tar stream", reply=RAW,
        errors=(NotFound, LayerTransferError), access=Access.PEER, routing=Routing.NODE,
    ),
    Operation(
        "peer_checkpoint", "GET", "/v1/peer/checkpoints/{snapshot_id}",
        "Cluster: a live snapshot's process images held here, as a tar stream "
        "(?owner=TENANT: its tenant's only)", reply=RAW,
        query=(Query("owner", "string", "the tenant whose snapshot it is"),),
        errors=(InvalidArgument, SnapshotNotFound, NotFound, LayerTransferError),
        access=Access.PEER, routing=Routing.NODE,
    ),
    Operation(
        "fetch_image", "POST", "/v1/peer/images/fetch",
        "Cluster: make a built image of another node usable here (fetches its layers)",
        body=ImageFetchRequest, reply=ImageInfo,
        errors=(*_BODY, NotFound, LayerTransferError, StorageFull), access=Access.ADMIN,
        routing=Routing.NODE,
    ),
    Operation(
        "peer_image", "GET", "/v1/peer/images/{name}",
        "Cluster: a built image's manifest, for another node to pull",
        reply=PeerImage,
        errors=(NotFound, LayerTransferError), access=Access.PEER, routing=Routing.NODE,
    ),
    Operation(
        "peer_stats", "GET", "/v1/peer/stats", "Cluster: layers fetched from other nodes",
        reply=FetchStats,
        errors=(NotFound, LayerTransferError), access=Access.ADMIN, routing=Routing.NODE,
    ),
    Operation(
        "delete_snapshot", "DELETE", "/v1/snapshots/{id_or_name}",
        "Delete a snapshot (idempotent; sandboxes started from it keep running)", status=204,
        errors=(SnapshotNotFound,), routing=Routing.EVERYWHERE,
    ),
    Operation(
        "put_eval", "PUT", "/v1/evals/{eval_id}",
        "Report an evaluation run's progress (corral.rl.evaluate does; shown at /ui)",
        body=EvalReport,
        reply=EvalRun, errors=(*_BODY,), routing=Routing.HOME,
    ),
    Operation(
        "list_evals", "GET", "/v1/evals", "Recent evaluation runs, newest first",
        reply=EvalList, routing=Routing.HOME,
    ),

)
