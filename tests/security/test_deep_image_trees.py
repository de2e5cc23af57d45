"""Red-team of image trees from outside (a hostile registry's or archive's layers, a
tenant's build context): deep trees, paths near PATH_MAX, many hard links.

Before: ``os.walk`` recursed past Python's limit on a tree 1500 directories deep in
each walk of an image (o+r for the sandbox user on import and pull, the listing's
digest, a build step's set-id bits, a ``copy`` source): a RecursionError, so a 500; and
unpacking such a layer looked each entry's directories up from the root (a minute of
the daemon for a 4 MB archive). Now every walk is iterative and descriptor-relative
(:mod:`corral.runtime.treecopy`), unpacking starts from the directory it made last,
and what cannot be held (a path past PATH_MAX) is refused typed, leaving nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import stat

import pytest

from corral.runtime import rootbuild
from corral.runtime.fsutil import _scan_tree
from corral.runtime.image_build import MAX_COPY_DEPTH, MAX_COPY_PATH, _scan_source
from corral.runtime.images import ImageStore
from corral.runtime.oci_layers import _sandbox_ready, apply_layer
from corral.runtime.paths import Layout
from corral.runtime.treecopy import remove_tree
from tests.conftest import requires_root
from tests.runtime.oci_archives import (
    DEPTH,
    LINKS,
    Layer,
    base_layer,
    deep_layer,
    docker_save,
)
from tests.server.conftest import assert_error, uds_client

pytestmark = [requires_root, pytest.mark.timeout(300)]

@pytest.fixture(scope="module")
def deep_bytes() -> bytes:
    return deep_layer().bytes()


def test_each_walk_of_an_image_takes_a_tree_1500_deep(tmp_path, deep_bytes):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "layer.tar").write_bytes(deep_bytes)
    apply_layer(root, tmp_path / "layer.tar")
    bottom = os.open(root / "/".join(["d"] * 1000), os.O_RDONLY | os.O_DIRECTORY)
    try:
        deepest = "/".join(["d"] * (DEPTH - 1000))
        _sandbox_ready(root)  # o+r for the sandbox user: was a RecursionError
        assert os.stat(deepest, dir_fd=bottom).st_mode & 0o005 == 0o005
        assert os.stat(f"{deepest}/f", dir_fd=bottom).st_mode & 0o004
        assert (root / "x/h0").stat().st_mode & 0o004

        size, listing = _scan_tree(root)  # the image's digest: was a RecursionError
        assert size < 4096 * (DEPTH + 100)  # the linked file counted once
        assert _scan_tree(root) == (size, listing)

        (root / "x/h0").chmod(0o4755)  # a build step left a set-user-id file
        assert rootbuild.strip_privileges(root) == 1  # was a RecursionError
        assert not os.stat(f"{deepest}/f", dir_fd=bottom).st_mode & stat.S_ISUID

        entries, _ = _scan_source(root)  # a copy source: was a RecursionError
        assert sum(kind == "d" for _, kind, _, _ in entries) == DEPTH + 3  # ., d..., x, etc
        assert sum(kind == "f" for _, kind, _, _ in entries) == LINKS + 3
    finally:
        os.close(bottom)
        remove_tree(root)  # pytest's own cleanup of tmp_path recurses


def _leftovers(images_dir, token: str) -> list[str]:
    return [n for n in os.listdir(images_dir) if token in n]


def test_importing_a_deep_image_through_the_daemon(daemon, deep_bytes):
    """201 for a tree 1500 deep with 1000 hard links (was a 500); 400 for a path past
    PATH_MAX; no traceback, and nothing of either left once deleted or refused."""
    store = ImageStore(Layout.create().images_dir)
    rootfs = store.get("python").rootfs
    token = secrets.token_hex(4)
    name = f"t-deep-{token}"
    logged = daemon.log.stat().st_size
    with uds_client(daemon.socket) as client:
        archive = docker_save([base_layer(rootfs).bytes(), deep_bytes])
        reply = client.post("/v1/images/import", params={"name": name}, content=archive)
        assert reply.status_code == 201, reply.text
        assert client.delete(f"/v1/images/{name}").status_code == 204

        too_long = Layer().dir("/".join(["d"] * 2100)).bytes()  # 4199 bytes: past PATH_MAX
        bad = f"t-long-{token}"
        archive = docker_save([base_layer(rootfs).bytes(), too_long])
        reply = client.post("/v1/images/import", params={"name": bad}, content=archive)
        assert "too long" in assert_error(reply, 400, "image_import_failed")["message"]
        assert client.get(f"/v1/images/{bad}").status_code == 404
    assert _leftovers(store.images_dir, f"long-{token}") == []
    with open(daemon.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: {daemon.log}"


def _build(client, body: bytes) -> list[dict]:
    with client.stream("POST", "/v1/images/build", content=body, timeout=300,
                       headers={"Content-Type": "application/x-tar"}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


def _context(name: str, dest: str, layer: Layer) -> bytes:
    request = {"name": name, "spec": {"steps": [{"copy": f"app -> {dest}"}]}}
    return layer.file("build.json", json.dumps(request).encode()).bytes()


def test_a_build_copying_a_deep_context_fails_typed(daemon):
    """A copy of 1100 nested directories was a 500 (and, walked, took minutes: each
    entry is one request the sandbox resolves name by name); one whose paths would pass
    PATH_MAX in the sandbox failed on its first long path. Both now fail typed, before
    anything is copied, saying what to do; the daemon logs no traceback."""
    token = secrets.token_hex(4)
    name = f"t-deepcopy-{token}"
    logged = daemon.log.stat().st_size
    with uds_client(daemon.socket) as client:
        try:
            layer = Layer().dir("context/app")
            for i in range(1, 1101):
                layer.dir("context/app/" + "/".join(["d"] * i))
            lines = _build(client, _context(name, "/app", layer))
            error = lines[-1]["error"]
            assert error["code"] == "image_build_failed", lines[-3:]
            assert f"1100 levels deep, more than the {MAX_COPY_DEPTH}" in error["message"]

            long_dir = "context/app/" + "/".join(["d" * 200] * 18)  # 3618 bytes
            layer = Layer().dir("context/app").file(f"{long_dir}/f", b"far\n")
            lines = _build(client, _context(name, "/" + "w" * 600, layer))
            error = lines[-1]["error"]
            assert error["code"] == "image_build_failed", lines[-3:]
            assert f"({MAX_COPY_PATH}): shorten" in error["message"]
            assert client.get(f"/v1/images/{name}").status_code == 404
        finally:
            client.delete(f"/v1/images/{name}")
    with open(daemon.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: {daemon.log}"


def test_a_directory_replaced_in_a_layer_is_not_looked_up_as_it_was(tmp_path):
    """Unpacking starts from directories it resolved before: one a later entry replaces
    (by a link elsewhere, by a file) is looked up again, never used as it was."""
    root = tmp_path / "root"
    root.mkdir()
    layer = (Layer().dir("c").dir("a").dir("a/b").file("a/b/f", b"1")
             .symlink("a", "c").file("a/b/g", b"2")  # a is now c: a/b is c/b
             .dir("k").dir("k/m").file("k", b"file").file("k/m/h", b"3"))  # k: dir again
    (tmp_path / "layer.tar").write_bytes(layer.bytes())
    apply_layer(root, tmp_path / "layer.tar")
    assert os.readlink(root / "a") == "c"
    assert (root / "c/b/g").read_bytes() == b"2"
    assert (root / "k/m/h").read_bytes() == b"3" and not (root / "k/m/f").exists()
