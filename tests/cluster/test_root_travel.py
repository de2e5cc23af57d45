"""Root images travel: on a cluster whose nodes each have an image cache of their own,
and a default image ``python`` of their own with another digest, an image built on one
node runs on the others (which pull its root too, once, under an internal name, never
over their own ``python``), and an image imported on one node runs on another.

Honest about the setup: debootstrapping ``python`` three times would take minutes,
so node A's cache gets this host's ``python`` (hard-linked) and nodes B and C get a
copy of it with one file added (``/etc/corral-node``, naming the node), published
with a recipe of their own: a different tree and digest, as on hosts that built
``python`` apart. corral is brought up on the session's Ray cluster with
``--cache-dir .../{node}`` (one cache per node), then brought back as it was.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import corral
from corral.cluster.ids import node_tag
from corral.runtime.images import ImageStore
from corral.runtime.paths import default_cache_dir
from tests.cluster.test_travel import _daemon, _stats
from tests.runtime.oci_archives import CONFIG, base_layer, docker_save, oci_layout, second_layer
from tests.runtime.registries import requires_registry, run_registry

TAG = "test-root-travel"
SHOW = "sha256sum /home/sandbox/t/blob; cat /home/sandbox/t/mark; cat /etc/corral-node || true"


def _own_python(cache: Path, tag: str) -> None:
    """``python`` of the host with ``/etc/corral-node`` added: another tree and digest."""
    src = default_cache_dir() / "images" / "python"
    work = cache / "work"
    subprocess.run(["cp", "-al", str(src / "rootfs"), str(work)], check=True)
    (work / "etc/corral-node").write_text(tag + "\n")
    os.chmod(work / "etc/corral-node", 0o644)
    manifest = json.loads((src / "manifest.json").read_text())
    store = ImageStore(cache / "images")
    store.add_rootfs("python", work, move=True,
                     source={**manifest["source"], "node": tag},
                     extra={"kind": "debootstrap", "debian": manifest.get("debian")})


@pytest.fixture(scope="module")
def nodes(ray_cluster):
    """corral on the session's cluster with a cache per node: ``(A, B, C)`` node ids."""
    from corral.cluster import bringup

    if not (default_cache_dir() / "images" / "python").is_dir():
        pytest.skip("needs the default image (python -m corral.runtime.prepare)")
    bringup.down(ray_cluster.address)  # the session's corral (one cache), if it is up
    base = Path(tempfile.mkdtemp(prefix="corral-test-roots-"))
    os.chmod(base, 0o711)
    ids = ray_cluster.node_ids()
    try:
        for i, node in enumerate(ids):
            cache = base / "cache" / node_tag(node)
            (cache / "images").mkdir(parents=True)
            os.chmod(base / "cache", 0o711)
            os.chmod(cache, 0o711)
            for part in ("bin", "share", *(["images/python"] if i == 0 else [])):
                subprocess.run(["cp", "-al", str(default_cache_dir() / part), str(cache / part)],
                               check=True)
            if i:
                _own_python(cache, node_tag(node))
        bringup.up(ray_cluster.address, state_dir=str(base / "state"),
                   cache_dir=str(base / "cache" / "{node}"))
        yield ids
    finally:
        bringup.down(ray_cluster.address)
        shutil.rmtree(base, ignore_errors=True)
        bringup.up(ray_cluster.address, state_dir=str(ray_cluster.base))  # as it was


@pytest.fixture
def client(ray_cluster, nodes):
    with corral.Client(f"ray://{ray_cluster.address}") as c:
        yield c
        for sb in corral.Sandbox.list(tags=[TAG], client=c):
            sb.delete()


def _images(cluster, node: str) -> dict[str, dict]:
    with _daemon(cluster, node) as http:
        return {i["name"]: i for i in http.get("/v1/images").raise_for_status().json()["images"]}


