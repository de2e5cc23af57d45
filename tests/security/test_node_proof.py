"""Must-do 7 of issue 23: on a cluster, a credential goes only to a daemon that proved
who it is (:mod:`corral.cluster.proof`).

Before this change, when a node's daemon died, Ray restarted it on another port with
the same token, and clients kept sending to the old port: a local user bound to it
received the node's admin bearer token. Here a real daemon started as a node's daemon
(``--node``, with its key in ``CORRAL_NODE_KEY``) and real squatter sockets on loopback
take the old port's place; the cluster's own senders (the SDK's proven transport, the
peers' and supervisor's clients) must send the squatter nothing but the proof request.
"""

from __future__ import annotations

import secrets

import httpx
import pytest

from corral.cluster import proof
from tests.conftest import have_root_runtime
from tests.security.edge_daemon import AUTH, TOKEN, served
from tests.security.squatter import Squatter

pytestmark = pytest.mark.skipif(not have_root_runtime(), reason="needs root (a real daemon)")

NODE = secrets.token_hex(28)  # a Ray node id's shape


@pytest.fixture
def node_daemon(monkeypatch):
    private, public = proof.make_key()
    monkeypatch.setenv(proof.KEY_ENV, private)
    with served("--node", NODE) as daemon:
        yield daemon, public


def test_a_proven_daemon_gets_the_token(node_daemon):
    daemon, public = node_daemon
    pins = proof.Pins([(daemon.base, NODE, public)])
    with proof.proven_client(pins, timeout=60) as http:
        for _ in range(3):  # one proof, then the kept-alive connection
            reply = http.get(daemon.base + "/v1/info", headers=AUTH)
            assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("answer", [
    b"",  # says nothing
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",  # the red team's
    b'HTTP/1.1 200 OK\r\ncontent-length: 40\r\n\r\n{"node_id": "x", "signature": "AAAA"}   ',
])
def test_a_squatter_on_the_listed_address_gets_no_token(node_daemon, answer):
    daemon, public = node_daemon
    squatter = Squatter(answer)
    try:
        # the directory still lists the daemon's old address, where the squatter sits now
        pins = proof.Pins([(squatter.url, NODE, public)])
        with proof.proven_client(pins, timeout=5) as http:
            with pytest.raises(httpx.ConnectError, match="did not prove"):
                http.get(squatter.url + "/v1/info", headers=AUTH)
        assert squatter.connections == 1
        assert TOKEN.encode() not in squatter.received
        assert bytes(squatter.received).startswith(b"GET /v1/cluster/proof?nonce=")
    finally:
        squatter.close()


def test_a_squatter_relaying_to_the_real_daemon_gets_no_token(node_daemon):
    """The daemon signs the port the connection reached it at: a relay from the old
    port to the daemon's new one carries a proof for the new port, not the old."""
    daemon, public = node_daemon
    squatter = Squatter(relay_to=daemon.port)
    try:
        pins = proof.Pins([(squatter.url, NODE, public)])
        with proof.proven_client(pins, timeout=10) as http:
            with pytest.raises(httpx.ConnectError, match="does not verify"):
                http.get(squatter.url + "/v1/info", headers=AUTH)
        assert TOKEN.encode() not in squatter.received
    finally:
        squatter.close()


def test_an_address_the_directory_no_longer_lists_is_never_dialled(node_daemon):
    daemon, public = node_daemon
    squatter = Squatter()
    try:
        pins = proof.Pins([(daemon.base, NODE, public)])  # the squatter's is not listed
        with proof.proven_client(pins, timeout=5) as http:
            with pytest.raises(httpx.ConnectError, match="not a daemon the cluster"):
                http.get(squatter.url + "/v1/info", headers=AUTH)
        assert squatter.connections == 0
        pins.replace([])  # the node left the directory: its real daemon too
        with proof.proven_client(pins, timeout=5) as http:
            with pytest.raises(httpx.ConnectError):
                http.get(daemon.base + "/v1/info", headers=AUTH)
    finally:
        squatter.close()


async def test_the_asyncio_client_proves_too(node_daemon):
    daemon, public = node_daemon
    squatter = Squatter(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
    try:
        good = proof.Pins([(daemon.base, NODE, public)])
        async with proof.async_proven_client(good, timeout=60) as http:
            assert (await http.get(daemon.base + "/v1/info", headers=AUTH)).status_code == 200
        bad = proof.Pins([(squatter.url, NODE, public)])
        async with proof.async_proven_client(bad, timeout=5) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(squatter.url + "/v1/info", headers=AUTH)
        assert TOKEN.encode() not in squatter.received
    finally:
        squatter.close()


def test_another_nodes_key_does_not_pass(node_daemon):
    daemon, _ = node_daemon
    _, other = proof.make_key()
    pins = proof.Pins([(daemon.base, NODE, other)])
    with proof.proven_client(pins, timeout=10) as http:
        with pytest.raises(httpx.ConnectError, match="does not verify"):
            http.get(daemon.base + "/v1/info", headers=AUTH)


def test_a_cluster_http_clients_first_contact_is_proven_with_its_configured_key(node_daemon):
    """``cluster+http://HOST:PORT?key=KEY``: before, the first contact trusted the
    address and sent the tenant's token to whoever answered there (a squatter on
    loopback got it). Now the configured key is pinned for that first contact too."""
    import corral
    from corral.cluster.http_directory import HttpDirectory

    daemon, public = node_daemon
    key = proof.url_key(public)
    # the real daemon proves the key and gets the token (it is no Ray node: its 409
    # says it read the request, which a refused token would have made a 401)
    with pytest.raises(corral.DaemonUnavailable, match="HTTP 409"):
        HttpDirectory(daemon.base, TOKEN, public)._ask()
    for squatter in (Squatter(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"),
                     Squatter(relay_to=daemon.port)):  # relays the proof of another port
        try:
            with corral.Client(f"cluster+{squatter.url}?key={key}", token=TOKEN) as client:
                with pytest.raises(corral.DaemonUnavailable, match="did not prove") as refused:
                    corral.Sandbox.list(client=client)
            assert refused.value.details["reason"] == "unproven"
            assert "corral token create" in refused.value.message  # says what to do
            assert TOKEN.encode() not in squatter.received
        finally:
            squatter.close()
    # a configured address without its key is refused before anything is dialled
    with pytest.raises(corral.InvalidArgument, match=r"\?key=KEY"):
        corral.Client(f"cluster+{daemon.base}", token=TOKEN)
