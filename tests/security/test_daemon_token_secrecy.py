"""A sandbox cannot read the tokens of the daemon that runs it, nor use the peer credential.

A cluster's daemon holds its node's admin token (``CORRAL_TOKEN``), the cluster's peer
credential (``CORRAL_PEER_TOKEN``) and Ray's token (``RAY_AUTH_TOKEN``) in its
environment, as ``corral cluster up`` starts it. Code in a sandbox, even one on the
host's network (``--allow-host-network``), looks for them everywhere it can: every
``/proc/*/environ`` and ``cmdline`` it sees, the daemon's own ``/proc/<pid>``, the
daemon's state directory and socket, and every small file of its filesystem. The
probe checks what it reads against the tokens' SHA-256 (it is never given a token),
and proves it would see one: a decoy passed in its own environment must be found.

And the peer credential, held by every daemon of a cluster, opens the read-only peer
routes only: any other route is 403 before it runs.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import socket

import httpx
import pytest

import corral
from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime

PROBE = r'''
import hashlib, json, os, re, sys
targets = dict(pair.split(":")[::-1] for pair in sys.argv[1].split(","))  # sha -> label
lengths = {int(n) for n in sys.argv[2].split(",")}
daemon_pid, state_dir, sock, url = sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
runs = re.compile(rb"[A-Za-z0-9_\-]+")
found, opened, refused = [], 0, []
def scan(data, where):
    for m in runs.finditer(data):
        run = m.group()
        for n in lengths:
            for i in range(0, max(0, len(run) - n) + 1):
                label = targets.get(hashlib.sha256(run[i:i + n]).hexdigest())
                if label:
                    found.append(f"{label} in {where}")
def read(path, limit=1 << 18):
    global opened
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
    except OSError as exc:
        refused.append(f"{path}: {exc.strerror}")
        return
    opened += 1
    scan(data, path)
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for part in ("environ", "cmdline"):
            read(f"/proc/{pid}/{part}")
for path in (f"/proc/{daemon_pid}/environ", f"/proc/{daemon_pid}/cmdline", sock,
             os.path.join(state_dir, "registry.db")):
    read(path)
try:
    os.listdir(state_dir)
    refused.append("LISTED " + state_dir)
except OSError:
    pass
files = 0
for root, dirs, names in os.walk("/"):
    if root == "/":
        # the image's own programs and libraries (the host's cache, read-only) are skipped
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev", "usr", "lib", "lib64",
                                                 "bin", "sbin")]
    for name in names:
        path = os.path.join(root, name)
        if files < 20000 and os.path.isfile(path) and not os.path.islink(path):
            files += 1
            read(path)
import urllib.request, urllib.error
try:
    urllib.request.urlopen(url + "/v1/info", timeout=10)
    answer = 200
except urllib.error.HTTPError as exc:
    answer = exc.code
except OSError as exc:
    answer = str(exc)
print(json.dumps({"found": sorted(set(found)), "opened": opened, "files": files,
                  "listed": [r for r in refused if r.startswith("LISTED")], "info": answer}))
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture
def cluster_daemon(monkeypatch):
    """A daemon started as a cluster's node actor starts one: tokens in its environment,
    on TCP, sandboxes allowed the host's network."""
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    tokens = {"CORRAL_TOKEN": secrets.token_urlsafe(32),
              "CORRAL_PEER_TOKEN": secrets.token_urlsafe(32),
              "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for name, value in tokens.items():
        monkeypatch.setenv(name, value)
    port = _port()
    d = Daemon(_base_dir(), ["--tcp", f"127.0.0.1:{port}", "--allow-host-network"])
    try:
        yield d.start(), f"http://127.0.0.1:{port}", tokens
    finally:
        d.stop()
        log = d.log.read_text(errors="replace") if d.log.exists() else ""
        shutil.rmtree(d.base, ignore_errors=True)
        assert not any(t in log for t in tokens.values()), "a token in the daemon's log"


def test_a_sandbox_on_the_host_network_finds_no_token(cluster_daemon):
    daemon, url, tokens = cluster_daemon
    decoy = secrets.token_urlsafe(32)
    wanted = [*tokens.values(), decoy]
    labelled = [*(f"{name}:{_sha(t)}" for name, t in tokens.items()), f"DECOY:{_sha(decoy)}"]
    args = [",".join(labelled), ",".join(str(n) for n in {len(t) for t in wanted}),
            str(daemon.proc.pid), str(daemon.state_dir), str(daemon.socket), url]
    with corral.Client(url, token=tokens["CORRAL_TOKEN"]) as client, corral.Sandbox.create(
        network="host", memory_mb=128, client=client
    ) as sb:
        assert sb.info.spec.network.value == "host"
        sb.files.write("/tmp/probe.py", PROBE)
        result = sb.exec(["python3", "/tmp/probe.py", *args], env={"DECOY": decoy},
                         timeout=300, check=True)
    report = json.loads(result.stdout)
    # The probe works: it found the decoy in its own environment, and read much.
    assert report["opened"] > 20 and report["files"] > 20, report
    found = {where.split(" in ")[0] for where in report["found"]}
    assert found == {"DECOY"}, report  # ...and no token of the daemon's anywhere
    assert report["listed"] == [], report
    assert report["info"] == 401  # the daemon answers the host network: not without a token


def test_the_peer_credential_opens_only_the_peer_reads(cluster_daemon):
    daemon, url, tokens = cluster_daemon
    peer = {"Authorization": f"Bearer {tokens['CORRAL_PEER_TOKEN']}"}
    admin = {"Authorization": f"Bearer {tokens['CORRAL_TOKEN']}"}
    with httpx.Client(base_url=url, timeout=60) as http:
        made = http.post("/v1/sandboxes", json={"memory_mb": 64}, headers=admin)
        assert made.status_code == 201, made.text
        sandbox = made.json()["id"]
        try:
            assert http.post(f"/v1/sandboxes/{sandbox}/snapshot", json={"name": "peer-read"},
                             headers=admin).status_code in (200, 201)
            described = http.get("/v1/peer/snapshots/peer-read", headers=peer)
            assert described.status_code == 200, described.text
            digest = described.json()["layers"][0]["digest"]
            with http.stream("GET", f"/v1/peer/layers/{digest}", headers=peer) as layer:
                assert layer.status_code == 200
            image = http.get("/v1/peer/images/python", headers=peer)  # builtin: does not travel
            assert image.status_code not in (401, 403), image.text
            for method, path, body in [
                ("GET", "/v1/info", None), ("GET", "/v1/sandboxes", None),
                ("POST", "/v1/sandboxes", {"memory_mb": 64}),
                ("POST", f"/v1/sandboxes/{sandbox}/exec", {"cmd": "id"}),
                ("DELETE", f"/v1/sandboxes/{sandbox}", None),
                ("DELETE", "/v1/snapshots/peer-read", None), ("GET", "/v1/snapshots", None),
                ("GET", "/v1/peer/stats", None),
                ("POST", "/v1/peer/snapshots/fetch", {"snapshot": "x", "node": "n"}),
                ("POST", "/v1/peer/images/fetch", {"image": "x", "node": "n"}),
                ("HEAD", "/v1/peer/snapshots/peer-read", None),
                ("GET", "/v1/peer/snapshots/peer-read/", None),
                ("GET", "/v1/tokens", None), ("GET", "/metrics", None),
            ]:
                r = http.request(method, path, json=body, headers=peer)
                assert r.status_code == 403, (method, path, r.status_code, r.text)
            # Paths that look like a peer read but climb out of it reach nothing else.
            for path in ("/v1/peer/layers/..", "/v1/peer/snapshots/..%2F..%2Fv1%2Finfo",
                         "/v1/peer/images/x%2F..%2F..%2Fsandboxes", "/v1/peer/layers/%2e%2e",
                         "/v1/peer/snapshots/../../v1/info", "/v1/peer//v1/info"):
                r = http.get(path, headers=peer)
                assert r.status_code in (400, 403, 404), (path, r.status_code, r.text)
                assert sandbox not in r.text and "capacity" not in r.text
            # The dashboard takes no bearer token at all (its own session, whose login
            # asks the guard: 403 for this credential).
            assert http.get("/ui/api/sandboxes", headers=peer).status_code == 401
            # The sandbox and its snapshot are still there.
            assert http.get(f"/v1/sandboxes/{sandbox}", headers=admin).status_code == 200
            # The peer credential is no E2B, SandboxFusion or dashboard key either.
            e2b = http.get("/sandboxes", headers={"X-API-KEY": tokens["CORRAL_PEER_TOKEN"]})
            assert e2b.status_code == 401
        finally:
            http.delete("/v1/snapshots/peer-read", headers=admin)
            http.delete(f"/v1/sandboxes/{sandbox}", headers=admin)
