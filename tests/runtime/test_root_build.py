"""Build steps as root (``user: root``): apt-get in the build sandbox's user namespace,
an image whose sandboxes still run as the unprivileged sandbox user."""

from __future__ import annotations

import os
import secrets
import stat

import pytest

from corral.errors import InvalidArgument
from corral.image_schema import BuildSpec, RunStep
from corral.runtime import image_cache, paths
from corral.runtime.image_build import build_image
from corral.runtime.uids import is_sandbox_uid
from tests.conftest import requires_root

APT = ("apt-get update -q && apt-get install -y -q --no-install-recommends jq && "
       "rm -rf /var/lib/apt/lists/*")


def test_user_is_a_run_or_copy_step_option_only():
    """``user: root`` on run steps, and on copy steps (Docker's COPY makes root's files:
    docs/agentic.md); never another user, never on other steps."""
    spec = BuildSpec.parse({"base": "python", "steps": [{"run": "true", "user": "root"},
                                                         {"run": "true"}]})
    assert isinstance(spec.steps[0], RunStep) and spec.steps[0].as_root
    assert not spec.steps[1].as_root and spec.describe(0) == "run (as root): true"
    copied = BuildSpec.parse({"base": "python", "steps": [{"copy": "a -> /b", "user": "root"}]})
    assert copied.steps[0].user == "root"
    for bad in ({"run": "true", "user": "admin"}, {"copy": "a -> /b", "user": "admin"},
                {"env": {"A": "1"}, "user": "root"}):
        with pytest.raises(InvalidArgument):
            BuildSpec.parse({"base": "python", "steps": [bad]})


@requires_root
@pytest.mark.root
@pytest.mark.timeout(900)
async def test_apt_get_as_root_then_the_sandbox_user_at_run_time(engine):
    name = f"t-rootbuild-{secrets.token_hex(4)}"
    spec = {"base": "python", "steps": [
        {"run": APT, "user": "root"},
        {"run": "echo mine > ~/after.txt"},  # a later step is the sandbox user's again
    ]}
    try:
        result = await build_image(engine, spec, name=name)
        assert (result.stats.built, result.stats.cached) == (2, 0)
        info = await engine.create({"image": name})
        try:
            async def sh(cmd: str):
                return await engine.exec(info.id, ["/bin/sh", "-c", cmd], timeout=60)

            r = await sh("id -u; echo '{\"a\": 41}' | jq '.a + 1'")
            assert r.returncode == 0 and r.stdout.split() == [b"1000", b"42"], r
            r = await sh("apt-get install -y -q jq")  # not root here: no apt
            assert r.returncode != 0 and b"Permission denied" in r.stderr, r
            r = await sh("touch /usr/bin/x")
            assert r.returncode != 0
            r = await sh("stat -c %U /usr/bin/jq; stat -c %U ~/after.txt; cat ~/after.txt")
            assert r.stdout.split() == [b"root", b"sandbox", b"mine"], r  # the sandbox's root
        finally:
            await engine.delete(info.id)
        # On the host: the root step's layer is root's, not some sandbox uid's.
        manifest = engine.images.manifest(name)
        layer = image_cache.layer_store(engine.images.images_dir).path(
            manifest["layers"][1]["id"])  # top first: [0] is the user step
        owners = {os.lstat(os.path.join(d, f)).st_uid
                  for d, dirs, files in os.walk(layer) for f in files + dirs}
        assert owners == {0}, owners
        assert (layer / "usr/bin/jq").exists() and not any(map(is_sandbox_uid, owners))
        # the mirror it used (which may carry credentials) is root's alone on the host
        share = paths.share_dir(engine.images.images_dir.parent)
        assert stat.S_IMODE(os.stat(share / ".build-apt-sources.list").st_mode) == 0o600
        again = await build_image(engine, spec, name=name)  # cached, as any step
        assert (again.stats.built, again.stats.cached) == (0, 2)
    finally:
        if engine.images.exists(name):
            engine.images.remove(name)
