"""The SDK's snapshots: Sandbox.snapshot, Snapshot.restore/get/list/delete, fork."""

from __future__ import annotations

import secrets

import pytest

import corral
from tests.conftest import requires_root

pytestmark = requires_root


def test_snapshot_restore_fork_and_delete(client):
    name = "sdk-" + secrets.token_hex(4)
    with corral.Sandbox.create(memory_mb=64, client=client) as base:
        base.files.write("data.txt", b"shared")
        snap = base.snapshot(name=name)
        try:
            assert isinstance(snap, corral.Snapshot)
            assert snap.name == name and snap.image == "python" and snap.layers
            assert snap.size_bytes >= len(b"shared") and snap.created_at > 0
            assert isinstance(snap.info, corral.SnapshotInfo)

            copies = [snap.restore(tags=[f"copy={i}"]) for i in range(3)]
            copies.append(corral.Sandbox.create(snapshot=snap, client=client))
            copies.append(corral.Sandbox.create(snapshot=name, client=client))
            try:
                for i, sb in enumerate(copies):
                    assert sb.files.read("data.txt") == b"shared"
                    sb.files.write(f"mine-{i}.txt", b"x")
                    assert sb.info.spec.memory_mb == 64
                for i, sb in enumerate(copies):
                    assert sorted(e.name for e in sb.files.list(".")) == [
                        "data.txt", f"mine-{i}.txt",
                    ]
                assert copies[1].tags == ["copy=1"]
                assert not base.files.exists("mine-0.txt")

                forks = base.fork(3)
                copies += forks
                assert len(forks) == 3 and all(isinstance(f, corral.Sandbox) for f in forks)
                assert all(f.files.read("data.txt") == b"shared" for f in forks)

                assert corral.Snapshot.get(name, client=client).id == snap.id
                assert snap.id in [s.id for s in corral.Snapshot.list(client=client)]

                snap.delete()  # in use: the copies keep working
                with pytest.raises(corral.SnapshotNotFound):
                    corral.Snapshot.get(snap.id, client=client)
                assert copies[0].exec("cat data.txt").stdout == "shared"
                snap.delete()  # idempotent
            finally:
                for sb in copies:
                    sb.delete()
        finally:
            snap.delete()


def test_unknown_snapshot_raises_a_lookup_error(client):
    with pytest.raises(corral.SnapshotNotFound) as caught:
        corral.Snapshot.get("no-such-snapshot", client=client)
    assert isinstance(caught.value, LookupError)
    with pytest.raises(LookupError):
        corral.Sandbox.create(snapshot="no-such-snapshot", client=client)


async def test_async_snapshot(aclient):
    async with await corral.AsyncSandbox.create(memory_mb=64, client=aclient) as base:
        await base.files.write("a.txt", b"async")
        snap = await base.snapshot()
        try:
            assert isinstance(snap, corral.AsyncSnapshot) and snap.name is None
            async with await snap.restore() as copy:
                assert await copy.files.read("a.txt") == b"async"
            got = await corral.AsyncSnapshot.get(snap.id, client=aclient)
            assert got.layers == snap.layers
            assert snap.id in [s.id for s in await corral.AsyncSnapshot.list(client=aclient)]
        finally:
            await snap.delete()
        with pytest.raises(corral.SnapshotNotFound):
            await corral.AsyncSnapshot.get(snap.id, client=aclient)
