"""Helpers of the tests of tenants on a cluster (tests/cluster/test_tenants.py and
tests/security/test_cluster_tenants.py): tokens made through the cluster, each node's
daemon over plain HTTP, the CLI run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import httpx

import corral
from corral.cluster import _ray, auth, proof
from corral.cluster.bringup import read_entries
from corral.cluster.directory import Directory

CLI_TIMEOUT_S = 120


def unique(prefix: str) -> str:
    """A tenant name no other test of the session used (the registry outlives tests)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def admin(cluster) -> corral.Client:
    return corral.Client(f"ray://{cluster.address}")


def make_tenant(cluster, name: str, **quotas) -> str:
    """A tenant made through the cluster (the admin's ray:// client): its token."""
    with admin(cluster) as c:
        made = c.request("POST", "/v1/tokens", json={"name": name, **quotas}).json()
    return made["token"]


def tenant_client(cluster, token: str) -> corral.Client:
    return corral.Client(f"ray://{cluster.address}", token=token)


def daemons(cluster) -> dict[str, str]:
    """``{node id: daemon URL}`` of every alive node."""
    return {n.node_id: n.url for n in Directory(cluster.address).nodes()}


def cluster_urls(cluster) -> dict[str, str]:
    """``{node id: cluster+http://HOST:PORT?key=KEY}``: how a client outside Ray is
    configured to start from that node's daemon (as `corral cluster up` prints it)."""
    return {n.node_id: f"cluster+{n.url}?key={proof.url_key(n.key)}"
            for n in Directory(cluster.address).nodes()}


def admin_tokens(cluster) -> dict[str, str]:
    """``{node id: its daemon's own admin token}``."""
    return {n.node_id: n.token for n in Directory(cluster.address).nodes()}


def secrets(cluster) -> list[str]:
    """Every credential of the cluster's daemons: each node's admin token, the peer one."""
    peer = _ray.kv_get(_ray.gcs(_ray.resolve(cluster.address)), auth.PEER_TOKEN_KEY)
    return [*admin_tokens(cluster).values(), *([peer.decode()] if peer else [])]


def entries(cluster) -> dict[str, dict]:
    return read_entries(_ray.gcs(_ray.resolve(cluster.address)))


def on(url: str, token: str) -> httpx.Client:
    """One daemon, straight over HTTP, with ``token``."""
    return httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"})


def cli(*args: str, url: str, token: str | None = None) -> subprocess.CompletedProcess:
    """``corral ARGS`` as a process, with CORRAL_URL=url (and CORRAL_TOKEN)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_TOKEN", "CORRAL_URL")}
    env["CORRAL_URL"] = url
    if token:
        env["CORRAL_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "corral.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def cli_json(*args: str, url: str, token: str | None = None):
    done = cli(*args, url=url, token=token)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
