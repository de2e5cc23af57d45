"""The image store and the default image ``python``.

The default image is really built (debootstrap, as root) once per session into the
real cache directory, so later runs and other tests reuse it; everything else runs
on tiny trees in tmp directories.
"""

from __future__ import annotations

import fcntl
import glob
import io
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from corral.errors import ImageNotFound, InternalError, InvalidArgument
from corral.runtime import images
from corral.runtime.images import (
    DEFAULT_IMAGE,
    MIRROR_ENV,
    ImageStore,
    find_debian_mirror,
    find_python,
    host_codename,
    parse_deb822_sources,
    parse_sources_list,
    postprocess_default_rootfs,
    validate_name,
)
from corral.runtime.paths import Layout

MIRROR_A = "http://mirror-a.invalid/debian"
MIRROR_B = "https://mirror-b.invalid/debian/"
SECURITY = "http://mirror-a.invalid/debian-security"
CANARY = "corral-canary-7f3e9a1c5b"

needs_root_debootstrap = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("debootstrap") is None,
    reason="building the default image needs root and debootstrap",
)


# -- the real default image ---------------------------------------------------------------


@pytest.fixture(scope="session")
def default_image() -> images.Image:
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("building the default image needs root and debootstrap")
    store = ImageStore(Layout.create().images_dir)
    # If this session builds the image, the canary must not reach it (see the leak test).
    os.environ["CORRAL_TEST_CANARY"] = CANARY
    try:
        return store.ensure_default()
    finally:
        del os.environ["CORRAL_TEST_CANARY"]


pytestmark_default = [needs_root_debootstrap, pytest.mark.root, pytest.mark.timeout(1800)]


def _chroot_python(image: images.Image, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the image's python as the sandbox uid, without writing into the image."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        ["chroot", "--userspec=1000:1000", str(image.rootfs), "/usr/bin/env", "-i",
         *(f"{k}={v}" for k, v in env.items()), image.python or "python3", *args],
        check=False, capture_output=True, text=True, timeout=120,
    )


class TestDefaultImage:
    pytestmark = pytestmark_default

    def test_python_and_pip_run_as_the_sandbox_user(self, default_image):
        assert default_image.name == DEFAULT_IMAGE
        assert default_image.python == "/usr/bin/python3"
        proc = _chroot_python(default_image, "-c",
                              "import pip, ssl, sqlite3, venv, sys; print(sys.version_info[0])")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "3"
        assert (default_image.rootfs / "etc/ssl/certs/ca-certificates.crt").is_file()

    def test_pip_falls_back_to_a_user_install(self, default_image):
        assert not glob.glob(str(default_image.rootfs / "usr/lib/python3*/EXTERNALLY-MANAGED"))
        proc = _chroot_python(default_image, "-m", "pip", "install", "--no-index",
                              "--no-cache-dir", "corral-no-such-package")
        output = proc.stdout + proc.stderr
        assert "externally-managed" not in output
        assert "Defaulting to user installation" in output

    def test_sandbox_user(self, default_image):
        etc = default_image.rootfs / "etc"
        passwd = [line.split(":") for line in (etc / "passwd").read_text().splitlines()]
        assert ["sandbox", "x", "1000", "1000", "sandbox", "/home/sandbox", "/bin/bash"] in passwd
        assert [p[0] for p in passwd if p[2] == "1000"] == ["sandbox"]
        assert "sandbox:x:1000:" in (etc / "group").read_text().splitlines()
        assert any(line.startswith("sandbox:!:") for line in (etc / "shadow").read_text().splitlines())
        assert (etc / "hostname").read_text() == "sandbox\n"
        assert "127.0.0.1\tlocalhost sandbox" in (etc / "hosts").read_text()
        assert (etc / "resolv.conf").read_text() == ""

    def test_nothing_of_the_host_leaks_in(self, default_image):
        rootfs = default_image.rootfs
        assert os.listdir(rootfs / "root") == []
        assert os.listdir(rootfs / "home") == ["sandbox"]
        assert os.listdir(rootfs / "home/sandbox") == []
        assert os.listdir(rootfs / "workspace") == []
        assert "://" not in (rootfs / "etc/apt/sources.list").read_text()
        hostname = socket.gethostname()
        if hostname not in ("localhost", "sandbox"):
            assert hostname not in (rootfs / "etc/hostname").read_text()
            assert hostname not in (rootfs / "etc/hosts").read_text()
        # Nothing of the build caller's environment in the image's /etc: the canary
        # (set while this session builds) and anything that looks like a credential.
        secret = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "API_KEY", "AUTH")
        values = {CANARY} | {v for k, v in os.environ.items()
                             if len(v) >= 8 and any(s in k.upper() for s in secret)}
        for path in (rootfs / "etc").rglob("*"):
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 1_000_000:
                text = path.read_bytes().decode("utf-8", "replace")
                leaked = [v for v in values if v in text]
                assert not leaked, f"{path} holds host environment values"

    def test_world_readable_and_shrunk(self, default_image):
        rootfs = default_image.rootfs
        private = {rootfs / p for p in ("etc/shadow", "etc/shadow-", "etc/gshadow",
                                         "etc/gshadow-", "root")}
        unreadable = []
        for dirpath, dirnames, filenames in os.walk(rootfs):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                st = os.lstat(path)
                need = 0o005 if stat.S_ISDIR(st.st_mode) else 0o004
                if not stat.S_ISLNK(st.st_mode) and path not in private \
                        and st.st_mode & need != need:
                    unreadable.append(str(path))
        assert unreadable == []
        assert os.listdir(rootfs / "usr/share/man") == []
        assert [p.name for p in (rootfs / "var/lib/apt/lists").iterdir()] in ([], ["partial"])
        assert not glob.glob(str(rootfs / "var/cache/apt/*.bin"))
        leftovers = {p.name for p in (rootfs / "usr/share/doc").glob("*/*")}
        assert leftovers <= {"copyright"}

    def test_manifest_and_cache(self, default_image, monkeypatch):
        store = ImageStore(Layout.create().images_dir)
        manifest = store.manifest(DEFAULT_IMAGE)
        assert manifest["debian"] == host_codename()
        assert manifest["python"] == "/usr/bin/python3"
        assert manifest["digest"] == default_image.digest
        assert default_image.digest.startswith("sha256:") and len(default_image.digest) == 71
        assert any(p.startswith("python3:") for p in manifest["source"]["packages"])
        assert 30e6 < default_image.size_bytes < 400e6
        assert DEFAULT_IMAGE in [image.name for image in store.list()]
        def must_not_build(self, log):  # (was a wall-clock bound of 5 s: load could pass it)
            raise AssertionError("the cached image was built again")
        monkeypatch.setattr(ImageStore, "_build_default", must_not_build)
        assert store.ensure_default(log=lambda _: None) == default_image
        assert not [n for n in os.listdir(store.images_dir) if n.startswith(".tmp-")]


