"""Volumes (runtime/volumes.py): one copy on disk mounted into many sandboxes; ``cow``
writes stay private, ``ro`` refuses them, ``rw`` shares them (a tenant's only with a
``max_mb``: uncapped writes would fill the host's disk); a tenant's volumes are
its own; names, host paths and mount points an attacker picks are refused typed."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

import pytest

import corral
from corral.cli.main import main
from corral.errors import (
    Forbidden,
    InvalidArgument,
    InvalidState,
    QuotaExceeded,
    SandboxStartError,
    VolumeNotFound,
)
from tests.security.tenants_helpers import no_traceback, team_daemon

N_COW = 20  # sandboxes sharing one cow volume


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        t.make_token("carol", max_snapshot_mb=1)
        t.make_token("dave")  # no quota: N_COW sandboxes at once
        yield t


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.csv").write_text("1,2,3\n")
    (tmp_path / "README").write_text("the dataset\n")
    return tmp_path


def test_cow_volume_shared_by_many_sandboxes_stays_unchanged(team, dataset):
    with corral.Client(team.url, token=team.tokens["dave"]) as alice:
        vol = corral.Volume.create("ds", dataset, client=alice)
        assert vol.info.files == 3
        boxes = [corral.Sandbox.create(memory_mb=64, volumes={"/data": "ds"}, client=alice)
                 for _ in range(N_COW)]
        try:
            for i, sb in enumerate(boxes):
                r = sb.exec(f"echo {i} > /data/mine-{i} && echo x >> /data/rows/a.csv && "
                            "ls /data | sort | tr '\\n' ' '", timeout=60)
                assert r.returncode == 0, r.stderr
                assert r.stdout.split() == sorted(["README", "rows", f"mine-{i}"])
            assert boxes[0].files.read("/data/rows/a.csv") == b"1,2,3\nx\n"
            ro = corral.Sandbox.create(memory_mb=64, volumes={"/data": "ds:ro"}, client=alice)
            assert ro.exec("echo > /data/x", timeout=30).returncode != 0
            assert ro.files.read("/data/rows/a.csv") == b"1,2,3\n"  # nobody's writes
            assert ro.exec("ls /data", timeout=30).stdout.split() == ["README", "rows"]
            with pytest.raises(InvalidState):
                vol.delete()  # mounted
            ro.delete()
        finally:
            for sb in boxes:
                sb.delete()
        # rw of a volume with no size: its writes would land on the host's disk,
        # capped by nothing (a tenant's sandbox filled it); rw needs max_mb
        with pytest.raises(Forbidden, match="max_mb"):
            corral.Sandbox.create(memory_mb=64, volumes={"/d": "ds:rw"}, client=alice)
        vol.delete()
        assert corral.Volume.list(client=alice) == []
    team.cleanup()
    no_traceback(team)


def test_volumes_are_their_tenants_own(team, dataset):
    with corral.Client(team.url, token=team.tokens["alice"]) as alice, \
            corral.Client(team.url, token=team.tokens["bob"]) as bob:
        corral.Volume.create("private", dataset, client=alice)
        with pytest.raises(VolumeNotFound):
            corral.Sandbox.create(memory_mb=64, volumes={"/data": "private"}, client=bob)
        with pytest.raises(VolumeNotFound):
            corral.Volume.get("private", client=bob)
        assert corral.Volume.list(client=bob) == []
        with pytest.raises(Forbidden):  # host directories: the admin's only
            corral.Sandbox.create(memory_mb=64, volumes={"/data": "/etc:ro"}, client=bob)
        for bad in ("../x", "a/b", "..", "A", ""):
            with pytest.raises(InvalidArgument):
                corral.Volume.create(bad, dataset, client=bob)
            with pytest.raises(InvalidArgument):
                corral.Sandbox.create(volumes={"/data": bad}, client=bob)
        for dest in ("/proc/x", "data", "/", "/a/../etc", "/etc/cron.d"):
            with pytest.raises(InvalidArgument):
                corral.Sandbox.create(volumes={dest: "private"}, client=alice)
        corral.Volume.get("private", client=alice).delete()
    with corral.Client(team.url, token=team.tokens["carol"]) as carol:
        big = dataset / "big"
        big.write_bytes(os.urandom(2 << 20))  # over carol's 1 MB
        with pytest.raises(QuotaExceeded):
            corral.Volume.create("big", dataset, client=carol)
        assert corral.Volume.list(client=carol) == []  # nothing half-made
    team.cleanup()
    no_traceback(team)


def test_archive_escapes_and_symlinked_mount_points(team, dataset):
    outside = Path(tempfile.mkdtemp(prefix="corral-test-outside-"))
    target = outside / "made-by-the-launcher"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    evil = dataset / "evil.tar"
    evil.write_bytes(buf.getvalue())
    try:
        with corral.Client(team.url, token=team.tokens["alice"]) as alice:
            with pytest.raises(InvalidArgument):
                corral.Volume.create("evil", evil, client=alice)
            evil.unlink()
            corral.Volume.create("ds2", dataset, client=alice)
            # a snapshot with a symlink where a volume will be mounted
            sb = corral.Sandbox.create(memory_mb=64, client=alice)
            sb.exec(f"ln -s {target} /workspace/link", timeout=30)
            snap = sb.snapshot()
            with pytest.raises(SandboxStartError):
                corral.Sandbox.create(memory_mb=64, snapshot=snap.id,
                                      volumes={"/workspace/link/sub": "ds2"}, client=alice)
            assert not target.exists()  # nothing made through the link on the host
            sb.delete()
    finally:
        for p in sorted(outside.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        outside.rmdir()
    team.cleanup()
    no_traceback(team)


def test_cli_volume_create_ls_rm(team, dataset, capsys):
    tenant = ("--url", team.url, "--token", team.tokens["bob"])
    assert main([*tenant, "volume", "create", "clivol", "--from", str(dataset)]) == 0
    assert "3 files" in capsys.readouterr().out
    assert main([*tenant, "volume", "ls"]) == 0
    assert capsys.readouterr().out.startswith("clivol\t3\t")
    assert main([*tenant, "create", "--memory-mb", "64", "--volume", "/data=clivol:ro"]) == 0
    sid = capsys.readouterr().out.strip().split()[-1]
    assert main([*tenant, "exec", sid, "cat", "/data/README"]) == 0
    assert capsys.readouterr().out == "the dataset\n"
    assert main([*tenant, "rm", sid]) == 0
    capsys.readouterr()
    assert main([*tenant, "volume", "upload", "clivol", str(dataset / "README"),
                 "docs/README.md"]) == 0  # a resumable upload (server/volume_uploads.py)
    assert capsys.readouterr().out == "clivol:docs/README.md\n"
    assert main([*tenant, "create", "--memory-mb", "64", "--volume", "/data=clivol:ro"]) == 0
    sid = capsys.readouterr().out.strip().split()[-1]
    assert main([*tenant, "exec", sid, "cat", "/data/docs/README.md"]) == 0
    assert capsys.readouterr().out == "the dataset\n"
    assert main([*tenant, "rm", sid]) == 0
    assert main([*tenant, "volume", "snapshot", "clivol", "clivol-1"]) == 0
    assert "clivol-1: 5 files, " in capsys.readouterr().out  # README, rows/a.csv, docs/...
    assert main([*tenant, "volume", "rm", "clivol", "clivol-1"]) == 0
    capsys.readouterr()
    team.cleanup()


def test_rw_volume_writes_are_capped_and_snapshots_say_what_they_hold(team, dataset, tmp_path):
    """Quota escape: a big file, a file per inode, a second writer: an rw volume made
    with max_mb never holds more (ENOSPC inside, VolumeFull from the file API).
    Snapshots reference cow/ro volumes (mounted again, private writes not carried) and
    refuse rw ones."""
    from corral.errors import VolumeFull

    with corral.Client(team.url, token=team.tokens["dave"]) as c:
        vol = corral.Volume.create("capped", dataset, max_mb=8, client=c)
        assert vol.info.max_mb == 8
        a, b = (corral.Sandbox.create(memory_mb=64, volumes={"/d": "capped:rw"}, client=c)
                for _ in range(2))
        try:
            a.exec("echo shared > /d/out", timeout=30)
            assert b.files.read("/d/out") == b"shared\n"  # one volume, both writers
            r = a.exec("dd if=/dev/zero of=/d/fill bs=1M count=32", timeout=60)
            assert r.returncode != 0 and "No space left" in r.stderr
            with pytest.raises(VolumeFull) as exc:
                b.files.write("/d/more", b"x" * (1 << 20))
            assert exc.value.details["volume"] == "capped"
            a.exec("rm /d/fill", timeout=30)
            many = "import os\nfor i in range(100000): open(f'/d/n{i}', 'w').close()"
            r = a.exec(["python3", "-c", many], timeout=120)
            assert r.returncode != 0 and "No space left" in r.stderr  # inodes are capped too
            assert b.files.read("/d/README") == b"the dataset\n"
            with pytest.raises(InvalidState):
                a.snapshot()  # rw: shared live state
        finally:
            a.delete()
            b.delete()
        big = tmp_path / "big"
        big.mkdir()
        (big / "blob").write_bytes(os.urandom(9 << 20))
        with pytest.raises(VolumeFull):
            corral.Volume.create("toobig", big, max_mb=8, client=c)
        with pytest.raises(InvalidArgument):
            corral.Volume.create("tiny", dataset, max_mb=1, client=c)
        assert [v.name for v in corral.Volume.list(client=c)] == ["capped"]
        vol.delete()

        corral.Volume.create("ref", dataset, client=c)
        src = corral.Sandbox.create(memory_mb=64, volumes={"/d": "ref"}, client=c)
        src.exec("echo private > /d/mine && echo kept > /workspace/kept", timeout=30)
        snap = src.snapshot()
        src.delete()
        copy = corral.Sandbox.create(snapshot=snap.id, memory_mb=64, client=c)
        try:
            assert copy.files.read("/d/README") == b"the dataset\n"  # mounted again
            assert not copy.files.exists("/d/mine")  # cow writes are not in a snapshot
            assert copy.files.read("/workspace/kept") == b"kept\n"
        finally:
            copy.delete()
        snap.delete()
        corral.Volume.get("ref", client=c).delete()
    team.cleanup()
    no_traceback(team)


def test_a_volume_snapshot_is_a_frozen_copy_taken_only_between_writers(team, dataset):
    """``vol.snapshot(NEW)``: a new volume of the files as they are (an rw scratch
    volume frozen between episodes), with the same cap; refused while a writer runs;
    its writes after do not reach the snapshot; another tenant's volume is unknown."""
    with corral.Client(team.url, token=team.tokens["dave"]) as c:
        vol = corral.Volume.create("scratch", dataset, max_mb=16, client=c)
        w = corral.Sandbox.create(memory_mb=64, volumes={"/d": "scratch:rw"}, client=c)
        w.exec("echo step1 > /d/state && truncate -s 8M /d/sparse", timeout=30)
        with pytest.raises(InvalidState, match="rw"):
            vol.snapshot("scratch-1")  # its files are changing
        w.delete()
        snap = vol.snapshot("scratch-1")
        assert (snap.name, snap.info.max_mb) == ("scratch-1", 16)
        w = corral.Sandbox.create(memory_mb=64, volumes={"/d": "scratch:rw"}, client=c)
        w.exec("echo step2 > /d/state", timeout=30)
        w.delete()
        r = corral.Sandbox.create(memory_mb=64, volumes={"/s": "scratch-1:ro"}, client=c)
        out = r.exec("cat /s/state /s/rows/a.csv; du -k /s/sparse", timeout=30).stdout
        assert out.splitlines()[:2] == ["step1", "1,2,3"]
        assert int(out.splitlines()[2].split()[0]) < 1024  # still sparse
        r.delete()
        with pytest.raises(InvalidState):  # the name is taken
            vol.snapshot("scratch-1")
        with pytest.raises(InvalidArgument):
            vol.snapshot("../alice/x")
        with corral.Client(team.url, token=team.tokens["bob"]) as bob, \
                pytest.raises(VolumeNotFound):
            bob.request("POST", "/v1/volumes/scratch/snapshot", json={"name": "mine"})
        snap.delete()
        vol.delete()
    team.cleanup()
