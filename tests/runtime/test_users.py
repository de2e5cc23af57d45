"""Users in a sandbox: commands run as the sandbox user (1000) by default, as root of
the sandbox's user namespace when asked (or when the image's USER says so), and what
root writes is stored as root's in a snapshot (docs/users.md)."""

from __future__ import annotations

import os

import pytest

from corral.errors import InvalidArgument
from corral.runtime.uids import root_uid
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]


async def run(engine, sid: str, cmd: str, **kw) -> str:
    r = await engine.exec(sid, cmd, **kw)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


async def test_root_and_the_sandbox_user_in_one_sandbox(engine):
    sb = await engine.create(image="python")
    try:
        assert await run(engine, sb.id, "id -u; id -g; echo $HOME") == "1000\n1000\n/home/sandbox\n"
        assert await run(engine, sb.id, "id -u; id -G; echo $HOME", user="root") == "0\n0\n/root\n"
        # root owns the image's files: it may change them, and chown to the sandbox user
        await run(engine, sb.id, "echo hi > /etc/motd.d; mkdir -p /opt/app; "
                  "chown 1000:1000 /opt/app", user="root")
        await run(engine, sb.id, "touch /opt/app/mine")  # the sandbox user's directory now
        r = await engine.exec(sb.id, "touch /etc/not-mine")
        assert r.returncode != 0  # the sandbox user still cannot write root's files
        assert await run(engine, sb.id, "stat -c %u:%U /opt/app/mine /etc/motd.d") == \
            "1000:sandbox\n0:root\n"
        # on the host, root's processes and files are the sandbox's own root uid's
        live = engine._live[sb.id]
        pid = int(await run(engine, sb.id, "sleep 60 >/dev/null 2>&1 & echo $$", user="root"))
        del pid  # its pid inside; the host sees it in the sandbox's cgroup
        owners = {os.stat(f"/proc/{p}").st_uid for p in live.cgroup.pids()}
        assert owners == {live.uid, root_uid(live.uid)} and 0 not in owners
        motd = [f"/proc/{p}/root/etc/motd.d" for p in live.cgroup.pids()
                if os.stat(f"/proc/{p}").st_uid == root_uid(live.uid)]
        assert os.stat(motd[0]).st_uid == root_uid(live.uid)
        with pytest.raises(InvalidArgument, match="root .*or as the sandbox user"):
            await engine.exec(sb.id, "true", user="1234")
        with pytest.raises(InvalidArgument, match="not in the image"):
            await engine.exec(sb.id, "true", user="nosuchuser")
    finally:
        await engine.delete(sb.id)


async def test_what_root_writes_is_stored_as_root_in_a_snapshot(engine):
    sb = await engine.create(image="python")
    try:
        await run(engine, sb.id, "mkdir -p /srv/r && echo x > /srv/r/f && "
                  "cp /srv/r/f /srv/r/g && chown 1000 /srv/r/g", user="root")
        snap = await engine.snapshot(sb.id)
    finally:
        await engine.delete(sb.id)
    sb2 = await engine.create(image="python", snapshot=snap.id)
    try:
        assert await run(engine, sb2.id, "stat -c %u /srv/r/f /srv/r/g") == "0\n1000\n"
        assert (await engine.exec(sb2.id, "echo y > /srv/r/f")).returncode != 0
        await run(engine, sb2.id, "echo y > /srv/r/f", user="root")
    finally:
        await engine.delete(sb2.id)
