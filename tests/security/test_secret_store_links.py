"""Red team: the secrets kept for the next engine (runtime/secret_store.py). A link
planted where a sandbox's file goes neither receives its secrets (the target stays as
it was) nor gives its target's bytes back as secrets; a store directory that is a link,
or a sandbox id that is a path, is refused; files are 0600 in a 0700 directory."""

from __future__ import annotations

import os
import stat

import pytest

from corral.runtime.secret_store import SecretStore


def test_links_in_the_store_are_neither_written_through_nor_read(tmp_path):
    store = SecretStore(tmp_path / "secrets")
    victim = tmp_path / "victim.json"
    victim.write_text('{"TOKEN": "not a secret of this sandbox"}')
    (store.root / "sb-1").symlink_to(victim)
    assert store.get("sb-1") == {}  # never read through the link
    store.put("sb-1", {"KEY": "v"})
    assert victim.read_text() == '{"TOKEN": "not a secret of this sandbox"}'
    assert not (store.root / "sb-1").is_symlink() and store.get("sb-1") == {"KEY": "v"}
    mode = (store.root / "sb-1").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(store.root.stat().st_mode) == 0o700
    for bad in ("../x", ".tmp-x", "a/b", ""):
        with pytest.raises(ValueError):
            store.put(bad, {"K": "v"})
        assert store.get(bad) == {}


def test_a_store_directory_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "secrets")
    with pytest.raises(PermissionError):
        SecretStore(tmp_path / "secrets")
