"""A built image travels: built once on node A, used on B and C, whose daemons pull its
layers from A's (each layer crosses once per node, counted by the receiving daemon).

On one host every Ray node shares the machine's image cache, so an image built on one
is on all already; here three real daemons get image caches of their own (the default
``python`` image hard-linked into each, so that its digest is the same everywhere, as
on hosts given one image), and find each other through ``CORRAL_PEERS``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import socket
import subprocess

import httpx
import pytest

import corral
from corral.runtime.paths import default_cache_dir
from tests.conftest import Daemon, _base_dir, have_root_runtime

TOKEN = secrets.token_urlsafe(16)
NODES = ("a" * 12, "b" * 12, "c" * 12)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def three(monkeypatch):
    if not have_root_runtime() or not (default_cache_dir() / "images" / "python").is_dir():
        pytest.skip("needs root and the default image (python -m corral.runtime.prepare)")
    ports = {n: _port() for n in NODES}
    peers = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    monkeypatch.setenv("CORRAL_PEERS", json.dumps(peers))
    monkeypatch.setenv("CORRAL_TOKEN", TOKEN)
    daemons = []
    try:
        for n in NODES:
            base = _base_dir()
            cache = base / "cache"
            (cache / "images").mkdir(parents=True)
            for part in ("bin", "share", "images/python"):
                subprocess.run(["cp", "-al", str(default_cache_dir() / part), str(cache / part)],
                               check=True)
            d = Daemon(base, ["--cache-dir", str(cache), "--tcp", f"127.0.0.1:{ports[n]}"])
            daemons.append(d.start())
        yield {n: (d, peers[n]) for n, d in zip(NODES, daemons, strict=True)}
    finally:
        for d in daemons:
            d.stop()
            shutil.rmtree(d.base, ignore_errors=True)


def _http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"})


def test_an_image_built_on_a_is_used_on_b_and_c_each_layer_fetched_once(three):
    a, b, c = NODES
    name = f"t-travel-{secrets.token_hex(4)}"
    mark = secrets.token_hex(8)
    spec = {"steps": [{"run": f"mkdir -p /home/sandbox/t && echo {mark} > /home/sandbox/t/mark"},
                      {"run": "head -c 2000000 /dev/urandom > /home/sandbox/t/blob"}]}
    with corral.Client(three[a][0].url) as ca:
        img = corral.Image.build(spec, name=name, client=ca)
        sb = corral.Sandbox.create(image=name, memory_mb=64, client=ca)
        expected = sb.exec("sha256sum /home/sandbox/t/blob; cat /home/sandbox/t/mark", timeout=60).stdout
        sb.delete()
    assert mark in expected
    for node in (b, c):
        with _http(three[node][1]) as http:
            assert name not in [i["name"] for i in http.get("/v1/images").json()["images"]]
            body = {"image": name, "node": a}
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two first uses at once
                replies = list(pool.map(
                    lambda b: http.post("/v1/peer/images/fetch", json=b), [body, body]))
            assert [r.status_code for r in replies] == [200, 200], replies[0].text
            assert replies[0].json()["digest"] == img.digest
            stats = http.get("/v1/peer/stats").json()
            assert stats["layers"] == 2 and set(stats["by_digest"].values()) == {1}
            assert stats["bytes"] > 2_000_000
            assert http.post("/v1/peer/images/fetch", json=body).status_code == 200  # again
            assert http.get("/v1/peer/stats").json()["layers"] == 2  # nothing crossed
        with corral.Client(three[node][0].url) as cn:
            sb = corral.Sandbox.create(image=name, memory_mb=64, client=cn)
            assert sb.exec("sha256sum /home/sandbox/t/blob; cat /home/sandbox/t/mark", timeout=60).stdout == expected
            sb.delete()


def test_what_does_not_travel_says_why(three):
    a, b, _ = NODES
    with _http(three[b][1]) as http:
        r = http.post("/v1/peer/images/fetch", json={"image": "python", "node": a})
        assert r.status_code == 200  # already here, the same digest: nothing to do
        assert http.get("/v1/peer/stats").json()["layers"] == 0
        r = http.post("/v1/peer/images/fetch", json={"image": "nope", "node": a})
        assert r.json()["error"]["code"] == "image_not_found", r.text
        r = http.post("/v1/peer/images/fetch", json={"image": "x", "node": "elsewhere"})
        assert r.status_code == 400 and "CORRAL_PEERS" in r.text
        r = http.post("/v1/peer/images/fetch", json={"image": "../../etc", "node": a})
        assert r.status_code == 400
    with _http(three[a][1]) as http:  # a layer of no image or snapshot here: not served
        assert http.get("/v1/peer/layers/sha256:" + "1" * 64).status_code == 404
        assert http.get("/v1/peer/layers/etc%2Fpasswd").status_code in (400, 404)
        assert httpx.get(three[a][1] + "/v1/peer/stats").status_code == 401  # no token
    assert not os.environ.get("CORRAL_RAY_GCS")
