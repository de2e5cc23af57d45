"""Large files are hashed behind their copy (corral.runtime.streamhash): a layer's digest
is the one a full re-read gives, whatever the hasher saw, and nothing leaks."""

from __future__ import annotations

import os
import threading
import time

import pytest

from corral.runtime import layers, streamhash


def _upper(root, big: int):
    root.mkdir()
    (root / "d").mkdir()
    (root / "d/big").write_bytes(os.urandom(big))
    (root / "d/big2").write_bytes(os.urandom(big + 12345))  # not a multiple of a chunk
    os.link(root / "d/big", root / "hard")
    with open(root / "sparse", "wb") as f:  # holes: hashed at seal, never streamed
        f.seek(3 * streamhash.MIN_SIZE)
        f.write(os.urandom(streamhash.MIN_SIZE))
    (root / "small").write_bytes(b"x" * 100)
    return root


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(streamhash, "CHUNK", 1 << 20)  # several chunks per file
    s = layers.LayerStore(tmp_path / "layers")
    s.stream_hash = True  # however busy the host is
    s.open([])
    return s


def test_streamed_digest_is_the_full_reads(store, tmp_path):
    src = _upper(tmp_path / "upper", 3 * streamhash.MIN_SIZE + 7)
    fds = _open_fds()
    tmp = store.stage(src)
    hasher = store._hashers[tmp.name]
    hasher.wait()
    assert len(hasher.results) == 2  # big (its hard link shares it) and big2, not sparse
    sealed = store.seal(tmp)
    assert sealed.digest == layers.tree_digest(tmp / layers.TREE)[0]
    layer, _ = store.install(sealed)
    assert store.verify(layer.id, layer.digest)
    assert _open_fds() == fds and store._hashers == {}
    store.stream_hash = False  # the same tree hashed only at seal: the same layer
    assert store.seal(store.stage(src)).digest == sealed.digest


def test_a_staged_file_changed_after_its_hash_is_hashed_again(store, tmp_path):
    src = _upper(tmp_path / "upper", 2 * streamhash.MIN_SIZE)
    tmp = store.stage(src)
    store._hashers[tmp.name].wait()
    os.truncate(tmp / layers.TREE / "d/big2", streamhash.MIN_SIZE)  # size differs
    big = tmp / layers.TREE / "d/big"
    size = big.stat().st_size
    os.truncate(big, 0)  # the same size, all of it a hole now: not one data extent
    os.truncate(big, size)
    sealed = store.seal(tmp)
    assert sealed.digest == layers.tree_digest(tmp / layers.TREE)[0]


def test_a_discarded_stage_leaves_no_descriptor_or_thread(store, tmp_path):
    src = _upper(tmp_path / "upper", 2 * streamhash.MIN_SIZE)
    fds = _open_fds()
    store.discard(store.stage(src))
    assert _open_fds() == fds and store._hashers == {}
    assert not any(t.name.startswith("corral-hash") for t in threading.enumerate())


def test_a_saturated_host_hashes_at_seal(store, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1000.0, 0.0, 0.0))
    store.stream_hash = None  # the default: only with a CPU to spare
    tmp = store.stage(_upper(tmp_path / "upper", 2 * streamhash.MIN_SIZE))
    assert store._hashers == {}
    assert store.seal(tmp).digest == layers.tree_digest(tmp / layers.TREE)[0]


def test_many_large_files_hold_a_bounded_number_of_descriptors(store, tmp_path, monkeypatch):
    monkeypatch.setattr(streamhash, "MAX_OPEN", 2)
    seen = []
    start, finish = streamhash.Hasher.start, streamhash.Hasher._finish

    def counting(self, fd, size):
        got = start(self, fd, size)
        seen.append(len(self._open))
        return got

    def slow(self, f):  # the hashing lags behind the copy, as it does on a busy host
        time.sleep(0.02)
        finish(self, f)

    monkeypatch.setattr(streamhash.Hasher, "start", counting)
    monkeypatch.setattr(streamhash.Hasher, "_finish", slow)
    src = tmp_path / "upper"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}").write_bytes(os.urandom(streamhash.MIN_SIZE))
    tmp = store.stage(src)
    assert max(seen) <= 2 and len(seen) == 8
    assert store.seal(tmp).digest == layers.tree_digest(tmp / layers.TREE)[0]
