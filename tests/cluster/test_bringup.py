"""``corral cluster up | status | down`` on a real three-node Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import corral
from corral.cluster import _ray, auth, bringup, tenant_registry
from corral.runtime.cgroups import detect
from corral.runtime.paths import Layout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _tokens(address: str) -> dict[str, str]:
    return auth.node_tokens(_ray.gcs(address))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corral.cli.main", *args],
        capture_output=True, text=True, timeout=240, env=os.environ,
    )


def test_up_status_down_is_idempotent_and_leaves_nothing(ray_cluster):
    base = ray_cluster.base / "bringup"
    entries = bringup.up(ray_cluster.address, state_dir=str(base))
    assert sorted(e["node_id"] for e in entries) == ray_cluster.node_ids()
    assert len({e["url"] for e in entries}) == len({e["state_dir"] for e in entries}) == 3
    again = bringup.up(ray_cluster.address, state_dir=str(base))
    assert [(e["node_id"], e["pid"], e["url"]) for e in again] == [
        (e["node_id"], e["pid"], e["url"]) for e in entries
    ]

    # Each daemon accepts its own node's token, and only it; a sandbox on every node.
    tokens = _tokens(ray_cluster.address)
    assert sorted(tokens) == ray_cluster.node_ids() and len(set(tokens.values())) == 3
    made = []
    for e in entries:
        assert httpx.get(f"{e['url']}/v1/info").status_code == 401
        reply = httpx.post(
            f"{e['url']}/v1/sandboxes", json={"memory_mb": 64},
            headers={"Authorization": f"Bearer {tokens[e['node_id']]}"}, timeout=60,
        )
        assert reply.status_code == 201, reply.text
        assert reply.json()["id"].startswith(f"sb-{e['node_id'][:10]}-")
        assert reply.json()["node"] == e["node_id"]
        made.append(reply.json()["id"])
        # its own image cache, seeded from the host's (runtime/cache_seed.py), not the host's
        own = Path(e["state_dir"]) / "cache" / "images" / "python" / "manifest.json"
        assert own.is_file() and own.stat().st_nlink > 1

    report = _cli("cluster", "status", "--address", ray_cluster.address, "--json")
    assert report.returncode == 0, report.stderr
    nodes = [n for n in json.loads(report.stdout)["nodes"] if n["alive"]]  # not removed ones
    assert [n["node_id"] for n in nodes] == ray_cluster.node_ids()
    assert all(n["alive"] and n["daemon"] and n["sandboxes"] == 1 for n in nodes)
    assert all(n["capacity"]["max_sandboxes"] > 0 for n in nodes)
    assert json.loads(report.stdout)["gcs_authenticated"] is False  # a cluster without Ray's auth
    secrets_ = [*tokens.values(), auth.peer_token(_ray.gcs(ray_cluster.address))]
    logs = "".join((Path(e["state_dir"]) / "daemon.log").read_text() for e in entries)
    assert not any(t in report.stdout + report.stderr + logs for t in secrets_)

    gcs = _ray.gcs(ray_cluster.address)
    assert _ray.kv_keys(gcs, tenant_registry.CAPACITY_KEY)  # each daemon published its caps
    assert bringup.down(ray_cluster.address) == 3
    for e in entries:
        assert not _pid_alive(e["pid"])
        state = Path(e["state_dir"]) / "state"
        key = Layout(state.absolute(), Path("/unused")).engine_key
        assert detect().children(f"corral/{key}") == []
        assert str(state) not in Path("/proc/self/mountinfo").read_text()
        assert not Path(e["state_dir"]).exists()  # its state, snapshots and log: removed
    assert os.listdir(base) == []
    # no per-node key outlives its node
    for prefix in (tenant_registry.CAPACITY_KEY, tenant_registry.USAGE_KEY, "node:"):
        assert _ray.kv_keys(gcs, prefix) == [], prefix
    assert bringup.down(ray_cluster.address) == 0
    after = bringup.status(ray_cluster.address)["nodes"]
    assert len([n for n in after if n["alive"]]) == 3
    assert all(n["daemon"] is None for n in after)
    gcs = _ray.gcs(ray_cluster.address)  # every token forgotten
    assert auth.node_tokens(gcs) == {} and _ray.kv_get(gcs, auth.PEER_TOKEN_KEY) is None
    # A cluster with no corral daemons: the error says what to run.
    with pytest.raises(corral.DaemonUnavailable, match="corral cluster up --address"):
        corral.Sandbox.list(client=corral.Client(f"ray://{ray_cluster.address}"))


def test_cli_up_and_down(ray_cluster):
    base = ray_cluster.base / "cli"
    up = _cli("cluster", "up", "--address", ray_cluster.address, "--state-dir", str(base),
              "--json")
    assert up.returncode == 0, up.stderr
    assert len(json.loads(up.stdout)["nodes"]) == 3
    # This cluster runs without Ray's token auth: one line says what that exposes and how
    # to turn it on; the human status says it too.
    warned = [line for line in up.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "GCS port" in warned[0] and "RAY_AUTH_MODE=token" in warned[0]
    status = _cli("cluster", "status", "--address", ray_cluster.address)
    assert status.returncode == 0 and "RAY_AUTH_MODE=token" in status.stderr
    doctor = subprocess.run(
        [sys.executable, "-m", "corral.cli.main", "doctor", "--json"], capture_output=True,
        text=True, timeout=240, env={**os.environ, "CORRAL_URL": f"ray://{ray_cluster.address}"})
    check = next(c for c in json.loads(doctor.stdout) if c["name"] == "cluster")
    assert check["status"] == "WARN" and "GCS port" in check["detail"], check
    down = _cli("cluster", "down", "--address", ray_cluster.address)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stopped 3 daemons"


def test_a_daemon_that_cannot_start_leaves_nothing_running(ray_cluster):
    with pytest.raises(corral.DaemonUnavailable, match="max_starting must be at least 1"):
        bringup.up(ray_cluster.address, state_dir=str(ray_cluster.base / "bad"),
                   daemon_args=["--max-starting", "0"])
    assert all(n["daemon"] is None for n in bringup.status(ray_cluster.address)["nodes"])
    assert _ray.kv_get(_ray.gcs(ray_cluster.address), "config") is None
    assert not (ray_cluster.base / "bad").exists() or os.listdir(ray_cluster.base / "bad") == []
    assert bringup.down(ray_cluster.address) == 0


def test_cli_reports_a_missing_cluster():
    proc = _cli("cluster", "status", "--address", "127.0.0.1:1")
    assert proc.returncode == 1
    assert "no Ray cluster answers" in proc.stderr and "ray start --head" in proc.stderr


def test_a_daemon_that_dies_is_restarted_and_clients_follow_it(corral_cluster):
    import signal
    import time

    node = corral_cluster.node_ids()[1]
    with corral.Client(f"ray://{corral_cluster.address}") as client:
        before = corral.Sandbox.create(memory_mb=64, node=node, client=client)
        old = bringup.read_entries(_ray.gcs(corral_cluster.address))[node]
        token = _tokens(corral_cluster.address)[node]
        os.kill(old["pid"], signal.SIGKILL)  # the daemon `cluster up` started there

        def restarted():
            entry = bringup.read_entries(_ray.gcs(corral_cluster.address)).get(node)
            return entry if entry and entry["pid"] != old["pid"] else None

        for _ in range(600):  # x 0.1 s
            new = restarted()
            if new:
                break
            time.sleep(0.1)
        assert new, "Ray did not restart the node's daemon"
        assert _tokens(corral_cluster.address)[node] == token  # it got its token again
        # The same client reaches the new daemon, which reconciled its state directory
        # as after any crash: the old sandbox is gone (ended, or deleted).
        after = corral.Sandbox.create(memory_mb=64, node=node, client=client)
        try:
            assert after.exec("echo back", timeout=30).stdout == "back\n"
            with pytest.raises((corral.InvalidState, corral.SandboxLost, corral.SandboxNotFound)):
                before.exec("true", timeout=10)
        finally:
            after.delete()
            before.delete()
