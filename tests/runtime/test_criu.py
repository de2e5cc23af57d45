"""The cached CRIU (scripts/build_criu.sh) and what ``corral doctor`` says about it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from corral.errors import Unsupported
from corral.runtime import criu, doctor
from corral.runtime.paths import Layout, default_cache_dir

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_criu.sh"


def _fake(cache: Path, version: str) -> Path:
    d = cache / "criu" / version
    d.mkdir(parents=True)
    binary = d / "criu"
    binary.write_text("#!/bin/sh\necho 'Looks good.'\n")
    binary.chmod(0o755)
    return binary


def test_find_takes_the_newest_version_at_least_4_2(tmp_path):
    assert criu.find(tmp_path) is None
    _fake(tmp_path, "3.17.1")
    _fake(tmp_path, "not-a-version")
    assert criu.find(tmp_path) is None  # too old: 3.17 fails on kernels >= 6.13
    _fake(tmp_path, "4.2")
    newest = _fake(tmp_path, "4.10.1")
    found = criu.find(tmp_path)
    assert found is not None and found.path == newest and found.version_text == "4.10.1"
    assert not found.redumps
    # a build with corral's patches (it can checkpoint restored copies) comes first
    patched = _fake(tmp_path, f"4.2.1-corral{criu.PATCH_LEVEL}")
    found = criu.find(tmp_path)
    assert found is not None and found.path == patched and found.redumps
    assert found.version_text == "4.2.1"


def test_the_build_script_applies_the_patches_criu_py_expects():
    text = SCRIPT.read_text()
    assert f"PATCH_LEVEL={criu.PATCH_LEVEL} " in text
    patches = sorted((SCRIPT.parent / "criu").glob("*.patch"))
    assert len(patches) == criu.PATCH_LEVEL, patches


def test_require_says_how_to_build_it(tmp_path):
    with pytest.raises(Unsupported) as err:
        criu.require(tmp_path)
    assert "build_criu.sh" in err.value.message
    assert err.value.details["cause"] == "criu_missing"


def test_doctor_without_criu_warns_with_the_fix(tmp_path):
    check = doctor.live_checkpoints(Layout(tmp_path, tmp_path))
    assert check.status == doctor.WARN
    assert "build_criu.sh" in (check.fix or "")


def test_doctor_reports_a_failing_criu_check(tmp_path):
    binary = _fake(tmp_path, "4.2.1")
    binary.write_text("#!/bin/sh\necho 'Error: no vvar' >&2\nexit 1\n")
    check = doctor.live_checkpoints(Layout(tmp_path, tmp_path), run_check=True)
    assert check.status == doctor.WARN and "no vvar" in check.detail
    ok = _fake(tmp_path, "4.3")
    assert ok.exists()
    check = doctor.live_checkpoints(Layout(tmp_path, tmp_path), run_check=True)
    assert check.status == doctor.WARN and "patch" in check.detail  # unpatched: no re-dump
    _fake(tmp_path, f"4.2.1-corral{criu.PATCH_LEVEL}")
    assert doctor.live_checkpoints(Layout(tmp_path, tmp_path), run_check=True).status == doctor.OK


@pytest.mark.skipif(os.geteuid() != 0, reason="criu check needs root (CI runs as root)")
def test_the_installed_criu_passes_its_check_here():
    found = criu.find(default_cache_dir())
    if found is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    ok, output = criu.check(found)
    assert ok, output
    check = doctor.live_checkpoints(Layout(default_cache_dir(), default_cache_dir()))
    assert check.status == doctor.OK, check


@pytest.mark.skipif(os.geteuid() != 0, reason="the build script runs as root")
def test_build_script_reuses_the_cached_binary_without_apt(tmp_path):
    binary = _fake(tmp_path, f"4.2.1-corral{criu.PATCH_LEVEL}")
    # a cached binary: the script exits before any apt-get (no network, instant)
    env = {"CORRAL_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"cached {binary}" in r.stdout


_CHECK_IN_OWN_RUN = """
import os, subprocess, sys
from pathlib import Path
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
subprocess.run(["mount", "--bind", sys.argv[1], "/run"], check=True)
found = criu.find(default_cache_dir())
subprocess.run([str(found.path), "check"], capture_output=True, check=False)
left = Path("/run/criu.kdat.tmp").exists()
os.unlink("/run/criu.kdat.tmp") if left else None
ok, output = criu.check(found)
print(left, Path("/run/criu.kdat.tmp").exists(), ok, output)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="criu check needs root (CI runs as root)")
def test_criu_check_leaves_no_kdat_tmp_in_run(tmp_path):
    """Root's CRIU leaves ``/run/criu.kdat.tmp`` behind where /run is no tmpfs; corral's
    check removes it. Run with a /run of the test's own (a private mount namespace)."""
    found = criu.find(default_cache_dir())
    if found is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    run = tmp_path / "run"
    run.mkdir()
    if criu.fs_type(str(run)) == criu.TMPFS_MAGIC:
        pytest.skip("the test's directory is a tmpfs, where CRIU keeps its probes")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        _CHECK_IN_OWN_RUN, str(run)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    left_by_criu, left_by_corral, ok, _ = r.stdout.split(" ", 3)
    assert left_by_criu == "True", r.stdout  # what corral must clean: CRIU's own doing
    assert left_by_corral == "False", r.stdout


def test_drop_kdat_tmp_removes_it_only_off_tmpfs(tmp_path):
    (tmp_path / criu.KDAT_TMP).write_bytes(b"")
    if criu.fs_type(str(tmp_path)) != criu.TMPFS_MAGIC:
        assert criu.drop_kdat_tmp(tmp_path)
        assert not (tmp_path / criu.KDAT_TMP).exists()
    assert not criu.drop_kdat_tmp(tmp_path)  # none: nothing to do
    shm = Path("/dev/shm")
    if shm.is_dir() and criu.fs_type(str(shm)) == criu.TMPFS_MAGIC:
        d = Path(tempfile.mkdtemp(dir=shm))
        try:
            (d / criu.KDAT_TMP).write_bytes(b"")
            assert not criu.drop_kdat_tmp(d)  # another CRIU's, about to be renamed
            assert (d / criu.KDAT_TMP).exists()
        finally:
            shutil.rmtree(d)
