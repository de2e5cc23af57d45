"""corral on a Ray cluster with Ray's token authentication on, and corral's own tokens.

A real three-node ``ray.cluster_utils.Cluster`` in token mode runs in its own process
(:mod:`tests.security.ray_token_cluster`); corral is driven through its CLI and SDK in
child processes whose environment holds Ray's token or not, so this process's Ray
state and environment are never changed. Checked:

- ``corral cluster up/status/down``, ``CORRAL_URL=ray://`` and a node that joins later
  all work with the token, and ``up`` does not warn;
- a client without Ray's token (or with a wrong one) gets a typed 401 that says to set
  ``RAY_AUTH_TOKEN``, not a gRPC traceback, and reads nothing from the KV;
- each daemon accepts only its own node's token (node A's on node B: 401); the peer
  credential opens the read-only peer routes and nothing else (403);
- no token appears in the daemons' logs or in ``cluster status``; ``down`` forgets them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import require_ray_and_root, until

HELPER = Path(__file__).with_name("ray_token_cluster.py")
TIMEOUT = 240


def _env(**auth: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this checkout's corral
    env.pop("CORRAL_URL", None)
    env.pop("RAY_ADDRESS", None)
    return {**env, **auth}


class TokenCluster:
    def __init__(self) -> None:
        self.ray_token = secrets.token_hex(32)
        self.home = Path(tempfile.mkdtemp(prefix="corral-test-home-"))  # no ~/.ray/auth_token
        self.with_token = _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.ray_token,
                               HOME=str(self.home))
        self.without_token = _env(HOME=str(self.home))
        self.base = Path(tempfile.mkdtemp(prefix="corral-test-tokencluster-"))
        os.chmod(self.base, 0o711)  # sandboxes' uid traverses it to their root
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=self.with_token,
        )
        first = self._answer()
        self.address: str = first["address"]
        self.nodes: list[str] = first["nodes"]

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the token cluster's helper exited ({self.proc.wait()})")
        return json.loads(line)

    def add_node(self) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write("add\n")
        self.proc.stdin.flush()
        node: str = self._answer()["node_id"]
        self.nodes.append(node)
        return node

    def corral(self, *args: str, token: bool = True, **env: str) -> subprocess.CompletedProcess:
        base = self.with_token if token else self.without_token
        return subprocess.run([sys.executable, "-m", "corral.cli.main", *args],
                              capture_output=True, text=True, timeout=TIMEOUT, env={**base, **env})

    def python(self, code: str, *args: str, token: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        base = self.with_token if token else self.without_token
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=TIMEOUT, env={**base, **(env or {})})

    def secrets(self) -> dict:
        """Read with Ray's token: every node's token, the peer credential, the entries."""
        out = self.python(READ_SECRETS, self.address)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)


READ_SECRETS = """
import json, sys
from corral.cluster import _ray, auth, bringup
gcs = _ray.gcs(sys.argv[1])
peer = _ray.kv_get(gcs, auth.PEER_TOKEN_KEY)
print(json.dumps({"tokens": auth.node_tokens(gcs), "peer": peer.decode() if peer else None,
                  "entries": bringup.read_entries(gcs)}))
"""

CLIENT = """
import json, corral
sb = corral.Sandbox.create(memory_mb=64)
try:
    out = sb.exec("echo routed", timeout=60).stdout
    listed = sb.id in [s.id for s in corral.Sandbox.list()]
    print(json.dumps({"out": out, "node": sb.info.node, "listed": listed}))
finally:
    sb.delete()
"""

TRAVEL = """
import json, sys, corral
a, b = sys.argv[1], sys.argv[2]
sb = corral.Sandbox.create(memory_mb=64, node=a)
try:
    sb.exec("echo travelled > /tmp/mark", timeout=60, check=True)
    snap = sb.snapshot(name="token-travel")
    try:
        copy = snap.restore(node=b)
        print(json.dumps({"node": copy.info.node, "mark": copy.files.read("/tmp/mark").decode()}))
        copy.delete()
    finally:
        snap.delete()
