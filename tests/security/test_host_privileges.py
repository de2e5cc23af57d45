"""No privilege leaves an image, and no secret leaves the state directory (issue 12):
checked from the host, as an unprivileged local user, the way an attacker would."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest

from corral.runtime.oci import import_image
from tests.conftest import requires_root
from tests.runtime.oci_archives import base_layer, docker_save

pytestmark = [requires_root, pytest.mark.timeout(300)]

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=30)


async def test_an_imported_setuid_root_file_loses_its_bit_and_is_out_of_reach(engine, tmp_path):
    name = f"t-suid-{secrets.token_hex(4)}"
    base = base_layer(engine.images.get("python").rootfs)
    base.file("bin/rootid", b"#!/bin/sh\nid\n", mode=0o4755).file("bin/grp", b"", mode=0o2755)
    archive = tmp_path / "image.tar"
    archive.write_bytes(docker_save([base.bytes()]))
    try:
        image = import_image(engine.images, archive, name)
        rootid = Path(image.rootfs) / "bin" / "rootid"
        mode = os.lstat(rootid).st_mode
        assert not mode & (stat.S_ISUID | stat.S_ISGID), oct(mode)  # was 0o4755 in the archive
        assert not os.lstat(Path(image.rootfs) / "bin" / "grp").st_mode & stat.S_ISGID
        assert mode & 0o111  # still executable
        # And a local user cannot even reach it (nor the default image's own su).
        probe = as_nobody("test", "-e", str(rootid))
        assert probe.returncode != 0
        su = Path(engine.images.get("python").rootfs) / "bin" / "su"
        assert su.exists()  # the control: root sees it
        assert as_nobody("test", "-e", str(su)).returncode != 0
        assert stat.S_IMODE(os.stat(engine.images.images_dir).st_mode) == 0o700
    finally:
        if engine.images.exists(name):
            engine.images.remove(name)


async def test_the_registry_holding_env_secrets_is_root_only(engine):
    info = await engine.create(env={"API_KEY": "s3cret-value"})
    try:
        db = engine.layout.registry_path
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            if path.exists():
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        assert as_nobody("cat", str(db)).returncode != 0
        assert b"s3cret-value" in db.read_bytes() + Path(f"{db}-wal").read_bytes()  # it is there
    finally:
        await engine.delete(info.id)
