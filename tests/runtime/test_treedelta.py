"""A precopy brought up to date by its delta equals a fresh copy of the tree (issue 30).

:func:`corral.runtime.treedelta.sync_delta` is what a commit runs while the sandbox is
frozen: every kind of change made after the precopy must reach the staged copy, and a
large file's hash computed behind the precopy must never be used for a file copied
again. No root needed: plain trees under the test's own directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corral.runtime.layers import TREE, LayerStore, tree_digest
from corral.runtime.treecopy import copy_tree
from corral.runtime.treedelta import sync_delta

MB = 1 << 20


def _tree(root: Path) -> None:
    (root / "d" / "deep").mkdir(parents=True)
    (root / "gone").mkdir()
    (root / "gone" / "x").write_text("x")
    (root / "same.txt").write_text("unchanged")
    (root / "edit.txt").write_text("aaaa")
    (root / "grow.txt").write_text("a")
    (root / "rm.txt").write_text("rm")
    (root / "mv.txt").write_text("mv")
    (root / "f2d").write_text("file")
    (root / "d2f").mkdir()
    (root / "d2f" / "y").write_text("y")
    (root / "d" / "deep" / "z").write_text("z")
    (root / "link1").write_text("hard")
    os.link(root / "link1", root / "d" / "link2")
    os.symlink("same.txt", root / "sym")
    (root / "mode.sh").write_text("#!/bin/sh\n")
    (root / "tomove" / "inner").mkdir(parents=True)
    (root / "tomove" / "inner" / "kept").write_text("moved along")
    os.setxattr(root / "d", "user.corral-test", b"1")


def _change(root: Path) -> None:
    with open(root / "edit.txt", "r+") as f:  # same size, same inode: only times differ
        f.write("bbbb")
    with open(root / "grow.txt", "a") as f:
        f.write("more")
    (root / "rm.txt").unlink()
    os.rename(root / "mv.txt", root / "d" / "moved.txt")
    (root / "f2d").unlink()
    (root / "f2d").mkdir()
    (root / "f2d" / "inside").write_text("in")
    (root / "d2f" / "y").unlink()
    (root / "d2f").rmdir()
    (root / "d2f").write_text("now a file")
    (root / "gone" / "x").unlink()
    (root / "gone").rmdir()
    (root / "new" / "sub").mkdir(parents=True)
    (root / "new" / "sub" / "n").write_text("new")
    with open(root / "d" / "link2", "a") as f:  # both names of the inode change
        f.write("+")
    os.link(root / "same.txt", root / "d" / "same-again")  # a new name of an old file
    os.chmod(root / "mode.sh", 0o755)
    os.unlink(root / "sym")
    os.symlink("edit.txt", root / "sym")
    os.rename(root / "tomove", root / "new" / "moved")  # its entries keep their signatures
    os.removexattr(root / "d", "user.corral-test")


def test_the_delta_makes_the_copy_equal_to_the_tree_now(tmp_path):
    src, dst, fresh = tmp_path / "src", tmp_path / "dst", tmp_path / "fresh"
    src.mkdir()
    _tree(src)
    record: dict[bytes, tuple[int, ...]] = {}
    copy_tree(src, dst, record=record)
    assert tree_digest(dst) == tree_digest(src)
    before = tree_digest(dst)
    _change(src)
    assert tree_digest(src) != before
    n = sync_delta(src, dst, record)
    copy_tree(src, fresh)
    assert tree_digest(dst) == tree_digest(fresh) == tree_digest(src)
    assert os.stat(dst / "link1").st_ino == os.stat(dst / "d" / "link2").st_ino
    assert (dst / "same.txt").read_text() == "unchanged"
    assert n > 0
    assert sync_delta(src, dst, record) >= 0  # a second pass keeps it equal
    assert tree_digest(dst) == tree_digest(src)


def test_an_unchanged_tree_copies_nothing_again(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(MB))
    (src / "a").mkdir()
    (src / "a" / "b").write_text("b")
    record: dict[bytes, tuple[int, ...]] = {}
    copy_tree(src, dst, record=record)
    ino = os.stat(dst / "big").st_ino
    assert sync_delta(src, dst, record) == 0
    assert os.stat(dst / "big").st_ino == ino  # not copied again


def test_a_file_changed_after_it_was_stream_hashed_is_hashed_again(tmp_path):
    """The precopy hashed the large file behind its copy; the delta replaces that
    copy: the layer's digest must be the new content's, never the cached one's."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(b"a" * (2 * MB))
    store = LayerStore(tmp_path / "layers")
    store.open([])
    store.stream_hash = True
    record: dict[bytes, tuple[int, ...]] = {}
    tmp = store.stage(src, record=record)
    with open(src / "big", "r+b") as f:
        f.write(b"b" * (2 * MB))
    assert store.restage(tmp, src, record) == 1
    sealed = store.seal(tmp)
    plain = LayerStore(tmp_path / "plain")
    plain.open([])
    plain.stream_hash = False
    assert sealed.digest == plain.seal(plain.stage(src)).digest
    assert (tmp / TREE / "big").read_bytes()[:1] == b"b"


@pytest.mark.parametrize("coarse", [False, True])
def test_recent_entries_are_copied_again_on_a_coarse_clock(tmp_path, coarse):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "f").write_text("x")
    record: dict[bytes, tuple[int, ...]] = {}
    copy_tree(src, dst, record=record)
    since = 0 if coarse else None  # every ctime is later than 0
    assert (sync_delta(src, dst, record, suspect_since_ns=since) > 0) is coarse
