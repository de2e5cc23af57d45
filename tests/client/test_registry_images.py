"""Registry images through a real daemon (its own image cache, so that prune touches
nothing shared): ``corral.Image.pull``, ``corral image pull|ls|prune``, and a reference
as ``Sandbox.create(image=...)`` pulled once by two concurrent first uses; the
registry's credentials never reach the daemon's log, its database or a sandbox."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import corral
from corral.runtime.image_pull import local_name
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root, stored_bytes
from tests.runtime.oci_archives import Layer, base_layer, oci_layout, second_layer
from tests.runtime.registries import Proxy, requires_registry, run_registry, write_auth_file

pytestmark = [requires_root, requires_registry, pytest.mark.root, pytest.mark.timeout(300)]



@pytest.fixture
def setup(tmp_path, make_daemon, monkeypatch):
    """(daemon, client, registry behind a counting proxy, creds, layers)."""
    rootfs = default_cache_dir() / "images/python/rootfs"  # the shared cache, read only
    layers = [base_layer(rootfs).bytes(), second_layer().bytes()]
    creds = ("corral", "s3cret-" + secrets.token_hex(8))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o711)
    tmp_path.chmod(0o711)
    with run_registry(tmp_path / "registry", creds=creds) as registry:
        proxy = Proxy(registry.host).start()
        auth = write_auth_file(tmp_path / "auth.json", proxy.host, creds)
        monkeypatch.setenv("CORRAL_CACHE_DIR", str(cache))
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
        daemon = make_daemon()
        try:
            with corral.Client(daemon.url) as client:
                yield daemon, client, registry, proxy, creds, layers, tmp_path
        finally:
            proxy.stop()


def push(registry, proxy, layout: Path, repo: str) -> str:
    return registry.push(layout, repo).replace(registry.host, proxy.host)


def cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corral.cli.main", "--url", daemon.url, *args],
                          capture_output=True, text=True, timeout=120)


def test_pull_create_ls_prune_through_the_daemon(setup):
    daemon, client, registry, proxy, creds, layers, tmp = setup
    ref = push(registry, proxy, oci_layout(tmp / "a", layers), "team/task:v1")
    progress: list[corral.PullEvent] = []
    image = corral.Image.pull(ref, on_progress=progress.append, client=client)
    assert image.name == local_name(ref) and image.info.ref == ref
    assert any(e.type == "layer" and e.bytes == e.size for e in progress)

    # the reference itself as a sandbox's image: already pulled, nothing fetched
    before = len(proxy.requests)
    with corral.Sandbox.create(image=ref, memory_mb=64, client=client) as sb:
        assert sb.exec("cat /etc/os-release").stdout == "ID=corral-test\nVERSION=2\n"
        assert sb.exec("echo $GREETING").stdout == "hello from oci\n"
        environ = sb.exec("cat /proc/1/environ /proc/self/environ").stdout
        assert creds[1] not in environ and "REGISTRY_AUTH_FILE" not in environ
    assert len(proxy.requests) == before

    # the CLI: a second image sharing the base; ls shows shared vs unique
    extra = Layer().file("srv/data/task.txt", b"task two\n").bytes()
    ref2 = push(registry, proxy, oci_layout(tmp / "b", [layers[0], extra]), "team/task:v2")
    done = cli(daemon, "image", "pull", ref2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == local_name(ref2)
    assert "layer 1/2" in done.stderr and "(stored)" in done.stderr  # the shared base
    listed = {i["name"]: i for i in json.loads(cli(daemon, "image", "ls", "--json").stdout)}
    one, two = listed[local_name(ref)], listed[local_name(ref2)]
    assert 0 < one["unique_bytes"] < one["size_bytes"]
    assert 0 < two["unique_bytes"] < two["size_bytes"]
    table = cli(daemon, "image", "ls").stdout
    assert "SHARED MB" in table and "UNIQUE MB" in table

    # prune: nothing while both stand; the unique layer once its image is gone
    assert corral.Image.prune(client=client).layers == []
    cli(daemon, "image", "rm", local_name(ref2))
    corral.Image.prune(client=client)
    assert corral.Image.get(image.name, client=client).layers == image.layers

    # credentials: never in the daemon's log or database
    log = daemon.log.read_bytes()
    assert creds[1].encode() not in log
    for path, data in stored_bytes(daemon.state_dir):
        assert creds[1].encode() not in data, path


def test_two_concurrent_first_uses_pull_once(setup):
    daemon, client, registry, proxy, creds, layers, tmp = setup
    ref = push(registry, proxy, oci_layout(tmp / "a", layers), "team/first:v1")
    made, errors = [], []
    barrier = threading.Barrier(2)

    def first_use() -> None:
        try:
            barrier.wait()
            with corral.Sandbox.create(image=ref, memory_mb=64, client=client) as sb:
                made.append(sb.exec("cat /opt/keep/k.txt").stdout)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and made == ["kept\n", "kept\n"]
    blobs = [r for r in proxy.requests if "/blobs/" in r]  # config + 2 layers, once
    assert len(blobs) == len(set(blobs)) == 3, proxy.requests


def test_registry_errors_are_typed(setup):
    daemon, client, registry, proxy, creds, layers, tmp = setup
    ref = push(registry, proxy, oci_layout(tmp / "a", layers), "team/err:v1")
    with pytest.raises(corral.ImageNotFound):
        corral.Image.pull(ref.replace(":v1", ":missing"), client=client)
    other = ref.replace(proxy.host, registry.host)  # no credentials for this host name
    with pytest.raises(corral.RegistryAuthError, match=registry.host):
        corral.Image.pull(other, client=client)
    with pytest.raises(corral.RegistryAuthError):
        corral.Sandbox.create(image=other, client=client)
    with pytest.raises(corral.InvalidArgument, match="invalid image reference"):
        corral.Image.pull("nohost/../x", client=client)
    done = cli(daemon, "image", "pull", other)
    assert done.returncode != 0 and registry.host in done.stderr
    assert creds[1] not in done.stderr


def test_a_pool_of_a_registry_image(setup):
    daemon, client, registry, proxy, creds, layers, tmp = setup
    ref = push(registry, proxy, oci_layout(tmp / "a", layers), "team/pool:v1")
    with corral.Pool(image=ref, memory_mb=64, min_ready=1, client=client) as pool:
        with pool.acquire(timeout=60) as sb:
            assert sb.exec("cat /opt/keep/k.txt").stdout == "kept\n"
            assert sb.info.spec.image == local_name(ref)
