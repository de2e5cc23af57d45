"""A registry reference as the image of the compatibility front-ends' clients: the
unmodified cwsandbox client's ``container_image`` and Tensorlake's ``image`` pull it on
first use (a local registry: Debian's docker-registry on 127.0.0.1)."""

from __future__ import annotations

import pytest

from corral.runtime.image_pull import local_name
from tests.conftest import requires_root
from tests.runtime.oci_archives import base_layer, oci_layout, second_layer
from tests.runtime.registries import requires_registry, run_registry
from tests.server.conftest import uds_client

cwsandbox = pytest.importorskip("cwsandbox")
from cwsandbox import Sandbox  # noqa: E402

from tests.server.test_compat_cwsandbox import SMALL, serving  # noqa: E402

pytestmark = [requires_root, requires_registry, pytest.mark.root, pytest.mark.timeout(300)]


def test_cwsandbox_container_image_from_a_registry(tmp_path):
    from corral.runtime.paths import default_cache_dir

    rootfs = default_cache_dir() / "images/python/rootfs"
    layers = [base_layer(rootfs).bytes(), second_layer().bytes()]
    with run_registry(tmp_path / "registry") as registry, serving() as (daemon, _):
        ref = registry.push(oci_layout(tmp_path / "layout", layers), "cw/task:1")
        sandbox = Sandbox.run(resources=SMALL, container_image=ref)
        try:
            out = sandbox.exec(["cat", "/etc/os-release"]).result().stdout
            assert out == "ID=corral-test\nVERSION=2\n"
            with uds_client(daemon.socket) as native:
                spec = native.get(f"/v1/sandboxes/{sandbox.sandbox_id}").json()["spec"]
            assert spec["image"] == local_name(ref)
        finally:
            Sandbox.delete(sandbox.sandbox_id, missing_ok=True).result()
            with uds_client(daemon.socket) as native:
                native.delete(f"/v1/images/{local_name(ref)}")


def test_tensorlake_image_from_a_registry(tmp_path):
    from corral.runtime.paths import default_cache_dir
    from tests.server.test_compat_tensorlake import run_script
    from tests.server.test_compat_tensorlake import serving as tl_serving

    rootfs = default_cache_dir() / "images/python/rootfs"
    layers = [base_layer(rootfs).bytes(), second_layer().bytes()]
    with run_registry(tmp_path / "registry") as registry, tl_serving() as daemon:
        ref = registry.push(oci_layout(tmp_path / "layout", layers), "tl/task:1")
        try:
            out = run_script(daemon, f"""
            sb = Sandbox.create(image={ref!r}, memory_mb=64, timeout_secs=600)
            r = sb.run("cat", ["/etc/os-release"])
            out["os"] = r.stdout
            sb.terminate()
            """)
            assert out["os"].strip() == "ID=corral-test\nVERSION=2"
        finally:
            with uds_client(daemon.socket) as native:
                native.delete(f"/v1/images/{local_name(ref)}")
