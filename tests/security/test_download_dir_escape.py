"""A hostile sandbox's archive for ``files.download_dir`` / ``corral cp`` (client/_tree.py).

The archive ``download_dir`` unpacks on the caller's machine is whatever the sandbox
left at the archive's path: code in the sandbox can replace the file its ``tar`` wrote
(same user), or replace ``tar``. So ``_tree.unpack`` is given a forged archive here,
exactly as ``download_dir`` hands it the downloaded bytes.

The forgery is CVE-2025-4517's: symlinks chained through directory names long enough
that ``os.path.realpath`` passes PATH_MAX and stops resolving, so tarfile's ``data``
filter (before Python 3.11.13 / 3.12.11) judges a path through a link as inside the
destination while the kernel follows the link out of it.
"""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from corral.client import _tree
from corral.errors import FileError


def forged(outside: str) -> bytes:
    comp = "d" * 247
    steps = "abcdefghijklmnop"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        path = ""
        for s in steps:
            d = tarfile.TarInfo(os.path.join(path, comp))
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
            link = tarfile.TarInfo(os.path.join(path, s))
            link.type, link.linkname = tarfile.SYMTYPE, comp
            tar.addfile(link)
            path = os.path.join(path, comp)
        deep = os.path.join(*steps, "l" * 254)
        up = tarfile.TarInfo(deep)
        up.type, up.linkname = tarfile.SYMTYPE, os.path.join(*[".."] * len(steps))
        tar.addfile(up)
        escape = tarfile.TarInfo("escape")
        escape.type, escape.linkname = tarfile.SYMTYPE, deep + "/../" + outside
        tar.addfile(escape)
        data = b"pwned\n"
        flag = tarfile.TarInfo("escape/flag")
        flag.size = len(data)
        tar.addfile(flag, io.BytesIO(data))
    return buf.getvalue()


def test_forged_archive_writes_nothing_outside_the_copy(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "dest").mkdir()
    archive = tmp_path / "a.tar"
    archive.write_bytes(forged("../outside"))
    target = tmp_path / "dest" / "copy"
    with pytest.raises(FileError, match="nothing was written"):
        _tree.unpack(archive, target, mode=0o755, sandbox_id="sb", source="/work")
    assert list(outside.iterdir()) == []
    assert not os.path.lexists(target)
    assert os.listdir(tmp_path / "dest") == []  # the staging directory went too
    assert [p for p in tmp_path.rglob("flag")] == []


@pytest.mark.parametrize("names", [
    # a file over a link the archive made (the kernel would open through it)
    [("l", "sym", "/etc"), ("l", "file", "")],
    # a path through a link by way of a parent and ".."
    [("x", "dir", ""), ("l", "sym", "x"), ("l/../y", "file", "")],
    # a hard link whose target goes through a link
    [("l", "sym", "/etc"), ("h", "hard", "l/passwd")],
])
def test_members_through_links_refused(tmp_path, names):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, target in names:
            m = tarfile.TarInfo(name)
            if kind == "sym":
                m.type, m.linkname = tarfile.SYMTYPE, target
            elif kind == "hard":
                m.type, m.linkname = tarfile.LNKTYPE, target
            elif kind == "dir":
                m.type = tarfile.DIRTYPE
            tar.addfile(m, io.BytesIO(b"") if kind == "file" else None)
    archive = tmp_path / "a.tar"
    archive.write_bytes(buf.getvalue())
    with pytest.raises(FileError):
        _tree.unpack(archive, tmp_path / "copy", mode=0o755, sandbox_id="sb", source="/w")
    assert not os.path.lexists(tmp_path / "copy")


def test_an_honest_tree_with_links_still_copies(tmp_path):
    """What ``tar -c`` of a real tree holds: links (absolute, relative, dangling) kept as
    links, hard links inside the copy, files beside them."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("x = 1\n")
    os.link(src / "pkg" / "a.py", src / "pkg" / "hard.py")
    os.symlink("/usr/bin/python3", src / "python")
    os.symlink("pkg/a.py", src / "rel")
    os.symlink("../nowhere", src / "dangling")
    archive = _tree.pack(src)
    try:
        _tree.unpack(archive, tmp_path / "copy", mode=0o755, sandbox_id="sb", source="/w")
    finally:
        archive.unlink()
    copy = tmp_path / "copy"
    assert os.readlink(copy / "python") == "/usr/bin/python3"
    assert os.readlink(copy / "dangling") == "../nowhere"
    assert (copy / "rel").read_text() == "x = 1\n"
    assert (copy / "pkg" / "hard.py").read_text() == "x = 1\n"
