"""A live snapshot's process images crossing between nodes (runtime/live_travel.py).

They hold a sandbox's memory, secrets included, and CRIU restores them as root: so
another tenant (or a tenant at all: the route is the peers') cannot read them through
the peer route, by a forged name, owner or digest; a node refuses, typed and naming
both sides, images dumped on another kernel or CRIU build; and a peer's images that do
not hash to their digest, or hold anything but plain files, are refused with nothing
left on disk."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from corral.errors import InvalidArgument, LayerTransferError, Unsupported
from corral.runtime import layer_wire, live_travel
from corral.runtime.layer_fetch import LayerFetcher
from corral.runtime.layers import LayerStore
from tests.conftest import requires_root
from tests.security.tenants_helpers import ADMIN_TOKEN, team_daemon
from tests.security.test_live_checkpoint import _need_criu

SID = "snap-0123456789ab"


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


@requires_root
def test_another_tenant_cannot_pull_a_live_snapshots_images(team):
    _need_criu()
    alice, bob, admin = team.tenant("alice"), team.tenant("bob"), team.tcp(ADMIN_TOKEN)
    with alice, bob, admin:
        r = alice.post("/v1/sandboxes", json={"memory_mb": 128, "network": "none",
                                               "checkpointable": True})
        assert r.status_code == 201, r.text
        sb = r.json()["id"]
        r = alice.post(f"/v1/sandboxes/{sb}/checkpoint", json={"name": "secret-live"},
                       timeout=300)
        assert r.status_code in (200, 201), r.text
        sid = r.json()["id"]
        route = f"/v1/peer/checkpoints/{sid}"
        # tenants never read raw images, their own included, whatever owner they name
        for who, query in ((bob, ""), (bob, "?owner=alice"), (alice, "?owner=alice")):
            assert who.get(route + query).status_code == 403
        # the peer credential asking as another tenant: as if there were none
        unknown = admin.get(f"/v1/peer/checkpoints/{SID}?owner=bob")
        forged = admin.get(route + "?owner=bob")
        assert forged.status_code == unknown.status_code == 404
        assert forged.json()["error"]["code"] == "snapshot_not_found"
        assert forged.text.replace(sid, "ID") == unknown.text.replace(SID, "ID")
        # a forged name: the images are found by snapshot id only, never by a path
        for bad in ("secret-live", "..%2F..%2Fetc", f"{sid}%2F..%2F..", "snap-../../x"):
            assert admin.get(f"/v1/peer/checkpoints/{bad}?owner=alice").status_code in (400, 404)
        # a forged digest: the images' digest is no layer's, so the layer route has none
        desc = admin.get(f"/v1/peer/snapshots/{sid}?owner=alice").json()
        assert desc["kind"] == "live" and desc["live"]["kernel"] == os.uname().release
        assert admin.get(f"/v1/peer/layers/{desc['live']['digest']}").status_code == 404
        # the owner's own, asked for as it: served (so the refusals above mean something)
        ok = admin.get(route + "?owner=alice")
        assert ok.status_code == 200 and len(ok.content) > 100_000
        assert alice.delete(f"/v1/snapshots/{sid}").status_code == 204
        assert admin.get(route + "?owner=alice").status_code == 404


def _never(*_args):
    raise AssertionError("something was fetched")


def _live_desc(**live) -> dict:
    return {"id": SID, "kind": "live", "image": "python", "image_digest": "x",
            "spec": {}, "layers": [{"digest": "sha256:" + "1" * 64, "size_bytes": 1}],
            "live": {"digest": "sha256:" + "2" * 64, "size_bytes": 1 << 20, **live}}


@pytest.mark.parametrize("side", ["kernel", "criu"])
async def test_a_mismatched_kernel_or_criu_is_refused_typed_naming_both_sides(engine, side):
    ours = live_travel.host_build(engine.layout.cache_dir)
    theirs = {**ours, side: "9.9.9-elsewhere"}
    fetcher = LayerFetcher(engine.snapshots)
    with pytest.raises(Unsupported) as err:
        await fetcher.import_snapshot(_live_desc(**theirs), _never, holder="node-a",
                                      open_images=_never)
    e = err.value
    assert e.details["cause"] == "live_mismatch" and e.details["node"] == "node-a"
    assert e.details["theirs"][side] == "9.9.9-elsewhere" and e.details["ours"] == ours
    assert "9.9.9-elsewhere" in e.message and ours[side] in e.message
    assert engine.snapshots.registry.snapshot(SID) is None
    assert not (engine.layout.state_dir / "checkpoints" / "_admin" / SID).exists()


async def test_a_live_description_without_its_images_or_a_fetcher_is_refused(engine):
    ours = live_travel.host_build(engine.layout.cache_dir)
    fetcher = LayerFetcher(engine.snapshots)
    desc = _live_desc(**ours)
    with pytest.raises(Unsupported) as err:  # no way to fetch its images: as before
        await fetcher.import_snapshot(desc, _never, holder="node-a")
    assert err.value.details["cause"] == "live_elsewhere"
    for forged in (None, "x", {"digest": "../../etc/passwd", "size_bytes": 1, **ours},
                   {"digest": "sha256:" + "2" * 64, "size_bytes": -1, **ours}):
        with pytest.raises(InvalidArgument):
            await fetcher.import_snapshot({**desc, "live": forged}, _never, open_images=_never)
    assert engine.snapshots.registry.snapshot(SID) is None


def _images(root, extra=None):
    root.mkdir(mode=0o700)
    (root / "pages-1.img").write_bytes(os.urandom(4096) * 16)
    (root / "corral.json").write_text('{"ctl": 1, "reattach": 2}')
    if extra:
        extra(root)
    return root


def _opener(tree):
    @contextmanager
    def open_images(digest, size):
        yield layer_wire.stream(tree, root_form=True)
    return open_images


def _left(state):
    return sorted(os.listdir(state / "checkpoints" / "_admin")) + sorted(
        os.listdir(state / "layers"))


@requires_root
def test_hostile_images_from_a_peer_are_refused_and_nothing_is_left(tmp_path):
    state = tmp_path / "state"
    store = LayerStore(state / "layers")
    store.open([])
    good = _images(tmp_path / "good")
    other = _images(tmp_path / "other")
    live = live_travel.describe(good, tmp_path)
    with pytest.raises(LayerTransferError, match="hash to"):  # other bytes, the good digest
        live_travel.receive(store, state, None, SID, live, _opener(other))
    assert _left(state) == []
    for name, make in (
        ("link", lambda r: os.symlink("/etc/shadow", r / "link")),
        ("sub", lambda r: (r / "sub").mkdir()),
        ("fifo", lambda r: os.mkfifo(r / "fifo")),
        ("hard", lambda r: os.link(r / "pages-1.img", r / "hard")),
    ):
        bad = _images(tmp_path / f"bad-{name}", make)  # described honestly, still refused
        with pytest.raises(LayerTransferError, match="plain files only"):
            live_travel.receive(store, state, None, SID, live_travel.describe(bad, tmp_path),
                                _opener(bad))
        assert _left(state) == []
    got = live_travel.receive(store, state, None, SID, live, _opener(good))  # the control
    assert got == state / "checkpoints" / "_admin" / SID
    assert got.stat().st_mode & 0o777 == 0o700 and got.stat().st_uid == 0
    assert {f.name: f.stat().st_mode & 0o777 for f in got.iterdir()} == {
        "pages-1.img": 0o600, "corral.json": 0o600}
    assert (got / "pages-1.img").read_bytes() == (good / "pages-1.img").read_bytes()
