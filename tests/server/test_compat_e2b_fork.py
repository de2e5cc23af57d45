"""E2B's ``fork(count)`` and ``create_snapshot`` with the real ``e2b`` client, on
corral's live checkpoints (issue 29): the forks run the parent's process on with its
memory, each one a sandbox or an error; a sandbox that is not checkpointable is
refused typed; a snapshot starts new sandboxes, is listed and is deleted by the SDK."""

from __future__ import annotations

import textwrap

import httpx
import pytest

from tests.server.test_compat_e2b import TOKEN, checked, run_script, serving

pytest.importorskip("e2b", reason="the compat extra (e2b) is not installed")

# a process with state only in its memory: a token drawn once, and a counter
PRELUDE = """
import time
COUNTER = '''import os, time
tok = os.urandom(8).hex()
i = 0
while True:
    i += 1
    open("/tmp/c.new", "w").write(f"{tok} {i}")
    os.replace("/tmp/c.new", "/tmp/c")
    time.sleep(0.05)
'''
def started(sb):
    sb.files.write("/tmp/counter.py", COUNTER)
    sb.commands.run("python3 /tmp/counter.py", background=True)
    for _ in range(400):
        seen = sb.commands.run("cat /tmp/c 2>/dev/null || true").stdout
        if seen:
            return seen.split()
        time.sleep(0.05)
def later(sb, n):
    for _ in range(400):
        tok, i = sb.commands.run("cat /tmp/c").stdout.split()
        if int(i) > n:
            return tok, int(i)
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def e2b_daemon():
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    with serving() as d:
        yield d


@pytest.fixture
def daemon_ok(e2b_daemon):
    with checked(e2b_daemon) as d:
        yield d


def test_fork_runs_the_process_on_in_each_copy_and_refuses_the_uncheckpointable(daemon_ok):
    out = run_script(daemon_ok, PRELUDE + textwrap.dedent("""
        sb = Sandbox.create(metadata={"corral.checkpointable": "true"}, timeout=120)
        tok, n = started(sb)
        forks = sb.fork(count=2, timeout=60)
        out["kinds"] = [type(f).__name__ for f in forks]
        out["ids"] = len({f.sandbox_id for f in forks} | {sb.sandbox_id})
        out["tokens"] = [later(f, int(n))[0] == tok for f in forks]
        out["index"] = sorted(f.commands.run("echo $CORRAL_FORK_INDEX").stdout for f in forks)
        info = Sandbox.get_info(forks[0].sandbox_id)
        out["life"] = round((info.end_at - info.started_at).total_seconds())
        out["parent"] = later(sb, int(n))[0] == tok
        out["meta"] = info.metadata.get("corral.checkpointable")
        for f in forks:
            f.kill()
        sb.kill()
        with Sandbox.create(timeout=60) as plain:
            try:
                plain.fork(count=1)
            except SandboxException as e:
                out["refused"] = str(e)
    """))
    assert out["kinds"] == ["Sandbox", "Sandbox"]
    assert out["ids"] == 3 and out["tokens"] == [True, True] and out["parent"]
    # The fork's own 60 s, not its parent's 120: counted from when the fork was ready,
    # which a loaded host reaches seconds after its start (65 s seen in a full run).
    assert out["index"] == ["0\n", "1\n"] and 55 <= out["life"] < 90
    assert out["meta"] == "true"
    assert out["refused"].startswith("409:") and "corral.checkpointable" in out["refused"]


def test_fork_count_is_bounded_before_anything_is_made(daemon_ok):
    with httpx.Client(base_url=daemon_ok.endpoint, headers={"X-API-KEY": TOKEN}) as c:
        made = c.post("/sandboxes", json={"metadata": {"corral.checkpointable": "true"}})
        sid = made.json()["sandboxID"]
        try:
            for bad in ({"count": 0}, {"count": 21}, {"count": "2"}, {"timeout": 0}):
                r = c.post(f"/sandboxes/{sid}/fork", json=bad)
                assert r.status_code == 400, (bad, r.text)
                assert set(r.json()) == {"code", "message"}
        finally:
            assert c.delete(f"/sandboxes/{sid}").status_code == 204


def test_snapshot_starts_sandboxes_with_the_process_and_is_deleted(daemon_ok):
    out = run_script(daemon_ok, PRELUDE + textwrap.dedent("""
        sb = Sandbox.create(metadata={"corral.checkpointable": "true"}, timeout=120)
        sb.files.write("/home/user/kept.txt", "from the parent")
        tok, n = started(sb)
        snap = sb.create_snapshot(name="e2b-fork-test")
        out["names"] = snap.names
        out["listed"] = [[s.snapshot_id == snap.snapshot_id for s in pages.next_items()]
                         for pages in (sb.list_snapshots(), Sandbox.list_snapshots(
                             name="e2b-fork-test"), Sandbox.list_snapshots(name="none"))]
        sb.kill()
        new = Sandbox.create(snap.snapshot_id, timeout=60)
        out["token"] = later(new, int(n))[0] == tok
        out["file"] = new.files.read("/home/user/kept.txt")
        new.kill()
        out["deleted"] = [Sandbox.delete_snapshot(snap.snapshot_id),
                          Sandbox.delete_snapshot(snap.snapshot_id)]
        with Sandbox.create(timeout=60) as plain:
            plain.files.write("/home/user/f", "files only")
            try:
                plain.create_snapshot()
            except SandboxException as e:
                out["full"] = str(e)[:4]
            files = plain.create_snapshot(mode="filesystem")
        with Sandbox.create(files.snapshot_id, timeout=60) as again:
            out["files"] = again.files.read("/home/user/f")
        out["gone"] = Sandbox.delete_snapshot(files.snapshot_id)
    """))
    assert out["names"] == ["e2b-fork-test"] and out["listed"] == [[True], [True], []]
    assert out["token"] and out["file"] == "from the parent"
    assert out["deleted"] == [True, False]
    assert out["full"] == "409:" and out["files"] == "files only" and out["gone"]
