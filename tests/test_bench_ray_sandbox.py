"""benchmarks/setup_ray_sandbox.py (finding the host's Debian archive, version checks, the
tools check) and the clean-up of what Ray's sandboxes leave behind (only this run's)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import setup_ray_sandbox as setup  # noqa: E402
from peers import ray_sandbox  # noqa: E402

DEB822 = """\
Types: deb
# http://snapshot.example/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_archive_from_deb822_skips_comments_and_other_suites():
    sources = {"/etc/apt/sources.list.d/debian.sources": DEB822}
    assert setup.debian_archive(sources, "bookworm") == (
        "http://mirror.example/debian", "/usr/share/keyrings/debian-archive-keyring.gpg")
    with pytest.raises(setup.SetupError, match="no apt source"):
        setup.debian_archive(sources, "trixie")


def test_archive_from_one_line_lists_and_disabled_stanzas():
    disabled = "Enabled: no\nTypes: deb\nURIs: http://off.example/d\nSuites: bookworm\nComponents: main\n"
    sources = {
        "/etc/apt/sources.list.d/a.sources": disabled,
        "/etc/apt/sources.list.d/b.list": (
            "# deb http://commented.example/debian bookworm main\n"
            "deb-src http://src.example/debian bookworm main\n"
            "deb http://contrib.example/debian bookworm contrib\n"
            "deb [arch=amd64 signed-by=/k/debian.gpg] http://line.example/debian bookworm main\n"),
    }
    assert setup.debian_archive(sources, "bookworm") == ("http://line.example/debian", "/k/debian.gpg")
    plain = {"/etc/apt/sources.list": "deb http://plain.example/debian bookworm main contrib\n"}
    assert setup.debian_archive(plain, "bookworm") == ("http://plain.example/debian",
                                                       setup.DEFAULT_KEYRING)


def test_codename_and_dependency_closure():
    assert setup.host_codename('ID=debian\nVERSION_CODENAME="bookworm"\n') == "bookworm"
    with pytest.raises(setup.SetupError):
        setup.host_codename("ID=debian\n")
    out = ("erofs-utils\n  Depends: libc6\n  Depends: <libfoo>\nlibc6\n  Depends: libgcc-s1\n"
           "<libfoo>\nlibgcc-s1\n")
    assert setup.closure(out) == ["erofs-utils", "libc6", "libgcc-s1"]


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs dpkg (Debian)")
def test_versions_compare_as_debian_does():
    assert setup.version_at_least("1.8.6-1", ray_sandbox.EROFS_MIN_VERSION)
    assert not setup.version_at_least("1.5-1", ray_sandbox.EROFS_MIN_VERSION)
    assert setup.version_at_least("0.0~20240729.0-4~bpo12+2", ray_sandbox.RUNSC_MIN_VERSION)
    assert not setup.version_at_least("0.0~20221219.0-2", ray_sandbox.RUNSC_MIN_VERSION)


def _tool(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs dpkg (Debian)")
def test_verify_refuses_old_or_missing_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    with pytest.raises(setup.SetupError, match="missing"):
        setup.verify(tmp_path)
    # bookworm's mkfs.erofs: no --tar
    _tool(bin_dir / "mkfs.erofs", 'echo "usage: mkfs.erofs [OPTIONS] FILE DIRECTORY"\n')
    _tool(bin_dir / "runsc", 'echo "runsc version 0.0~20240729.0"\n# dev.gvisor.spec.rootfs\n')
    with pytest.raises(setup.SetupError, match="no --tar"):
        setup.verify(tmp_path)
    _tool(bin_dir / "mkfs.erofs", 'echo " --tar=X  generate an image from a tarball"\n'
                                  'echo "mkfs.erofs (erofs-utils) 1.8.6"\n')
    assert setup.verify(tmp_path) == {"erofs_utils": "1.8.6", "runsc": "0.0~20240729.0"}
    # bookworm's runsc: too old, and it cannot boot an EROFS root
    _tool(bin_dir / "runsc", 'echo "runsc version 0.0~20221219.0"\n')
    with pytest.raises(setup.SetupError, match="not runsc >="):
        setup.verify(tmp_path)
    _tool(bin_dir / "runsc", 'echo "runsc version 0.0~20240729.0"\n')
    with pytest.raises(setup.SetupError, match="EROFS"):
        setup.verify(tmp_path)


def test_tools_go_first_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_RAY_SANDBOX_TOOLS", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    ray_sandbox.use_tools()  # nothing set up: PATH unchanged, and the reason says what to run
    assert os.environ["PATH"] == "/usr/bin:/bin"
    assert ray_sandbox.tools_bin() is None
    (tmp_path / "tools.json").write_text('{"bin": "%s/bin"}' % tmp_path)
    ray_sandbox.use_tools()
    ray_sandbox.use_tools()
    assert os.environ["PATH"] == f"{tmp_path}/bin:/usr/bin:/bin"


def test_leftovers_removes_only_this_runs(tmp_path, monkeypatch):
    images, runsc_root, cg = tmp_path / "images", tmp_path / "runsc", tmp_path / "cg"
    images.mkdir()
    cg.mkdir()
    (images / "someone-else").mkdir()
    monkeypatch.setattr(ray_sandbox, "FIXED_DIRS", (str(images), str(runsc_root)))
    monkeypatch.setattr(ray_sandbox, "CGROUP_GLOBS", (f"{cg}/*/ray-sandbox-*",))
    left = ray_sandbox.RayLeftovers("corral-bench-42")
    mine, theirs = "ray-sandbox-0123456789ab", "ray-sandbox-ba9876543210"
    with pytest.raises(RuntimeError):
        with left.noting():  # a create that timed out names its sandbox
            raise RuntimeError(f"gVisor container '{mine}' failed to reach 'running' state")
    assert left.ids == {mine}
    for name in ("corral-bench-42", "corral-bench-42.lock", "other-image", "other-image.lock"):
        (images / name).mkdir() if "." not in name else (images / name).touch()
    runsc_root.mkdir()
    (runsc_root / mine).mkdir()
    for ctrl in ("memory", "pids"):
        (cg / ctrl / mine).mkdir(parents=True)
        (cg / ctrl / theirs).mkdir(parents=True)
    removed = left.clean()
    assert sorted(os.listdir(images)) == ["other-image", "other-image.lock", "someone-else"]
    assert not runsc_root.exists()  # this run made it, and it is empty now
    for ctrl in ("memory", "pids"):
        assert not (cg / ctrl / mine).exists() and (cg / ctrl / theirs).exists()
    assert removed == [f"2 cgroups of {mine}"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None,
                    reason="needs root and apt-get")
def test_setup_is_idempotent_once_set_up():
    """With the tools set up (``make bench`` does it; else this test does, once, into
    the same cache), a second run fetches nothing."""
    d = ray_sandbox.tools_dir()
    if not (d / ray_sandbox.TOOLS_FILE).is_file():
        first = subprocess.run([sys.executable, str(BENCH / "setup_ray_sandbox.py")],
                               capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, first.stderr
    r = subprocess.run([sys.executable, str(BENCH / "setup_ray_sandbox.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ready in" in r.stdout and not (d / "apt").exists()
