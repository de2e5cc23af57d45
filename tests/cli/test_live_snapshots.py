"""Live checkpoints end to end (docs/live.md): the CLI and the SDK on a real daemon.

``corral create --checkpointable``, ``corral snapshot create --live`` (a snapshot of kind
``live``), ``Sandbox.create(snapshot=...)`` and ``sb.fork(n)`` give running copies that
count on from the saved value, ``corral snapshot rm`` removes the process images, and a
sandbox that is not checkpointable is refused with a typed cause."""

from __future__ import annotations

import time

import pytest

import corral
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir

COUNTER = (
    "nohup python3 -c 'import time\ni = 0\nwhile True:\n    i += 1\n"
    "    open(\"/tmp/count\", \"w\").write(str(i))\n    time.sleep(0.05)' >/dev/null 2>&1 &"
)


@pytest.fixture(autouse=True)
def criu_cached():
    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


def count(sb: corral.Sandbox) -> int:
    for _ in range(200):
        out = sb.exec("cat /tmp/count").stdout.strip()
        if out:
            return int(out)
        time.sleep(0.05)
    raise AssertionError("the counter never wrote")


def test_checkpoint_restore_fork_and_rm(cli, client, tag):
    made = cli("create", "--checkpointable", "--tag", tag)
    assert made.code == 0, made.err
    sb = corral.Sandbox.connect(made.out.strip(), client=client)
    copies: list[corral.Sandbox] = []
    try:
        assert sb.info.spec.checkpointable
        sb.exec(COUNTER)
        saved = count(sb)
        snap = cli("snapshot", "create", sb.id, "--live", "--json").json()
        assert snap["kind"] == "live"
        kinds = {s["id"]: s["kind"] for s in cli("snapshot", "ls", "--json").json()}
        assert kinds[snap["id"]] == "live"
        copies.append(corral.Sandbox.create(snapshot=snap["id"], tags=[tag], client=client))
        copies += sb.fork(2)  # live: it is checkpointable
        for copy in copies:
            first = count(copy)
            assert first >= saved
        for counter in (*copies, sb):  # each went on counting (the original too)
            deadline = time.monotonic() + 60
            while count(counter) <= saved:
                assert time.monotonic() < deadline, f"{counter.id} stopped counting"
                time.sleep(0.1)
        for i, copy in enumerate(copies[1:]):  # each fork knows which it is
            r = copy.exec("echo $CORRAL_FORK_INDEX; cat /tmp/.corral-fork-index")
            assert r.stdout.split() == [str(i), str(i)], r.stdout
        assert cli("snapshot", "rm", snap["id"]).code == 0
        assert snap["id"] not in {s["id"] for s in cli("snapshot", "ls", "--json").json()}
        # hibernate (CLI), then the next command wakes it (HTTP, service layer), same id
        before = count(copies[0])
        assert cli("hibernate", copies[0].id).code == 0
        assert corral.Sandbox.connect(copies[0].id, client=client).info.state == "paused"
        assert count(copies[0]) >= before
        assert copies[0].refresh().state == "running"
    finally:
        for s in [*copies, sb]:
            s.delete()


def test_a_sandbox_not_made_checkpointable_is_refused_with_its_cause(client, tag):
    with corral.Sandbox.create(tags=[tag], client=client) as sb:
        with pytest.raises(corral.InvalidState) as err:
            sb.checkpoint()
        assert err.value.details["cause"] == "not_checkpointable"
        assert sb.exec("echo alive").stdout.strip() == "alive"