# -- mirror discovery ---------------------------------------------------------------------


DEB822 = f"""\
# a comment
Types: deb deb-src
URIs: {MIRROR_A}
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {SECURITY}
Suites: bookworm-security
Components: main

Types: deb
URIs: http://disabled.invalid/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb-src
URIs: http://sources-only.invalid/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://contrib-only.invalid/debian
Suites: bookworm
Components: contrib non-free

Types: deb
URIs:
 {MIRROR_B}
 {MIRROR_A}
Suites: trixie
 bookworm
Components: main
"""

SOURCES_LIST = f"""\
# deb http://commented.invalid/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] {MIRROR_B} bookworm main contrib
deb-src {MIRROR_A} bookworm main
deb {SECURITY} bookworm-security main
deb http://other.invalid/apt cloud-sdk-bookworm main
deb http://trixie.invalid/debian trixie main
deb {MIRROR_A} bookworm contrib  # no main here
deb {MIRROR_A} bookworm main
"""


def test_parse_deb822_sources(tmp_path):
    path = tmp_path / "debian.sources"
    path.write_text(DEB822)
    assert parse_deb822_sources(path, "bookworm") == [MIRROR_A, MIRROR_B]
    assert parse_deb822_sources(path, "trixie") == [MIRROR_B, MIRROR_A]
    assert parse_deb822_sources(path, "bullseye") == []


def test_parse_sources_list(tmp_path):
    path = tmp_path / "sources.list"
    path.write_text(SOURCES_LIST)
    assert parse_sources_list(path, "bookworm") == [MIRROR_B, MIRROR_A]
    assert parse_sources_list(path, "trixie") == ["http://trixie.invalid/debian"]
    assert parse_sources_list(path, "bullseye") == []


