"""Importing docker save tarballs and OCI image layouts made in code, and using them."""

from __future__ import annotations

import gzip
import json
import os
import secrets
from pathlib import Path

import pytest

from corral.errors import ImageImportError, ImageInUse
from corral.runtime.engine import SANDBOX_HOST_UID
from corral.runtime.image_build import build_image
from corral.runtime.oci import import_image
from tests.conftest import requires_root
from tests.runtime.oci_archives import (
    Layer,
    base_layer,
    docker_save,
    oci_layout,
    second_layer,
    tar_directory,
)

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(300)]


@pytest.fixture
def name(engine):
    made = f"t-oci-{secrets.token_hex(4)}"
    yield made
    for n in (f"{made}-child", made):
        if engine.images.exists(n):
            engine.images.remove(n)


@pytest.fixture
def layers(engine) -> list[bytes]:
    return [base_layer(engine.images.get("python").rootfs).bytes(), second_layer().bytes()]


def work_dirs(engine) -> list[str]:
    return [n for n in os.listdir(engine.images.images_dir)
            if n.startswith(".tmp-") and f"-{os.getpid()}-" in n]


async def sh(engine, sid: str, cmd: str) -> str:
    r = await engine.exec(sid, cmd)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


def archive(kind: str, layers: list[bytes], tmp: Path) -> Path:
    if kind == "docker-save":
        path = tmp / "image.tar"
        path.write_bytes(docker_save(layers))
        return path
    layout = oci_layout(tmp / "layout", layers, gzip_layers=kind != "oci-dir-plain")
    return tar_directory(layout, tmp / "layout.tar") if kind == "oci-tar" else layout


@pytest.mark.parametrize("kind", ["docker-save", "oci-dir", "oci-dir-plain", "oci-tar"])
async def test_import_applies_layers_whiteouts_and_opaque_dirs(engine, name, layers, tmp_path,
                                                               kind):
    image = import_image(engine.images, archive(kind, layers, tmp_path), name)
    assert image.kind == "oci" and engine.images.get(name) == image
    assert image.env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "GREETING": "hello from oci"}
    assert image.workdir == "/srv/data"
    root = image.rootfs
    assert not (root / "etc/gone.txt").exists() and not (root / "etc/.wh.gone.txt").exists()
    assert sorted(os.listdir(root / "opt/old")) == ["new.txt"]  # opaque: a.txt, b.txt gone
    assert (root / "opt/keep/k.txt").read_text() == "kept\n"
    assert os.stat(root / "srv/data/hard.txt").st_ino == os.stat(root / "opt/keep/k.txt").st_ino
    assert os.stat(root / "srv/data/owned.txt").st_uid == SANDBOX_HOST_UID
    assert os.readlink(root / "usr/lib64/ld-linux-x86-64.so.2").startswith("/lib/")
    assert not work_dirs(engine)

    sb = await engine.create(image=name)
    assert sb.spec.workdir == "/srv/data" and sb.spec.env["GREETING"] == "hello from oci"
    assert await sh(engine, sb.id, "pwd; echo $GREETING") == "/srv/data\nhello from oci\n"
    assert await sh(engine, sb.id, "cat /etc/os-release") == "ID=corral-test\nVERSION=2\n"
    assert await sh(engine, sb.id, "echo /opt/old/*; test -e /etc/gone.txt || echo gone") == (
        "/opt/old/new.txt\ngone\n")
    assert await sh(engine, sb.id, "echo mine >> owned.txt && cat owned.txt") == (
        "the sandbox user's\nmine\n")
    await engine.delete(sb.id)


async def test_import_replaces_an_image_of_that_name(engine, name, layers, tmp_path):
    first = import_image(engine.images, archive("docker-save", layers[:1], tmp_path), name)
    assert (first.rootfs / "etc/gone.txt").exists()
    second = import_image(engine.images, archive("oci-dir", layers, tmp_path), name)
    assert second.digest != first.digest and not (second.rootfs / "etc/gone.txt").exists()
    with pytest.raises(ImageImportError, match="already exists"):
        import_image(engine.images, tmp_path / "layout", name, replace=False)


