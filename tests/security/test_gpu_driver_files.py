"""Red-team: the GPU driver's libraries are found outside the ldconfig cache too, in the
directories of the daemon's ``LD_LIBRARY_PATH`` and the usual ones, and bound read-only
into every GPU sandbox of every tenant. A host user who can write one of those
directories (one open to others, or its own) plants a ``libcuda.so.1`` that would run in
every tenant's CUDA processes; a link named as a driver library can point at any host
file (with no driver version known, nothing else checked it), which would be bound into
the sandbox. Neither is taken: only libraries of their own name, owned by the admin and
writable by nobody else, in a directory likewise."""

from __future__ import annotations

import os

from corral.runtime.gpus import find_driver_files
from tests.conftest import requires_root

VERSION = "580.65.06"


def _driver(libdir, name="libcuda"):
    real = libdir / f"{name}.so.{VERSION}"
    real.write_text("x")
    real.chmod(0o644)
    (libdir / f"{name}.so.1").symlink_to(real.name)
    return real


def _found(tmp_path, monkeypatch, *dirs, version=VERSION):
    monkeypatch.setenv("LD_LIBRARY_PATH", ":".join(str(d) for d in dirs))
    return find_driver_files(version, tmp_path / "dev", ldconfig_text="").libraries


def test_a_driver_library_linked_to_another_host_file_is_not_bound(tmp_path, monkeypatch):
    libdir = tmp_path / "lib"
    libdir.mkdir(mode=0o755)
    (libdir / "libnvidia-ml.so.1").symlink_to("/etc/passwd")
    real = _driver(libdir)
    for version in (VERSION, None):  # None: no NVML to say the driver's version
        assert _found(tmp_path, monkeypatch, libdir, version=version) == (
            (real, "libcuda.so.1"),)


@requires_root
def test_a_library_a_host_user_could_write_is_not_bound(tmp_path, monkeypatch):
    tmp_path.chmod(0o755)
    open_dir = tmp_path / "open"  # a directory anyone may write (or rename into)
    open_dir.mkdir()
    open_dir.chmod(0o777)
    _driver(open_dir)
    theirs = tmp_path / "theirs"  # a host user's own directory and library
    theirs.mkdir()
    planted = _driver(theirs, "libnvidia-ml")
    os.chown(planted, 1000, 1000)
    os.chown(theirs, 1000, 1000)
    writable = tmp_path / "writable"  # the admin's directory, a library others may write
    writable.mkdir(mode=0o755)
    _driver(writable, "libnvidia-cfg").chmod(0o666)
    assert _found(tmp_path, monkeypatch, open_dir, theirs, writable) == ()
    admins = tmp_path / "admins"
    admins.mkdir(mode=0o755)
    real = _driver(admins)
    assert _found(tmp_path, monkeypatch, open_dir, admins) == ((real, "libcuda.so.1"),)


def test_the_admins_own_library_is_still_found(tmp_path, monkeypatch):
    libdir = tmp_path / "lib"
    libdir.mkdir(mode=0o755)
    real = _driver(libdir)
    assert _found(tmp_path, monkeypatch, libdir) == ((real, "libcuda.so.1"),)
