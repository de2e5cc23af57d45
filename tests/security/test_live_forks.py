"""Attacks on live forks (issue 29; corral.runtime.live_processes, docs/live.md).

A live fork's copies run the parent's processes on, their interactive processes under
the parent's ids: each copy must still be a sandbox of its own. Code in one copy kills
everything it can, writes files and looks at /proc: the parent and the sibling go on
(their files, processes and adopted servers untouched), each on its own host uid and
cgroup. Another tenant can neither fork, checkpoint nor reach a copy's processes: each
answers as an unknown sandbox. The record of a checkpoint's processes is read as
hostile input: a forged one fails the restore typed and leaves nothing running."""

from __future__ import annotations

import json

import pytest

from corral.errors import InvalidState, SandboxNotFound
from corral.runtime import criu, live_processes
from corral.runtime.paths import default_cache_dir
from corral.schema import SandboxState
from tests.conftest import requires_root

ECHO = ["python3", "-u", "-c",
        "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)"]


def _need_criu() -> None:
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


async def _ask(engine, sandbox_id, process_id, word: str) -> bytes:
    proc = engine.get_process(sandbox_id, process_id)
    await proc.write(word.encode() + b"\n")
    return await proc.readline()


@requires_root
@pytest.mark.root
async def test_a_fork_reaches_neither_its_parent_nor_its_sibling(engine):
    _need_criu()
    parent = await engine.create(network="none", checkpointable=True)
    server = await engine.spawn(parent.id, ECHO)
    await engine.exec(parent.id, ["sh", "-c", "echo parent > /tmp/owner"])
    a, b = await engine.fork(parent.id, 2, live=True)
    try:
        lives = [engine._get_live(s.id) for s in (parent, a, b)]
        assert len({lv.uid for lv in lives}) == 3  # a host uid each
        assert len({lv.cgroup.path for lv in lives}) == 3
        # in a: write, then kill every process it can see (its copy of the server too)
        attack = ("echo a > /tmp/owner; echo x > /tmp/only-a;"
                  " for f in /proc/[0-9]*/comm; do read c < $f && echo $c; done;"
                  f" kill -9 {server.pid}; kill -9 -1; true")
        r = await engine.exec(a.id, ["sh", "-c", attack])
        assert sorted(r.stdout.split()) == [b"agent", b"python3", b"sh"], r  # its own only
        assert (await engine.get_process(a.id, server.id).wait(30)).returncode != 0
        # the parent and the sibling: their servers answer, their files are theirs
        assert await _ask(engine, parent.id, server.id, "p") == b"got p\n"
        assert await _ask(engine, b.id, server.id, "b") == b"got b\n"
        for sid in (parent.id, b.id):
            r = await engine.exec(sid, ["sh", "-c", "cat /tmp/owner; ls /tmp/only-a"])
            assert r.stdout.strip() == b"parent" and r.returncode != 0, r
        assert engine.get(parent.id).state == engine.get(b.id).state == SandboxState.RUNNING
        # a host pid of the parent's server is no pid in b's namespace
        host_pids = set(lives[0].cgroup.pids())
        assert not host_pids & set(lives[2].cgroup.pids())
    finally:
        for s in (a, b, parent):
            await engine.delete(s.id)


@requires_root
@pytest.mark.root
async def test_another_tenant_cannot_fork_or_reach_a_forks_processes(engine):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True, tenant="alice")
    alice, bob = {"owner": "alice"}, {"owner": "bob"}
    server = await engine.spawn(sb.id, ECHO, **alice)
    copies = []
    try:
        for live in (True, False):
            with pytest.raises(SandboxNotFound):
                await engine.fork(sb.id, 1, live=live, **bob)
        with pytest.raises(SandboxNotFound):
            await engine.checkpoint(sb.id, **bob)
        assert engine.list(**bob) == [] and engine.list_snapshots(**bob) == []
        copies = await engine.fork(sb.id, 1, live=True, **alice)
        with pytest.raises(SandboxNotFound):
            engine.get_process(copies[0].id, server.id, **bob)
        with pytest.raises(SandboxNotFound):
            await engine.exec(copies[0].id, ["true"], **bob)
        assert await _ask(engine, copies[0].id, server.id, "mine") == b"got mine\n"
    finally:
        for s in (*copies, sb):
            await engine.delete(s.id)


FORGED = [
    {"id": "../../etc", "rid": 1},
    {"rid": 0},
    {"rid": 2**32},
    {"argv": "sh -c id"},
    {"pid": -1},
    {"terminal": [0, 80]},
    {"max_buffer": 2**62},
    {"unread": [["stdin", ""]]},
    {"unread": [["stdout", "not base64!"]]},
    {"unread": [["stdout", "A" * (3 << 20)]]},
    {"stdin_open": 1},
]


def _record(**changes) -> dict:
    base = {"id": "proc-0123456789ab", "rid": 3, "argv": ["cat"], "pid": 2, "terminal": None,
            "max_buffer": 1 << 20, "stdin_open": True, "started_at": 1.0, "unread": []}
    return {**base, **changes}


@pytest.mark.parametrize("change", FORGED, ids=[next(iter(c)) + str(i) for i, c in enumerate(FORGED)])
def test_a_forged_process_record_is_refused(tmp_path, change):
    (tmp_path / live_processes.FILE).write_text(json.dumps([_record(**change)]))
    with pytest.raises(InvalidState, match="record of processes"):
        live_processes.read(tmp_path)


def test_records_that_are_not_a_list_or_repeat_a_request_are_refused(tmp_path):
    for body in ("{}", "[" * 100000, json.dumps([_record(), _record(id="proc-ba9876543210")]),
                 json.dumps([_record()] * (live_processes.MAX_PROCESSES + 1))):
        (tmp_path / live_processes.FILE).write_text(body)
        with pytest.raises(InvalidState):
            live_processes.read(tmp_path)
    (tmp_path / live_processes.FILE).unlink()
    (tmp_path / live_processes.FILE).symlink_to("/etc/passwd")
    with pytest.raises(InvalidState):
        live_processes.read(tmp_path)
    (tmp_path / live_processes.FILE).unlink()
    assert live_processes.read(tmp_path) == []  # an older checkpoint: none kept
    good = _record(unread=[["stdout", "aGk="]])
    (tmp_path / live_processes.FILE).write_text(json.dumps([good]))
    assert live_processes.read(tmp_path)[0]["unread"] == [("stdout", b"hi")]


@requires_root
@pytest.mark.root
async def test_a_restore_with_a_forged_process_record_fails_and_leaves_nothing(engine):
    _need_criu()
    sb = await engine.create(network="none", checkpointable=True)
    await engine.spawn(sb.id, ECHO)
    snap = await engine.checkpoint(sb.id)
    try:
        path = engine.checkpoint_images(snap.id) / live_processes.FILE
        path.write_text(json.dumps([_record(rid=2**40)]))
        running = {i.id for i in engine.list() if i.state == SandboxState.RUNNING}
        with pytest.raises(InvalidState, match="record of processes"):
            await engine.restore_checkpoint(snap.id)
        assert {i.id for i in engine.list() if i.state == SandboxState.RUNNING} == running
    finally:
        await engine.delete(sb.id)
        await engine.delete_snapshot(snap.id)
