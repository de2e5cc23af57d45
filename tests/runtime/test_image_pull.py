"""Pulling images from a real registry (Debian's docker-registry on 127.0.0.1, images
pushed by skopeo): tags and digests, a multi-platform index, layers shared between
images, basic auth, damaged blobs, a dropped connection, concurrent first uses."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import threading

import pytest

from corral.errors import ImageImportError, ImageNotFound, RegistryAuthError
from corral.runtime import image_cache
from corral.runtime.image_pull import BLOBS, local_name, pull_image
from tests.conftest import requires_root
from tests.runtime.oci_archives import Layer, base_layer, oci_layout, second_layer
from tests.runtime.registries import (
    Proxy,
    TokenService,
    requires_registry,
    run_registry,
    write_auth_file,
)

pytestmark = [requires_root, requires_registry, pytest.mark.root, pytest.mark.timeout(300)]


@pytest.fixture
def registry(tmp_path):
    with run_registry(tmp_path / "registry") as reg:
        yield reg


@pytest.fixture
def layers(engine) -> list[bytes]:
    return [base_layer(engine.images.get("python").rootfs).bytes(), second_layer().bytes()]


@pytest.fixture
def cleanup(engine):
    names: list[str] = []
    yield names
    for n in names:
        if engine.images.exists(n):
            engine.images.remove(n)


def repo() -> str:
    return f"corral-test/t{secrets.token_hex(4)}"


async def sh(engine, sid: str, cmd: str) -> str:
    r = await engine.exec(sid, cmd)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


async def test_pull_by_tag_and_digest_runs_sandboxes(engine, registry, layers, tmp_path, cleanup):
    digest_file = tmp_path / "digest"
    ref = registry.push(oci_layout(tmp_path / "layout", layers), f"{repo()}:v1",
                        digest_file=digest_file)
    events: list[dict] = []
    image = await asyncio.to_thread(pull_image, engine.images, ref, on_progress=events.append)
    cleanup.append(image.name)
    assert image.name == local_name(ref) and image.kind == "built"
    assert image.env["GREETING"] == "hello from oci" and image.workdir == "/srv/data"
    assert len(image.layer_ids) == 2
    assert {e["layer"] for e in events if e["type"] == "layer"} == {1, 2}
    sb = await engine.create(image=image.name)
    try:
        assert await sh(engine, sb.id, "cat /etc/os-release") == "ID=corral-test\nVERSION=2\n"
        assert await sh(engine, sb.id, "echo /opt/old/*") == "/opt/old/new.txt\n"  # opaque
        assert await sh(engine, sb.id, "test ! -e /etc/gone.txt && echo gone") == "gone\n"
        assert await sh(engine, sb.id, "cat /srv/data/hard.txt") == "kept\n"
        assert await sh(engine, sb.id, "echo $GREETING; pwd") == "hello from oci\n/srv/data\n"
    finally:
        await engine.delete(sb.id)
    # by digest: the same layers, nothing downloaded again
    pinned = f"{registry.host}/{ref.split('/', 1)[1].split(':')[0]}@{digest_file.read_text()}"
    events.clear()
    again = await asyncio.to_thread(pull_image, engine.images, pinned, on_progress=events.append)
    cleanup.append(again.name)
    assert again.layer_ids == image.layer_ids and again.name != image.name
    assert all(e["cached"] for e in events if e["type"] == "layer")
    assert not os.listdir(engine.images.images_dir / BLOBS)  # blobs go once unpacked
    # a second pull of the tag asks for the manifest and finds nothing new
    assert (await asyncio.to_thread(pull_image, engine.images, ref)).digest == image.digest


async def test_images_sharing_a_base_store_it_once(engine, registry, layers, tmp_path, cleanup):
    one = registry.push(oci_layout(tmp_path / "a", layers), f"{repo()}:a")
    extra = Layer().file("srv/data/task.txt", b"task two\n").bytes()
    two = registry.push(oci_layout(tmp_path / "b", [layers[0], extra]), f"{repo()}:b")
    a = await asyncio.to_thread(pull_image, engine.images, one)
    b = await asyncio.to_thread(pull_image, engine.images, two)
    cleanup += [a.name, b.name]
    assert a.layer_ids[-1] == b.layer_ids[-1]  # the base, bottom: one layer on disk
    assert a.layer_ids[0] != b.layer_ids[0]


async def test_multi_platform_index_picks_the_host_platform(engine, registry, layers, tmp_path,
                                                           cleanup):
    amd = oci_layout(tmp_path / "amd", layers)
    arm_layer = Layer().file("etc/os-release", b"ID=wrong-platform\n").bytes()
    arm = oci_layout(tmp_path / "arm", [arm_layer], config={
        "architecture": "arm64", "os": "linux", "config": {}})
    index = json.loads((amd / "index.json").read_text())
    arm_index = json.loads((arm / "index.json").read_text())
    for d in arm_index["manifests"]:
        d["platform"] = {"architecture": "arm64", "os": "linux"}
    for blob in (arm / "blobs/sha256").iterdir():
        (amd / "blobs/sha256" / blob.name).write_bytes(blob.read_bytes())
    inner = json.dumps({"schemaVersion": 2,
                        "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": arm_index["manifests"] + index["manifests"]}).encode()
    inner_digest = hashlib.sha256(inner).hexdigest()  # arm64 first: the host's is picked
    (amd / "blobs/sha256" / inner_digest).write_bytes(inner)
    index["manifests"] = [{"mediaType": "application/vnd.oci.image.index.v1+json",
                           "digest": f"sha256:{inner_digest}", "size": len(inner)}]
    (amd / "index.json").write_text(json.dumps(index))
    ref = registry.push(amd, f"{repo()}:multi", all_platforms=True)
    image = await asyncio.to_thread(pull_image, engine.images, ref)
    cleanup.append(image.name)
    sb = await engine.create(image=image.name)
    try:
        assert "corral-test" in await sh(engine, sb.id, "cat /etc/os-release")
    finally:
        await engine.delete(sb.id)


async def test_zstd_layers_are_pulled_and_bounded(engine, registry, layers, tmp_path, cleanup):
    ref = registry.push(oci_layout(tmp_path / "layout", layers, zstd_layers=True), f"{repo()}:z")
    image = await asyncio.to_thread(pull_image, engine.images, ref)
    cleanup.append(image.name)
    sb = await engine.create(image=image.name)
    try:
        assert await sh(engine, sb.id, "cat /srv/data/hard.txt") == "kept\n"
    finally:
        await engine.delete(sb.id)
    # 64 MiB of zeros is a few KiB of zstd: the pull's byte budget stops it, typed
    bomb = Layer().file("srv/zeros", bytes(64 << 20)).bytes()
    ref = registry.push(oci_layout(tmp_path / "bomb", [bomb], zstd_layers=True), f"{repo()}:b")
    with pytest.raises(ImageImportError, match="expands past"):
        await asyncio.to_thread(pull_image, engine.images, ref, max_bytes=8 << 20)
    assert not engine.images.exists(local_name(ref))


async def test_corrupted_blob_is_refused_and_leaves_nothing(engine, registry, layers, tmp_path):
    # a layer of its own: one of the same bytes pulled before is in the shared cache by
    # its digest, and a cached layer is not downloaded (nor its damage seen)
    mine = second_layer().file("etc/unique", os.urandom(16).hex().encode()).bytes()
    layout = oci_layout(tmp_path / "layout", [layers[0], mine])
    ref = registry.push(layout, f"{repo()}:bad")
    manifest_digest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    manifest = json.loads((layout / "blobs/sha256" / manifest_digest[7:]).read_bytes())
    top = registry.blob_path(manifest["layers"][1]["digest"])
    data = bytearray(top.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    top.write_bytes(bytes(data))
    before = set(os.listdir(image_cache.layer_store(engine.images.images_dir).root))
    with pytest.raises(ImageImportError, match="does not match its digest"):
        await asyncio.to_thread(pull_image, engine.images, ref)
    assert not engine.images.exists(local_name(ref))
    after = set(os.listdir(image_cache.layer_store(engine.images.images_dir).root))
    assert not {n for n in after - before if n.startswith(".tmp-")}
    assert not [n for n in os.listdir(engine.images.images_dir / BLOBS)
                if n.startswith(manifest["layers"][1]["digest"][7:])]


async def test_missing_tag_is_image_not_found(engine, registry, layers, tmp_path):
    ref = registry.push(oci_layout(tmp_path / "layout", layers), f"{repo()}:v1")
    with pytest.raises(ImageNotFound, match="no manifest"):
        await asyncio.to_thread(pull_image, engine.images, ref.replace(":v1", ":nope"))


async def test_basic_auth_from_the_auth_file(engine, tmp_path, layers, cleanup, monkeypatch):
    creds = ("corral", secrets.token_hex(8))
    with run_registry(tmp_path / "reg", creds=creds) as registry:
        ref = registry.push(oci_layout(tmp_path / "layout", layers), f"{repo()}:v1")
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "none.json"))
        with pytest.raises(RegistryAuthError, match=registry.host) as info:
            await asyncio.to_thread(pull_image, engine.images, ref)
        assert "none are configured" in str(info.value)
        wrong = write_auth_file(tmp_path / "wrong.json", registry.host, (creds[0], "nope"))
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(wrong))
        with pytest.raises(RegistryAuthError, match=registry.host) as info:
            await asyncio.to_thread(pull_image, engine.images, ref)
        assert "nope" not in str(info.value) and "nope" not in json.dumps(info.value.details)
        right = write_auth_file(tmp_path / "right.json", registry.host, creds)
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(right))
        image = await asyncio.to_thread(pull_image, engine.images, ref)
        cleanup.append(image.name)
        manifest = (engine.images.images_dir / image.name / "manifest.json").read_text()
        assert creds[1] not in manifest


async def test_dropped_connection_mid_layer_is_resumed(engine, registry, tmp_path, cleanup):
    big = Layer().file("srv/big.bin", secrets.token_bytes(3 << 20)).bytes()
    layout = oci_layout(tmp_path / "layout", [big], gzip_layers=False)
    pushed = registry.push(layout, f"{repo()}:big")
    proxy = Proxy(registry.host, cut_after=1 << 20).start()
    try:
        ref = pushed.replace(registry.host, proxy.host)
        image = await asyncio.to_thread(pull_image, engine.images, ref)
        cleanup.append(image.name)
    finally:
        proxy.stop()
    assert any("Range: bytes=" in r and "/blobs/" in r for r in proxy.requests), proxy.requests
    tree = image_cache.layer_store(engine.images.images_dir).path(image.layer_ids[0])
    assert (tree / "srv/big.bin").stat().st_size == 3 << 20


async def test_two_concurrent_first_uses_pull_once(engine, registry, layers, tmp_path, cleanup):
    pushed = registry.push(oci_layout(tmp_path / "layout", layers), f"{repo()}:v1")
    proxy = Proxy(registry.host).start()
    try:
        ref = pushed.replace(registry.host, proxy.host)
        results: list = []
        barrier = threading.Barrier(2)

        def first_use() -> None:
            barrier.wait()
            results.append(pull_image(engine.images, ref, if_missing=True))

        threads = [threading.Thread(target=first_use) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        proxy.stop()
    cleanup.append(results[0].name)
    assert len(results) == 2 and results[0].digest == results[1].digest
    manifests = [r for r in proxy.requests if "/manifests/" in r]
    assert len(manifests) == 1, proxy.requests


async def test_token_auth_from_the_auth_file(engine, tmp_path, layers, cleanup, monkeypatch):
    creds = ("corral", secrets.token_hex(8))
    token = TokenService(creds, tmp_path / "token.pem").start()
    try:
        with run_registry(tmp_path / "reg", token=token) as registry:
            ref = registry.push(oci_layout(tmp_path / "layout", layers), f"{repo()}:v1")
            wrong = write_auth_file(tmp_path / "wrong.json", registry.host, (creds[0], "nope"))
            monkeypatch.setenv("REGISTRY_AUTH_FILE", str(wrong))
            with pytest.raises(RegistryAuthError, match=registry.host):
                await asyncio.to_thread(pull_image, engine.images, ref)
            right = write_auth_file(tmp_path / "right.json", registry.host, creds)
            monkeypatch.setenv("REGISTRY_AUTH_FILE", str(right))
            image = await asyncio.to_thread(pull_image, engine.images, ref)
            cleanup.append(image.name)
            assert f"repository:{ref.split('/', 1)[1].split(':')[0]}:pull" in token.issued
            assert creds[1] not in registry.log.read_text()
    finally:
        token.stop()


async def test_a_pull_cut_off_is_resumed_by_the_next(engine, registry, tmp_path, cleanup,
                                                      monkeypatch):
    from corral.errors import RegistryError
    from corral.runtime import image_pull

    big = Layer().file("srv/big.bin", secrets.token_bytes(3 << 20)).bytes()
    pushed = registry.push(oci_layout(tmp_path / "layout", [big], gzip_layers=False),
                           f"{repo()}:cut")
    proxy = Proxy(registry.host, cut_after=1 << 20).start()
    try:
        ref = pushed.replace(registry.host, proxy.host)
        monkeypatch.setattr(image_pull, "RESUME_TRIES", 1)  # this pull gives up at the cut
        with pytest.raises(RegistryError, match="pull again to resume"):
            await asyncio.to_thread(pull_image, engine.images, ref)
        partial = [p for p in os.listdir(engine.images.images_dir / BLOBS)
                   if p.endswith(".partial")]
        assert partial, "the bytes fetched before the cut are kept"
        monkeypatch.setattr(image_pull, "RESUME_TRIES", 8)
        image = await asyncio.to_thread(pull_image, engine.images, ref)
        cleanup.append(image.name)
    finally:
        proxy.stop()
    ranged = [r for r in proxy.requests if "/blobs/" in r and "Range: bytes=" in r]
    assert ranged and int(ranged[0].split("bytes=")[1].rstrip("-")) > 0
    assert not os.listdir(engine.images.images_dir / BLOBS)
