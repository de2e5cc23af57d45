"""kill -9 of a busy daemon with live restore on (docs/restart.md): what ran is adopted,
what was half made is cleaned up, and nothing leaks.

A real daemon with ``--restore-grace`` runs sandboxes that each hold a file and answer a
loop of execs, while another thread creates and deletes sandboxes; at a random moment
it is killed with ``kill -9`` and a new daemon started on the same state directory.
Then every sandbox that was running still runs and answers with its file; every other
one the registry listed alive (a create cut in the middle) is ``failed`` with a
``lost:`` reason; and after a final SIGINT no process, cgroup, mount or warden of the
state directory is left. Waits are bounded polls.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

import corral
from tests.conftest import requires_root
from tests.faults.host import Host

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(900)]

SANDBOXES = 6
LIVE = {"pending", "running", "paused", "stopping"}


def _churn(url: str, stop: threading.Event, ids: list[str]) -> None:
    """Execs on the given sandboxes, and creates and deletes of others, until ``stop``
    (errors once the daemon is gone are expected: the loop just ends)."""
    try:
        with corral.Client(url) as c:
            c.reconnect_wait = 0  # this load must not outlive the kill
            while not stop.is_set():
                for sid in ids:
                    corral.Sandbox.connect(sid, client=c).exec("echo x")
                corral.Sandbox.create(client=c, memory_mb=64).delete()
    except corral.CorralError:
        pass


def _wait(check, what: str, limit: float = 120.0):  # noqa: ANN001, ANN202 - a test helper
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {limit:g} s: {what}")


def _wardens(h: Host) -> list[int]:
    """Wardens still holding this state directory's lock (by their command line)."""
    found = []
    marker = str(h.state.absolute()).encode()
    for pid in (int(n) for n in os.listdir("/proc") if n.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if b"warden.py" in argv and marker in argv:
            found.append(pid)
    return found


def test_kill9_under_load_adopts_what_ran_and_leaks_nothing() -> None:
    h = Host.make("--restore-grace", "120", "--shutdown-grace", "0.5")
    url = f"unix://{h.socket}"
    try:
        h.start()
        with corral.Client(url) as c:
            ids = []
            for i in range(SANDBOXES):
                sb = corral.Sandbox.create(client=c, memory_mb=64, timeout=900)
                sb.files.write("/home/sandbox/mine.txt", f"sandbox {i}".encode())
                ids.append(sb.id)
        stop = threading.Event()
        workers = [threading.Thread(target=_churn, args=(url, stop, ids[k::2]))
                   for k in range(2)]
        for w in workers:
            w.start()
        time.sleep(random.uniform(0.5, 2.0))
        h.kill9()
        stop.set()
        for w in workers:
            w.join(60)
        h.start()
        with corral.Client(url) as c:
            listed = {sb.id: sb.info for sb in corral.Sandbox.list(client=c)}
            for i, sid in enumerate(ids):  # what ran, runs: the same files, answering
                assert listed[sid].state == corral.SandboxState.RUNNING, listed[sid]
                sb = corral.Sandbox.connect(sid, client=c)
                assert sb.files.read("/home/sandbox/mine.txt") == f"sandbox {i}".encode()
                assert sb.exec("echo ok").stdout == "ok\n"
            for sid, info in listed.items():  # a create or delete cut short: lost, or gone
                if sid not in ids:
                    assert info.state.value not in LIVE or info.state.value == "running", info
                    if info.state == corral.SandboxState.FAILED:
                        assert (info.reason or "").startswith("lost:"), info.reason
        assert h.stop() == 0, f"see {h.log_file}"  # SIGINT: everything stops
        _wait(lambda: not h.in_cgroups() and not h.cgroup_exists(),
              "no process or cgroup of the engine is left")
        assert h.host_mounts() == []
        _wait(lambda: not _wardens(h), "no warden of the state directory is left", limit=30)
    finally:
        h.remove()