def test_find_debian_mirror_order_and_override(tmp_path, monkeypatch):
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d/vendor.list").write_text("deb http://late.invalid/d bookworm main\n")
    assert find_debian_mirror("bookworm", apt_dir=apt) == "http://late.invalid/d"
    (apt / "sources.list").write_text(SOURCES_LIST)
    assert find_debian_mirror("bookworm", apt_dir=apt) == MIRROR_B
    (apt / "sources.list.d/debian.sources").write_text(DEB822)
    (apt / "sources.list.d/other.sources.disabled").write_text(
        "Types: deb\nURIs: http://ignored.invalid/d\nSuites: bookworm\nComponents: main\n")
    assert find_debian_mirror("bookworm", apt_dir=apt) == MIRROR_A
    monkeypatch.setenv(MIRROR_ENV, "http://override.invalid/debian")
    assert find_debian_mirror("bookworm", apt_dir=apt) == "http://override.invalid/debian"


def test_find_debian_mirror_none(tmp_path, monkeypatch):
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    with pytest.raises(InternalError, match=MIRROR_ENV):
        find_debian_mirror("bookworm", apt_dir=tmp_path)


def test_host_codename(tmp_path):
    path = tmp_path / "os-release"
    path.write_text('NAME="Debian GNU/Linux"\nVERSION_CODENAME="bookworm"\nID=debian\n')
    assert host_codename(path) == "bookworm"
    path.write_text("ID=debian\n")
    with pytest.raises(InternalError, match="VERSION_CODENAME"):
        host_codename(path)
    with pytest.raises(InternalError):
        host_codename(tmp_path / "missing")


# -- the store on tiny trees ---------------------------------------------------------------


def make_tree(root: Path, *, python: bool = True) -> Path:
    (root / "usr/bin").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    if python:
        (root / "usr/bin/python3.11").write_text("#!/bin/sh\n")
        os.chmod(root / "usr/bin/python3.11", 0o755)
        os.symlink("python3.11", root / "usr/bin/python3")
    os.symlink("usr/bin", root / "bin")
    return root


def test_add_get_list_remove(tmp_path):
    store = ImageStore(tmp_path / "images")
    assert store.list() == []
    src = make_tree(tmp_path / "src")
    image = store.add_rootfs("tiny", src)
    assert src.is_dir()  # copied, not moved
    assert image.name == "tiny" and image.python == "/usr/bin/python3"
    assert image.rootfs == tmp_path / "images/tiny/rootfs"
    assert os.readlink(image.rootfs / "usr/bin/python3") == "python3.11"
    assert image.digest.startswith("sha256:") and image.size_bytes > 0
    assert stat.S_IMODE(image.rootfs.stat().st_mode) == 0o755
    assert store.get("tiny") == image and store.exists("tiny")

    moved = store.add_rootfs("moved", make_tree(tmp_path / "src2", python=False), move=True)
    assert not (tmp_path / "src2").exists()
    assert moved.python is None
    assert moved.digest != image.digest
    assert [i.name for i in store.list()] == ["moved", "tiny"]

    with pytest.raises(InvalidArgument, match="already exists"):
        store.add_rootfs("tiny", src)
    with pytest.raises(InvalidArgument, match="not a directory"):
        store.add_rootfs("other", tmp_path / "nowhere")

    store.remove("tiny")
    assert not store.exists("tiny") and not (tmp_path / "images/tiny").exists()
    assert [i.name for i in store.list()] == ["moved"]
    with pytest.raises(ImageNotFound):
        store.remove("tiny")
    assert sorted(os.listdir(tmp_path / "images")) == [".lock", "moved"]


def test_image_not_found_names_the_available_ones_and_the_fix(tmp_path):
    store = ImageStore(tmp_path / "images")
    with pytest.raises(ImageNotFound, match="none yet"):
        store.get("python")
    store.add_rootfs("alpha", make_tree(tmp_path / "a"))
    store.add_rootfs("beta", make_tree(tmp_path / "b"))
    with pytest.raises(ImageNotFound) as info:
        store.get("python")
    assert isinstance(info.value, LookupError)
    assert "alpha, beta" in info.value.message
    assert "python -m corral.runtime.prepare" in info.value.message
    assert info.value.details == {"image": "python", "available": ["alpha", "beta"],
                                  "did_you_mean": []}
    assert str(tmp_path) not in info.value.message  # never a path of the host
    with pytest.raises(ImageNotFound, match="did you mean 'alpha'"):
        store.get("alpah")


@pytest.mark.parametrize("name", ["", "Python", "-x", ".hidden", "_x", "a/b", "../etc", "x y",
                                  "a" * 65, "é", "py\n"])
def test_invalid_names_are_rejected(tmp_path, name):
    store = ImageStore(tmp_path / "images")
    for call in (store.get, store.exists, store.remove,
                 lambda n: store.add_rootfs(n, make_tree(tmp_path / "src"))):
        with pytest.raises(InvalidArgument, match="invalid image name"):
            call(name)
    assert not (tmp_path / "images").exists() or store.list() == []


