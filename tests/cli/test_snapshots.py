"""corral snapshot create/ls/rm and corral create --snapshot, on a real daemon."""

from __future__ import annotations

import secrets

import corral
from tests.conftest import requires_root

pytestmark = requires_root


def test_snapshot_create_ls_restore_rm(cli, sandbox, tag, client):
    name = "cli-" + secrets.token_hex(4)
    sandbox.files.write("hello.txt", b"from base")
    r = cli("snapshot", "create", sandbox.id, "--name", name)
    assert r.code == 0, r.err
    snap_id = r.out.strip()
    try:
        assert snap_id.startswith("snap-")
        listed = cli("snapshot", "ls", "--json").json()
        mine = [s for s in listed if s["id"] == snap_id]
        assert mine and mine[0]["name"] == name and mine[0]["source_sandbox"] == sandbox.id
        assert snap_id in cli("snapshot", "ls", "-q").out.split()
        table = cli("snapshot", "ls")
        assert table.code == 0 and name in table.out

        made = cli("create", "--snapshot", name, "--tag", tag, "-n", "2", "--json").json()
        assert len(made) == 2
        for d in made:
            assert d["spec"]["snapshot"] == snap_id and d["spec"]["memory_mb"] == 64
            sb = corral.Sandbox.connect(d["id"], client=client)
            assert sb.files.read("hello.txt") == b"from base"

        r = cli("snapshot", "rm", name, "no-such-snap")
        assert r.code == 1 and r.out.split() == [name] and "no-such-snap" in r.err
        assert snap_id not in cli("snapshot", "ls", "-q").out.split()
        r = cli("create", "--snapshot", name, "--tag", tag)
        assert r.code == 1 and "snapshot" in r.err
        assert cli("rm", *(d["id"] for d in made)).code == 0
    finally:
        client.request("DELETE", f"/v1/snapshots/{snap_id}")  # idempotent