def _run(sb, cmd: str) -> str:
    r = sb.exec(["sh", "-c", cmd], timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_an_image_built_on_a_runs_on_b_and_c_which_keep_their_own_python(
        client, ray_cluster, nodes):
    pythons = {n: _images(ray_cluster, n)["python"]["digest"] for n in nodes}
    assert len(set(pythons.values())) == 3  # three builds of python, three digests
    name = f"t-roots-{secrets.token_hex(4)}"
    mark = secrets.token_hex(8)
    spec = {"steps": [{"run": f"mkdir -p /home/sandbox/t && echo {mark} > /home/sandbox/t/mark"},
                      {"run": "head -c 2000000 /dev/urandom > /home/sandbox/t/blob"}]}
    corral.Image.build(spec, name=name, client=client)
    a = next(n for n in nodes if name in _images(ray_cluster, n))
    others = [n for n in nodes if n != a]
    sb = corral.Sandbox.create(image=name, node=a, memory_mb=64, tags=[TAG], client=client)
    expected = _run(sb, SHOW)
    assert mark in expected
    for node in others:
        before = _stats(ray_cluster, node)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two first uses at once
            pair = list(pool.map(lambda n: corral.Sandbox.create(
                image=name, node=n, memory_mb=64, tags=[TAG], client=client), [node, node]))
        assert [s.info.node for s in pair] == [node, node]
        for s in pair:
            assert _run(s, SHOW) == expected  # A's root below: no /etc/corral-node
        after = _stats(ray_cluster, node)
        crossed = {d: k - before["by_digest"].get(d, 0) for d, k in after["by_digest"].items()}
        crossed = {d: k for d, k in crossed.items() if k}
        assert len(crossed) == 3 and set(crossed.values()) == {1}  # root + 2 layers, once
        assert after["bytes"] - before["bytes"] > 100_000_000  # the root crossed
        here = _images(ray_cluster, node)
        assert here["python"]["digest"] == pythons[node]  # its own, unchanged
        assert any(n.startswith("root-") for n in here), sorted(here)
        own = corral.Sandbox.create(node=node, memory_mb=64, tags=[TAG], client=client)
        assert _run(own, "cat /etc/corral-node") == node_tag(node) + "\n"  # still its own
    again = corral.Sandbox.create(image=name, node=others[0], memory_mb=64, tags=[TAG],
                                  client=client)
    assert _run(again, SHOW) == expected
    for node in others:  # nothing crossed a second time
        assert set(_stats(ray_cluster, node)["by_digest"].values()) == {1}


def test_an_image_imported_on_a_runs_on_b(client, ray_cluster, nodes, tmp_path):
    name = f"t-import-{secrets.token_hex(4)}"
    rootfs = default_cache_dir() / "images" / "python" / "rootfs"
    archive = tmp_path / "image.tar"
    archive.write_bytes(docker_save([base_layer(rootfs).bytes(), second_layer().bytes()]))
    image = corral.Image.import_archive(archive, name=name, client=client)
    assert image.kind == "oci"
    a = next(n for n in nodes if name in _images(ray_cluster, n))
    b = next(n for n in nodes if n != a)
    show = "cat /opt/keep/k.txt; echo $GREETING; pwd"
    on_a = corral.Sandbox.create(image=name, node=a, memory_mb=64, tags=[TAG], client=client)
    expected = _run(on_a, show)
    assert "hello from oci" in expected
    on_b = corral.Sandbox.create(image=name, node=b, memory_mb=64, tags=[TAG], client=client)
    assert on_b.info.node == b
    assert _run(on_b, show) == expected  # its env and workdir travelled too
    assert _images(ray_cluster, b)[name]["digest"] == image.digest


@requires_registry
def test_an_image_pulled_on_a_runs_on_b_from_a_s_layers(client, ray_cluster, nodes, tmp_path):
    """Pulled from a registry on one node, the image runs on another, which fetches its
    layers from the first: the registry is gone by then. Its USER and ENTRYPOINT/CMD
    travel with it (docs/users.md)."""
    rootfs = default_cache_dir() / "images" / "python" / "rootfs"
    uid = "{ while read k v r; do [ $k = Uid: ] && echo $v; done < /proc/self/status; true; }"
    config = {**CONFIG, "config": {**CONFIG["config"], "User": "root",
                                   "Cmd": ["sh", "-c", f"{uid} > /srv/data/cmd; exec cat"]}}
    layout = oci_layout(tmp_path / "layout", [base_layer(rootfs).bytes(),
                                              second_layer().bytes()], config)
    with run_registry(tmp_path / "registry") as registry:
        ref = registry.push(layout, f"travel/t{secrets.token_hex(4)}:1")
        image = corral.Image.pull(ref, insecure=True, client=client)
    a = next(n for n in nodes if image.name in _images(ray_cluster, n))
    b = next(n for n in nodes if n != a)
    before = _stats(ray_cluster, b)
    show = f"cat /srv/data/hard.txt; echo $GREETING; pwd; {uid}"
    on_a = corral.Sandbox.create(image=image.name, node=a, memory_mb=64, tags=[TAG],
                                 client=client)
    expected = _run(on_a, show)
    assert expected.endswith("/srv/data\n0\n")  # its WORKDIR and its USER
    on_b = corral.Sandbox.create(image=image.name, node=b, memory_mb=64, tags=[TAG],
                                 run_entrypoint=True, client=client)
    assert on_b.info.node == b and _run(on_b, show) == expected
    assert _run(on_b, "i=0; while [ ! -s cmd ] && [ $i -lt 1000000 ]; do i=$((i+1)); done; "
                "cat cmd") == "0\n"  # its CMD ran, as its USER
    crossed = _stats(ray_cluster, b)["layers"] - before["layers"]
    assert crossed >= 2  # its two layers (and its empty root) came from A


def test_a_snapshot_of_a_python_sandbox_on_a_restores_on_b(client, ray_cluster, nodes):
    a, b = nodes[0], nodes[1]  # A has the host's python, B one of its own
    src = corral.Sandbox.create(node=a, memory_mb=64, tags=[TAG], client=client)
    _run(src, "mkdir -p /tmp/t && head -c 1000000 /dev/urandom > /tmp/t/blob")
    snap = src.snapshot(name=f"roots-{src.id[-6:]}")
    show = "sha256sum /tmp/t/blob; cat /etc/corral-node 2>/dev/null || echo none"
    expected = _run(src, show)
    assert expected.endswith("none\n")  # A's python
    python_b = _images(ray_cluster, b)["python"]["digest"]
    copy = snap.restore(node=b, tags=[TAG])
    assert copy.info.node == b
    assert _run(copy, show) == expected  # A's python below it, not B's
    assert _images(ray_cluster, b)["python"]["digest"] == python_b
    own = corral.Sandbox.create(node=b, memory_mb=64, tags=[TAG], client=client)
    assert _run(own, "cat /etc/corral-node") == node_tag(b) + "\n"
    snap.delete()