@pytest.mark.parametrize("name", ["a", "python", "py3.11_x-1", "0", "a" * 64])
def test_valid_names(name):
    assert validate_name(name) == name


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_interrupted_work_is_invisible_and_cleaned(tmp_path, monkeypatch):
    images_dir = tmp_path / "images"
    stale = images_dir / f".tmp-python-{_dead_pid()}-0badc0de"
    (stale / "rootfs/usr/bin").mkdir(parents=True)
    (stale / "manifest.json").write_text("{}")
    half = images_dir / "half"  # an image dir without its manifest is not an image
    (half / "rootfs").mkdir(parents=True)
    live = images_dir / f".tmp-other-{os.getppid()}-12345678"
    live.mkdir()
    store = ImageStore(images_dir)
    assert store.list() == [] and not store.exists("python") and not store.exists("half")
    with pytest.raises(ImageNotFound):
        store.get("python")

    # A copy interrupted after the tree is in place leaves nothing either.
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(images, "_scan_tree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.add_rootfs("tiny", make_tree(tmp_path / "src"))
    monkeypatch.undo()
    assert not stale.exists()  # the next piece of work cleaned the dead one up
    assert live.exists()  # its process is still alive
    assert sorted(os.listdir(images_dir)) == [live.name, "half"]
    assert store.add_rootfs("tiny", tmp_path / "src").name == "tiny"


def test_concurrent_ensure_default_waits_and_shares(tmp_path, monkeypatch):
    """A caller that finds a build under way waits for it and uses its result."""
    store = ImageStore(tmp_path / "images")
    store.images_dir.mkdir()

    def must_not_build(self, log):
        raise AssertionError("a second build started while the first held the lock")
    monkeypatch.setattr(ImageStore, "_build_default", must_not_build)
    lines: list[str] = []
    result: list[images.Image] = []
    fd = os.open(store.images_dir / ".build-python.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # "the other builder"
    try:
        waiter = threading.Thread(target=lambda: result.append(store.ensure_default(log=lines.append)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lines and "waiting for another build" in lines[0]
        assert waiter.is_alive()
        built = store.add_rootfs("python", make_tree(tmp_path / "src"))
    finally:
        os.close(fd)
    waiter.join(10)
    assert result == [built]


# -- the build, with debootstrap faked ----------------------------------------------------


class FakeDebootstrap:
    """Stands in for ``subprocess.Popen`` of debootstrap: records it, makes a tiny tree."""

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, cmd, **kwargs):
        self.calls.append((cmd, kwargs["env"]))
        target = Path(cmd[-2])
        if self.returncode == 0:
            make_tree(target)
            etc = target / "etc"
            (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                                        "debian:x:1000:1000::/home/debian:/bin/sh\n")
            (etc / "group").write_text("root:x:0:\ndebian:x:1000:\n")
            (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
            os.chmod(etc / "shadow", 0o640)
            (etc / "apt").mkdir()
            (etc / "apt/sources.list").write_text(f"deb {MIRROR_A} bookworm main\n")
            os.symlink("/run/host-resolv.conf", etc / "resolv.conf")
            (etc / "hostname").write_text("build-host\n")
            (target / "usr/lib/python3.11").mkdir(parents=True)
            (target / "usr/lib/python3.11/EXTERNALLY-MANAGED").write_text("[x]\n")
            (target / "root").mkdir(mode=0o700)
            (target / "root/.bash_history").write_text("secret\n")
            (target / "home/debian").mkdir(parents=True)
            for rel in ("usr/share/doc/bash/copyright", "usr/share/doc/bash/changelog.gz",
                        "usr/share/man/man1/bash.1.gz", "usr/share/locale/de/LC_MESSAGES/x.mo",
                        "var/lib/apt/lists/x_Packages", "var/cache/apt/pkgcache.bin"):
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                (target / rel).write_text("x")
            (target / "var/lib/apt/lists/partial").mkdir()
            (target / "usr/bin/private-tool").write_text("#!/bin/sh\n")
            os.chmod(target / "usr/bin/private-tool", 0o700)
        else:
            target.mkdir(parents=True)
        return _FakeProc(self.returncode, "I: Retrieving InRelease\nI: Extracting bash...\n"
                         "I: Configuring required packages...\nE: Couldn't download packages\n")


class _FakeProc:
    def __init__(self, returncode: int, output: str) -> None:
        self.returncode, self.stdout = returncode, io.StringIO(output)

    def wait(self) -> int:
        return self.returncode

    def poll(self) -> int:
        return self.returncode

    def kill(self) -> None:
        pass


@pytest.fixture
def fake_build(monkeypatch):
    def install(returncode: int) -> FakeDebootstrap:
        fake = FakeDebootstrap(returncode)
        monkeypatch.setattr(images.subprocess, "Popen", fake)
        monkeypatch.setattr(images.shutil, "which", lambda name: "/usr/sbin/" + name)
        monkeypatch.setattr(images, "host_codename", lambda: "bookworm")
        monkeypatch.setenv(MIRROR_ENV, "http://override.invalid/debian")
        monkeypatch.setenv("CORRAL_TEST_CANARY", "must-not-reach-the-build")
        return fake
    return install


def test_build_runs_debootstrap_cleanly_and_postprocesses(tmp_path, fake_build):
    fake = fake_build(0)
    store = ImageStore(tmp_path / "images")
    lines: list[str] = []
    image = store.ensure_default(log=lines.append)

    [(cmd, env)] = fake.calls
    assert cmd[:3] == ["debootstrap", "--variant=minbase",
                       "--include=python3,python3-pip,python3-venv,ca-certificates"]
    assert cmd[3] == "bookworm" and cmd[-1] == "http://override.invalid/debian"
    assert "CORRAL_TEST_CANARY" not in env and MIRROR_ENV not in env
    assert any("Configuring required packages" in line for line in lines)
    assert not any("Extracting bash" in line for line in lines)
    assert any("ready" in line for line in lines)

    rootfs = image.rootfs
    assert image.python == "/usr/bin/python3"
    assert store.manifest("python")["debian"] == "bookworm"
    assert not (rootfs / "usr/lib/python3.11/EXTERNALLY-MANAGED").exists()
    passwd = (rootfs / "etc/passwd").read_text().splitlines()
    assert passwd == ["root:x:0:0:root:/root:/bin/bash",
                      "sandbox:x:1000:1000:sandbox:/home/sandbox:/bin/bash"]
    assert (rootfs / "etc/group").read_text().splitlines()[-1] == "sandbox:x:1000:"
    assert (rootfs / "etc/shadow").read_text().splitlines()[-1].startswith("sandbox:!:")
    assert stat.S_IMODE((rootfs / "etc/shadow").stat().st_mode) == 0o640
    assert not (rootfs / "etc/resolv.conf").is_symlink()
    assert (rootfs / "etc/resolv.conf").read_text() == ""
    assert (rootfs / "etc/hostname").read_text() == "sandbox\n"
    assert "://" not in (rootfs / "etc/apt/sources.list").read_text()
    assert os.listdir(rootfs / "root") == []
    assert os.listdir(rootfs / "home") == ["sandbox"]
    assert (rootfs / "workspace").is_dir()
    assert [p.name for p in (rootfs / "usr/share/doc/bash").iterdir()] == ["copyright"]
    assert os.listdir(rootfs / "usr/share/man") == [] and os.listdir(rootfs / "usr/share/locale") == []
    assert os.listdir(rootfs / "var/lib/apt/lists") == ["partial"]
    assert not (rootfs / "var/cache/apt/pkgcache.bin").exists()
    assert stat.S_IMODE((rootfs / "usr/bin/private-tool").stat().st_mode) == 0o705

    # Cached: a second call builds nothing.
    assert store.ensure_default(log=lines.append) == image
    assert len(fake.calls) == 1


def test_failed_build_leaves_nothing(tmp_path, fake_build):
    fake_build(1)
    store = ImageStore(tmp_path / "images")
    with pytest.raises(InternalError) as info:
        store.ensure_default(log=lambda _: None)
    assert "debootstrap failed" in info.value.message
    assert "Couldn't download packages" in info.value.message
    assert MIRROR_ENV in info.value.message
    assert store.list() == []
    assert sorted(os.listdir(store.images_dir)) == [".build-python.lock"]


def test_postprocess_and_find_python_on_a_bare_tree(tmp_path):
    root = make_tree(tmp_path / "r", python=False)
    (root / "etc/group").write_text("root:x:0:\n")
    (root / "etc/shadow").write_text("root:*:1:0:99999:7:::\n")
    assert find_python(root) is None
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "usr/local/bin/python3").write_text("")
    os.symlink("/usr/local/bin/python3", root / "usr/bin/python3")  # absolute: inside root
    assert find_python(root) == "/usr/bin/python3"
    os.unlink(root / "usr/local/bin/python3")
    assert find_python(root) is None  # a dangling link is no python
    assert postprocess_default_rootfs(root) is None
    assert (root / "home/sandbox").is_dir() and (root / "workspace").is_dir()
