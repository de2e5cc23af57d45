"""Dockerfiles through a real daemon: ``corral image build -f Dockerfile DIR`` and
``corral.Image.from_dockerfile``, FROM an image of a local registry (pulled on first
use), ``.dockerignore`` applied before anything leaves the client, build args, and
refused instructions named by line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import corral
from corral.runtime.image_pull import local_name
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root
from tests.runtime.oci_archives import oci_layout
from tests.runtime.registries import requires_registry, rootfs_layer, run_registry

pytestmark = [requires_root, requires_registry, pytest.mark.root, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def python_layer() -> bytes:
    return rootfs_layer(default_cache_dir() / "images/python/rootfs")


@pytest.fixture
def registry_ref(tmp_path, python_layer):
    layout = oci_layout(tmp_path / "layout", [python_layer], gzip_layers=False, config={
        "architecture": "amd64", "os": "linux",
        # a WorkingDir the image lacks: Docker makes it, so must corral
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/srv/task"}})
    with run_registry(tmp_path / "registry") as registry:
        yield registry.push(layout, "base/python:12")


def cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corral.cli.main", "--url", daemon.url, *args],
                          capture_output=True, text=True, timeout=500)


def test_dockerfile_from_a_registry_image(daemon, tmp_path, registry_ref):
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app/main.py").write_text("print('task ready')\n")
    (ctx / "app/secret.key").write_text("never sent\n")
    (ctx / "build-cache").mkdir()
    (ctx / "build-cache/junk").write_text("x\n")
    (ctx / ".dockerignore").write_text("# not sent\n**/*.key\nbuild-cache\n")
    (ctx / "Dockerfile.task").write_text(
        f"FROM {registry_ref}\n"
        "ARG TASK=one\n"
        "ENV TASK_NAME=$TASK\n"
        "WORKDIR /opt/task\n"
        "COPY app/ ./app/\n"
        "RUN ls -A /opt/task/app > /opt/task/listing.txt\n"
        "USER sandbox\n"
        "WORKDIR /home/sandbox\n")
    name = "t-dockerfile-cli"
    try:
        done = cli(daemon, "image", "build", "-f", str(ctx / "Dockerfile.task"), str(ctx),
                   "--name", name, "--build-arg", "TASK=two")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == name
        assert "stage 1/1" in done.stderr and "FROM " + registry_ref in done.stderr
        with corral.Client(daemon.url) as client:
            with corral.Sandbox.create(image=name, memory_mb=128, client=client) as sb:
                assert sb.exec("pwd").stdout == "/home/sandbox\n"
                assert sb.exec("echo $TASK_NAME").stdout == "two\n"
                assert sb.exec("python3 /opt/task/app/main.py").stdout == "task ready\n"
                assert sb.exec("cat /opt/task/listing.txt").stdout == "main.py\n"  # no .key
            # the SDK, same context: every step cached
            image = corral.Image.from_dockerfile(ctx, dockerfile=ctx / "Dockerfile.task",
                                                 name=name, build_args={"TASK": "two"},
                                                 client=client)
            assert image.build_stats.built == 0
            with pytest.raises(corral.DockerfileError, match="line 2") as info:
                (ctx / "Dockerfile").write_text(f"FROM {registry_ref}\nVOLUME /data\n")
                corral.Image.from_dockerfile(ctx, name=name, client=client)
            assert info.value.details["instruction"] == "VOLUME"
    finally:
        cli(daemon, "image", "rm", name, local_name(registry_ref))  # the built, the pulled
