"""The edges of a build's ``copy`` limits (``MAX_COPY_DEPTH``, ``MAX_COPY_PATH``,
docs/images.md) against a sent context: a source exactly at the depth limit is copied,
one level more is refused typed before anything is copied; symlinks (loops, links to
``/``, to the context's root, to a deep directory) are copied as links: never followed,
never counted as the depth of what they point to, never leading out of the context."""

from __future__ import annotations

import json
import secrets

import pytest

from corral.runtime.image_build import MAX_COPY_DEPTH
from tests.conftest import requires_root
from tests.runtime.oci_archives import Layer
from tests.server.conftest import uds_client

pytestmark = [requires_root, pytest.mark.timeout(300)]


def _build(client, name: str, layer: Layer, copy: str = "app -> /app") -> dict:
    request = {"name": name, "spec": {"steps": [{"copy": copy}]}}
    body = layer.file("build.json", json.dumps(request).encode()).bytes()
    with client.stream("POST", "/v1/images/build", content=body, timeout=300,
                       headers={"Content-Type": "application/x-tar"}) as r:
        if r.status_code != 200:  # refused before the build started
            assert r.status_code == 400, r.read()
            return json.loads(r.read())
        return [json.loads(line) for line in r.iter_lines() if line.strip()][-1]


def _deep(levels: int) -> Layer:
    """``context/app`` with directories ``levels - 1`` deep and a file below the last
    (the file is the ``levels``-th level), and links that would be deeper if followed."""
    layer = Layer().dir("context/app")
    path = "context/app"
    for _ in range(levels - 1):
        path += "/d"
        layer.dir(path)
    return (layer.file(path + "/f", b"bottom\n")
            .symlink("context/app/loop", ".")  # a loop: app/loop/loop/...
            .symlink("context/app/d/up", "..")
            .symlink("context/app/root", "/")
            .symlink("context/app/short", path.removeprefix("context/app/")))


def test_a_copy_exactly_at_the_depth_limit_is_built_one_more_refused(daemon):
    token = secrets.token_hex(4)
    logged = daemon.log.stat().st_size
    with uds_client(daemon.socket) as client:
        at, past = f"t-atdepth-{token}", f"t-pastdepth-{token}"
        try:
            last = _build(client, at, _deep(MAX_COPY_DEPTH))
            assert "error" not in last, last
            assert client.get(f"/v1/images/{at}").status_code == 200
            last = _build(client, past, _deep(MAX_COPY_DEPTH + 1))
            assert last["error"]["code"] == "image_build_failed", last
            assert (f"{MAX_COPY_DEPTH + 1} levels deep, more than the {MAX_COPY_DEPTH}"
                    in last["error"]["message"])
            assert client.get(f"/v1/images/{past}").status_code == 404
        finally:
            client.delete(f"/v1/images/{at}")
            client.delete(f"/v1/images/{past}")
    with open(daemon.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: {daemon.log}"


def test_a_copy_source_that_is_a_link_out_of_the_context_is_refused(daemon):
    """The source itself is followed (like cp): out of the context, into a loop or to
    nothing, it is refused typed."""
    token = secrets.token_hex(4)
    with uds_client(daemon.socket) as client:
        for target in ("/", "../..", "app", "gone"):  # app: itself (ELOOP); gone: nothing
            name = f"t-linksrc-{token}"
            layer = Layer().dir("context").symlink("context/app", target)
            last = _build(client, name, layer)
            assert "error" in last, (target, last)
            assert last["error"]["code"] in ("invalid_argument", "image_build_failed",
                                            "image_import_failed"), last
            assert client.get(f"/v1/images/{name}").status_code == 404
            # A loop was an internal error naming the daemon's cache path (ELOOP).
            assert "Too many levels" not in json.dumps(last) and "/var/" not in json.dumps(last)
