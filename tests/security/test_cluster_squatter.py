"""Must-do 7 of issue 23 on a real Ray cluster: a node's daemon dies, a squatter binds
its old port before Ray restarts it elsewhere, and clients keep calling that node.

Before this change the client kept sending the node's admin bearer token to the old
port (the squatter's 503 was no connection failure, so the directory was not read
again), and the squatter then used it on the restarted daemon. Now every connection
to a node's daemon is proven first (:mod:`corral.cluster.proof`): the squatter gets
only proof requests, the client reads the directory again, and once Ray has restarted
the daemon the same client reaches it at its new address.
"""

from __future__ import annotations

import os
import signal
import time

import corral
from corral.cli._cluster import cluster_url
from corral.cluster import _ray, auth, bringup
from tests.cluster.conftest import corral_cluster, ray_cluster  # noqa: F401 (the session's)
from tests.cluster.tenants_on_cluster import make_tenant, unique
from tests.security.squatter import Squatter

SERVICE_UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
ATTEMPTS = 600  # x 0.1 s: calls made while the node's daemon is away


def _bind_when_free(host: str, port: int) -> Squatter:
    for _ in range(ATTEMPTS):
        try:
            return Squatter(SERVICE_UNAVAILABLE, host=host, port=port)
        except OSError:  # the dying daemon still holds it
            time.sleep(0.01)
    raise AssertionError(f"{host}:{port} never came free")


def _create(client: corral.Client, node: str) -> str:
    """One try at a sandbox on ``node``: "created", or the error's name."""
    try:
        sb = corral.Sandbox.create(memory_mb=64, node=node, client=client)
    except (corral.DaemonUnavailable, corral.InvalidArgument) as exc:
        return type(exc).__name__
    try:
        assert sb.exec("echo back", timeout=60).stdout == "back\n"
    finally:
        sb.delete()
    return "created"


def test_a_squatter_on_a_dead_daemons_port_gets_no_token(corral_cluster):  # noqa: F811
    gcs = _ray.gcs(corral_cluster.address)
    head, node = corral_cluster.node_ids()[0], corral_cluster.node_ids()[1]
    token = auth.node_tokens(gcs)[node]
    tenant_token = make_tenant(corral_cluster, unique("squat"))
    # a tenant outside Ray starts at the head's daemon, its key pinned
    entry = cluster_url(bringup.read_entries(gcs)[head])
    with corral.Client(f"ray://{corral_cluster.address}") as client, \
            corral.Client(entry, token=tenant_token) as tenant:
        assert _create(client, node) == "created" and _create(tenant, node) == "created"
        old = bringup.read_entries(gcs)[node]
        host, port = old["url"].removeprefix("http://").rsplit(":", 1)
        os.kill(old["pid"], signal.SIGKILL)
        squatter = _bind_when_free(host, int(port))
        try:
            outcomes: dict[str, list[str]] = {"admin": [], "tenant": []}
            for _ in range(ATTEMPTS):  # both clients keep working that node meanwhile
                for who, c in (("admin", client), ("tenant", tenant)):
                    if outcomes[who][-1:] != ["created"]:
                        outcomes[who].append(_create(c, node))
                if all(o[-1:] == ["created"] for o in outcomes.values()):
                    break
                time.sleep(0.1)
            print(f"calls: {outcomes}; squatter: {squatter.connections} connections, "
                  f"{len(squatter.received)} bytes")
            assert all(o[-1] == "created" for o in outcomes.values()), outcomes
            # what the squatter got: proof requests, never the node's token
            assert token.encode() not in squatter.received
            assert tenant_token.encode() not in squatter.received
            new = bringup.read_entries(gcs)[node]
            assert new["url"] != old["url"] and new["key"] != old["key"]
            assert b"authorization" not in bytes(squatter.received).lower()
        finally:
            squatter.close()
    status = bringup.status(corral_cluster.address)  # the operator's view still works
    assert all(n.get("error") is None for n in status["nodes"] if n["alive"]), status
