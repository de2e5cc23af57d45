"""Engines on one host never touch each other (issue 25, item 15).

Three daemons side by side, as a host with a local Ray cluster has them: ``A`` like the
default daemon, ``B`` with its state directory *inside* A's (a cluster node's, under
``/var/lib/corral/cluster/<node>/state``), ``C`` apart. A restarts (its start-up
hardening of its state directory ran over B's and made it 0700: every sandbox B then
created failed), then A is killed with ``-9`` holding a running and a paused sandbox
(its warden kills and removes everything of A), then A starts again (its reconcile and
sweep). Through all of it B and C keep every process (sandboxes, agents, warm slots,
wardens: same pids, same start times), cgroup, mode and sandbox they had, and go on
creating and running sandboxes. Real daemons, real sandboxes.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

import corral
from tests.conftest import requires_root
from tests.faults.host import Host, alive

pytestmark = [requires_root, pytest.mark.root]

PATIENCE_S = 120.0  # a bound on waiting for A's warden, never a measure


def registry_cgroups(host: Host) -> list[str]:
    """The cgroup paths of the daemon's sandboxes, from its registry."""
    import sqlite3

    with sqlite3.connect(f"file:{host.layout.registry_path}?mode=ro", uri=True) as db:
        return [row[0] for row in db.execute("SELECT cgroup FROM sandboxes")]


def modes(host: Host) -> dict[str, int]:
    """The modes of the directories a sandbox's uid must pass through, and B's base."""
    paths = [host.base, host.state, host.layout.sandboxes_dir,
             *[host.layout.sandboxes_dir / d for d in host.sandbox_dirs()]]
    return {str(p): stat.S_IMODE(os.stat(p).st_mode) for p in paths}


def kept_processes(host: Host) -> dict[int, int]:
    """The daemon's processes but its warm slots (a create takes one and it is gone):
    its warden, and every process of its sandboxes."""
    out = {}
    for pid, start in host.tree().items():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--ready" not in argv:
            out[pid] = start
    return out


def works(host: Host, sandboxes: list[corral.Sandbox]) -> None:
    """Its sandboxes answer, and a new one starts, runs and goes."""
    client = corral.Client(f"unix://{host.socket}")
    for sb in sandboxes:
        assert sb.exec(["echo", sb.id], timeout=60).stdout == sb.id + "\n"
    fresh = corral.Sandbox.create(client=client)
    try:
        assert fresh.exec("echo fresh", timeout=60).stdout == "fresh\n"
    finally:
        fresh.delete()


def test_three_engines_one_restarted_and_killed_never_touch_each_other():
    # --restore-grace 0: a daemon killed -9 hands nothing over, its warden ends it all
    # (live restore would keep A's sandboxes for the next daemon: docs/restart.md)
    a = Host.make("--restore-grace", "0")
    hosts = [a]
    try:
        a.start()
        b = Host.make(base=a.state / "cluster" / "node-b")
        hosts.append(b)
        c = Host.make()
        hosts.append(c)
        b.start()
        c.start()
        mine = {h.base: [corral.Sandbox.create(client=corral.Client(f"unix://{h.socket}"))
                         for _ in range(2)] for h in (a, b, c)}
        mine[a.base][1].pause()
        neighbours = (b, c)
        before = {h.base: (kept_processes(h), h.cgroup_children(), modes(h), h.sandbox_dirs())
                  for h in neighbours}

        def untouched(when: str) -> None:
            for h in neighbours:
                tree, children, was_modes, dirs = before[h.base]
                gone = {pid: t for pid, t in tree.items() if not alive(pid, t)}
                assert not gone, (when, h.base, gone)
                assert len(tree) >= 2 * 2 + 1, tree  # two agents and bwraps, a warden
                assert set(children) - set(h.cgroup_children()) <= slot_groups[h.base], when
                assert modes(h) == was_modes, (when, h.base)
                assert set(dirs) <= set(h.sandbox_dirs()), (when, h.base)
                works(h, mine[h.base])

        # warm slots' cgroups go when a create takes them; every sandbox's stays
        slot_groups = {h.base: set(h.cgroup_children()) - {
            Path(p).name for p in registry_cgroups(h)} for h in neighbours}
        untouched("at the start")
        a.stop()  # clean stop: its own sandboxes go
        a.start()  # start-up hardening of a state directory that holds B's
        untouched("after A restarted")
        mine[a.base] = [corral.Sandbox.create(client=corral.Client(f"unix://{a.socket}"))
                        for _ in range(2)]
        mine[a.base][1].pause()
        a.kill9()  # its warden kills and removes everything of A, frozen included
        deadline = time.monotonic() + PATIENCE_S
        while (a.cgroup_exists() or a.in_cgroups()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not a.in_cgroups() and not a.cgroup_exists()
        untouched("after A was killed -9")
        a.start()  # reconcile and sweep of A's dead sandboxes
        assert a.sandbox_dirs() == []
        untouched("after A started again")
        works(a, [])
    finally:
        for h in reversed(hosts):  # B lies inside A's base
            h.stop()
            h.remove()