finally:
    sb.delete()
"""

RAW_KV_READ = """
import sys
from ray._raylet import GcsClient
try:
    value = GcsClient(address=sys.argv[1]).internal_kv_get(b"peer-token", b"corral", timeout=5)
    print("READ", value is not None)
except Exception as exc:
    print("REFUSED", type(exc).__name__)
"""


@pytest.fixture(scope="module")
def token_cluster():
    require_ray_and_root()
    c = TokenCluster()
    try:
        yield c
    finally:
        c.corral("cluster", "down", "--address", c.address)
        c.stop()


@pytest.fixture(scope="module")
def corral_up(token_cluster):
    c = token_cluster
    up = c.corral("cluster", "up", "--address", c.address, "--state-dir", str(c.base), "--json")
    assert up.returncode == 0, up.stderr
    assert "warning:" not in up.stderr  # Ray's token auth is on: nothing to warn of
    assert sorted(n["node_id"] for n in json.loads(up.stdout)["nodes"]) == sorted(c.nodes)
    return c


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_client_without_rays_token_gets_a_typed_401_and_reads_no_kv(token_cluster):
    c = token_cluster
    for kwargs in ({"token": False}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x" * 64}):
        ls = c.corral("ls", CORRAL_URL=f"ray://{c.address}", **kwargs)
        assert ls.returncode != 0
        assert "RAY_AUTH_TOKEN" in ls.stderr and "ray get-auth-token" in ls.stderr, ls.stderr
        assert "Traceback" not in ls.stderr
        status = c.corral("cluster", "status", "--address", c.address, **kwargs)
        assert status.returncode != 0 and "RAY_AUTH_TOKEN" in status.stderr, status.stderr
        assert "Traceback" not in status.stderr
    sdk = c.python(
        "import sys, corral\n"
        "try:\n"
        "    corral.Sandbox.list(client=corral.Client('ray://' + sys.argv[1]))\n"
        "except corral.Unauthorized as exc:\n"
        "    print('Unauthorized', exc.status)\n", c.address, token=False)
    assert sdk.stdout.strip() == "Unauthorized 401", sdk.stdout + sdk.stderr
    raw = c.python(RAW_KV_READ, c.address, token=False)  # Ray's own client, no token
    assert raw.stdout.startswith("REFUSED"), raw.stdout + raw.stderr


def test_cluster_up_status_and_the_sdk_work_with_rays_token(corral_up):
    c = corral_up
    status = c.corral("cluster", "status", "--address", c.address, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["gcs_authenticated"] is True
    alive = [n for n in report["nodes"] if n["alive"]]
    assert sorted(n["node_id"] for n in alive) == sorted(c.nodes)
    assert all(n["daemon"] and n["sandboxes"] == 0 for n in alive), alive

    run = c.python(CLIENT, env={"CORRAL_URL": f"ray://{c.address}"})
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["out"] == "routed\n" and result["listed"] and result["node"] in c.nodes

    # A snapshot taken on one node restores on another: daemon B finds daemon A through
    # Ray's KV (with Ray's token) and fetches the layers with the peer credential.
    a, b = sorted(c.nodes)[:2]
    run = c.python(TRAVEL, a, b, env={"CORRAL_URL": f"ray://{c.address}"})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"node": b, "mark": "travelled\n"}

    doctor = c.corral("doctor", "--json", CORRAL_URL=f"ray://{c.address}")
    check = next(x for x in json.loads(doctor.stdout) if x["name"] == "cluster")
    assert check["status"] == "OK", check


def test_each_daemon_takes_only_its_own_token_and_the_peer_credential_only_reads(corral_up):
    c = corral_up
    found = c.secrets()
    tokens, peer, entries = found["tokens"], found["peer"], found["entries"]
    assert sorted(tokens) == sorted(entries) and len(set(tokens.values())) == len(tokens)
    assert peer and peer not in tokens.values()
    a, b = sorted(entries)[:2]
    url_a, url_b = entries[a]["url"], entries[b]["url"]
    with httpx.Client(timeout=60) as http:
        assert http.get(f"{url_a}/v1/info", headers=_bearer(tokens[a])).status_code == 200
        # Node A's token is nothing on node B (a leak from one node stays on that node).
        for method, path in (("GET", "/v1/info"), ("GET", "/v1/sandboxes"),
                             ("POST", "/v1/sandboxes"), ("GET", "/v1/peer/layers/" + "0" * 64)):
            r = http.request(method, url_b + path, headers=_bearer(tokens[a]), json={})
            assert r.status_code == 401, (method, path, r.text)
        # The peer credential: the read-only peer routes answer (404: nothing of that
        # name here), every other route is 403 before it runs.
        for path in ("/v1/peer/snapshots/nothing-here", "/v1/peer/images/nothing-here",
                     "/v1/peer/layers/sha256:" + "0" * 64):
            r = http.get(url_b + path, headers=_bearer(peer))
            assert r.status_code in (400, 404), (path, r.status_code, r.text)
        refused = [("GET", "/v1/info"), ("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"),
                   ("GET", "/v1/peer/stats"), ("POST", "/v1/peer/snapshots/fetch"),
                   ("POST", "/v1/peer/images/fetch"), ("GET", "/v1/tenants"),
                   ("DELETE", "/v1/snapshots/x"), ("GET", "/metrics"), ("GET", "/v1/images")]
        for method, path in refused:
            r = http.request(method, url_b + path, headers=_bearer(peer), json={})
            assert r.status_code == 403, (method, path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "forbidden"
    # No token in what the daemons logged, nor in what `cluster status` prints.
    status = c.corral("cluster", "status", "--address", c.address)
    logs = "".join(Path(e["state_dir"], "daemon.log").read_text(errors="replace")
                   for e in entries.values())
    for secret in [*tokens.values(), peer, c.ray_token]:
        assert secret not in status.stdout + status.stderr + logs


def test_a_node_that_joins_gets_a_daemon_with_its_own_token(corral_up):
    c = corral_up
    before = c.secrets()["tokens"]
    node = c.add_node()

    def registered():
        found = c.secrets()
        return found if node in found["entries"] and node in found["tokens"] else None

    found = until(registered, "a daemon on the node that joined")
    assert found["tokens"][node] not in before.values()
    url = found["entries"][node]["url"]
    assert httpx.get(f"{url}/v1/info", headers=_bearer(found["tokens"][node]),
                     timeout=60).status_code == 200
    first = sorted(before)[0]
    assert httpx.get(f"{url}/v1/info", headers=_bearer(before[first]),
                     timeout=60).status_code == 401


def test_a_daemon_restarted_by_ray_gets_its_token_again(corral_up):
    c = corral_up
    found = c.secrets()
    node = sorted(found["entries"])[-1]
    old = found["entries"][node]
    os.kill(old["pid"], signal.SIGKILL)  # a daemon started by `cluster up` (we are root)

    def restarted():
        now = c.secrets()
        entry = now["entries"].get(node)
        return now if entry and entry["pid"] != old["pid"] else None

    now = until(restarted, "Ray to restart the daemon")
    assert now["tokens"][node] == found["tokens"][node]
    assert httpx.get(now["entries"][node]["url"] + "/v1/info", timeout=60,
                     headers=_bearer(found["tokens"][node])).status_code == 200


def test_down_stops_every_daemon_and_forgets_every_token(corral_up):
    c = corral_up
    found = c.secrets()
    down = c.corral("cluster", "down", "--address", c.address)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == f"stopped {len(found['entries'])} daemons"
    after = c.secrets()
    assert after == {"tokens": {}, "peer": None, "entries": {}}
    for e in found["entries"].values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{e['url']}/v1/info", timeout=5)