def evil(*entries: tuple[str, str, str]) -> bytes:
    layer = Layer()
    for kind, path, target in entries:
        if kind == "file":
            layer.file(path, target.encode())
        elif kind == "sym":
            layer.symlink(path, target)
        else:
            layer.hardlink(path, target)
    return layer.bytes()


@pytest.mark.parametrize("entries, message", [
    ([("file", "../escape.txt", "x")], "climbs out"),
    ([("file", "a/../../escape.txt", "x")], "climbs out"),
    ([("file", "/etc/escape.txt", "x")], "absolute path"),
    ([("sym", "up", "../../../../etc")], "outside the root"),
    ([("sym", "d/up", "../../etc/passwd")], "outside the root"),
    ([("hard", "h", "../../etc/passwd")], "climbs out"),
    ([("hard", "h", "/etc/passwd")], "absolute path"),
    ([("hard", "h", "no/such/file")], "not a file of the image"),
])
def test_unsafe_layers_are_refused_and_leave_nothing(engine, name, tmp_path, entries, message):
    path = tmp_path / "evil.tar"
    path.write_bytes(docker_save([evil(*entries)]))
    with pytest.raises(ImageImportError, match=message):
        import_image(engine.images, path, name)
    assert not engine.images.exists(name) and not work_dirs(engine)
    assert not (tmp_path.parent / "escape.txt").exists()


def test_links_are_followed_inside_the_root_never_out_of_it(engine, name, tmp_path):
    canary = Path("/etc") / f"corral-canary-{secrets.token_hex(4)}"
    # layer 1: an absolute link to "/" (the sandbox's root, not the host's) and one to
    # /etc; layer 2 writes through both: the files must land inside the image
    first = evil(("sym", "rootlink", "/"), ("sym", "etclink", "/etc"))
    second = evil(("file", f"rootlink/etc/{canary.name}", "a"),
                  ("file", f"etclink/{canary.name}-2", "b"))
    path = tmp_path / "links.tar"
    path.write_bytes(docker_save([first, second]))
    image = import_image(engine.images, path, name)
    assert not canary.exists() and not Path(f"{canary}-2").exists()
    assert (image.rootfs / "etc" / canary.name).read_text() == "a"
    assert (image.rootfs / "etc" / f"{canary.name}-2").read_text() == "b"


def test_damaged_or_foreign_archives_are_refused(engine, name, layers, tmp_path):
    layout = oci_layout(tmp_path / "layout", layers)
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:])
                          .read_text())
    blob = layout / "blobs/sha256" / manifest["layers"][1]["digest"][7:]
    blob.write_bytes(gzip.compress(b"not the layer"))
    with pytest.raises(ImageImportError, match="does not match its digest"):
        import_image(engine.images, layout, name)
    (tmp_path / "junk").write_bytes(b"\0" * 2048)
    with pytest.raises(ImageImportError, match="not an image archive"):
        import_image(engine.images, tmp_path / "junk", name)
    (tmp_path / "text").write_text("hello")
    with pytest.raises(ImageImportError, match="neither a tar"):
        import_image(engine.images, tmp_path / "text", name)
    assert not engine.images.exists(name) and not work_dirs(engine)


async def test_an_image_in_use_or_built_on_is_not_removed(engine, name, layers, tmp_path):
    import_image(engine.images, archive("docker-save", layers, tmp_path), name)
    sb = await engine.create(image=name)
    with pytest.raises(ImageInUse, match="running sandboxes"):
        engine.images.remove(name)
    assert await sh(engine, sb.id, "cat /etc/os-release") == "ID=corral-test\nVERSION=2\n"
    await engine.delete(sb.id)

    child = f"{name}-child"
    await build_image(engine, {"base": name, "steps": [
        {"run": f"echo {secrets.token_hex(4)} > c"}]}, name=child)
    with pytest.raises(ImageInUse, match=child):
        engine.images.remove(name)
    with pytest.raises(ImageInUse, match=child):  # replacing it would strand the child
        import_image(engine.images, archive("oci-dir", layers, tmp_path), name)
    sb = await engine.create(image=child)
    assert await sh(engine, sb.id, "cat /etc/os-release") == "ID=corral-test\nVERSION=2\n"
    await engine.delete(sb.id)
    engine.images.remove(child)
    engine.images.remove(name)
    assert not engine.images.exists(name)
