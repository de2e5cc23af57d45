"""corral image build/ls/rm/import, on a real daemon."""

from __future__ import annotations

import secrets

import pytest

import corral
from corral.runtime.images import ImageStore
from corral.runtime.paths import Layout
from tests.conftest import requires_root
from tests.runtime.oci_archives import base_layer, docker_save, second_layer

pytestmark = [requires_root, pytest.mark.timeout(300)]


@pytest.fixture
def image_name(client):
    made = f"t-cli-{secrets.token_hex(4)}"
    yield made
    corral.Image.get("python", client=client)  # the daemon still answers
    for n in (made, f"{made}-imp"):
        try:
            corral.Image.get(n, client=client).delete()
        except corral.ImageNotFound:
            pass


def test_image_build_ls_rm(cli, client, image_name, tmp_path):
    token = secrets.token_hex(6)
    (tmp_path / "src").mkdir()
    (tmp_path / "src/hello.py").write_text(f"print('hello {token}')\n")
    spec = tmp_path / "env.yaml"
    spec.write_text(f"name: ignored\nsteps:\n  - copy: src -> /app\n"
                    f"  - run: echo built-{token}\n  - workdir: /app\n")
    r = cli("image", "build", str(spec), "--name", image_name)
    assert r.code == 0, r.err
    assert r.out == f"{image_name}\n"
    assert "step 1/3" in r.err and "copy: src -> /app" in r.err and f"built-{token}" in r.err
    assert "2 step(s) run, 0 cached" in r.err
    again = cli("image", "build", str(spec), "--name", image_name, "--json")
    assert again.json()["name"] == image_name and "(cached)" in again.err
    with corral.Sandbox.create(image=image_name, memory_mb=64, client=client) as sb:
        assert sb.exec("python3 hello.py").stdout == f"hello {token}\n"

    assert image_name in cli("image", "ls", "-q").out.split()
    listed = {i["name"]: i for i in cli("image", "ls", "--json").json()}
    assert listed[image_name]["kind"] == "built" and len(listed[image_name]["layers"]) == 2
    table = cli("image", "ls")
    assert table.code == 0 and image_name in table.out and "built" in table.out

    r = cli("image", "rm", image_name, "no-such-image")
    assert r.code == 1 and r.out.split() == [image_name] and "no-such-image" in r.err
    assert image_name not in cli("image", "ls", "-q").out.split()


def test_a_failed_build_exits_1_naming_the_step(cli, image_name, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("steps:\n  - run: echo the-reason >&2; false\n")
    r = cli("image", "build", str(spec), "--name", image_name, "-q")
    assert r.code == 1 and r.out == ""
    assert "step 1/1 (run: echo the-reason >&2; false) failed" in r.err and "the-reason" in r.err
    r = cli("image", "build", str(tmp_path / "missing.yaml"), "--name", image_name)
    assert r.code == 1 and "cannot read the build spec" in r.err


def test_image_import(cli, image_name, tmp_path):
    rootfs = ImageStore(Layout.create().images_dir).get("python").rootfs
    archive = tmp_path / "img.tar"
    archive.write_bytes(docker_save([base_layer(rootfs).bytes(), second_layer().bytes()]))
    r = cli("image", "import", str(archive), "--name", f"{image_name}-imp", "--json")
    info = r.json()
    assert info["kind"] == "oci" and info["env"]["GREETING"] == "hello from oci"
    r = cli("image", "import", str(tmp_path / "none.tar"), "--name", f"{image_name}-imp")
    assert r.code == 1 and "cannot read the image archive" in r.err


def test_image_import_error_names_the_users_file(cli, image_name, tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not an archive at all\n")
    r = cli("image", "import", str(bad), "--name", image_name)
    assert r.code == 1
    assert r.err.startswith(f"corral: {bad} is neither a tar archive nor a directory"), r.err
    assert "tmp-import" not in r.err and "/var/cache" not in r.err
