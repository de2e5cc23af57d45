"""``treecopy.discard_tree``/``remove_tree``/``listings`` on a hostile tree (a sandbox's
or a sent context's): symlink loops and links to directories outside are removed or
listed as links, never followed (what they point to stays untouched, nothing loops)."""

from __future__ import annotations

import os

from corral.runtime.treecopy import discard_tree, listings, remove_tree


def _hostile(tmp_path):
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "precious").write_text("host data")
    root = tmp_path / "root"
    deep = root / "a" / "b"
    deep.mkdir(parents=True)
    os.symlink(".", root / "loop")
    os.symlink("..", deep / "up")
    os.symlink(root, deep / "back")  # absolute, to the root itself
    os.symlink(outside, deep / "out")
    os.symlink(outside / "keep", root / "keep")
    os.symlink("dangling", root / "gone")
    (deep / "f").write_text("x")
    return root, outside


def test_listings_never_follow_a_link(tmp_path):
    root, _ = _hostile(tmp_path)
    rels = [rel for rel, *_ in listings(root)]
    assert sorted(rels) == sorted(["a", "gone", "keep", "loop", "a/b", "a/b/back",
                                   "a/b/f", "a/b/out", "a/b/up"])


def test_removing_a_hostile_tree_leaves_what_its_links_point_to(tmp_path):
    for remove in (remove_tree, discard_tree):
        root, outside = _hostile(tmp_path)
        remove(root)
        assert not os.path.lexists(root)
        assert (outside / "keep" / "precious").read_text() == "host data"
        remove_tree(outside)


def test_a_root_that_is_a_link_is_unlinked_not_emptied(tmp_path):
    root, outside = _hostile(tmp_path)
    link = tmp_path / "link"
    os.symlink(outside, link)
    discard_tree(link)
    assert not os.path.lexists(link)
    assert (outside / "keep" / "precious").read_text() == "host data"
    discard_tree(root)
