"""A delete replies when its sandbox's pid namespace is empty, before bwrap has exited:
``agent_exit.namespace_init`` and the kernel property it relies on (the first process of
a pid namespace is seen as exited only once every other process of it is reaped)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from corral.runtime.agent_exit import has_exited, namespace_init
from tests.conftest import requires_root

UNSHARE = shutil.which("unshare")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # it exited meanwhile
        return []


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def descendants(pid: int) -> list[int]:
    out = []
    for kid in children(pid):
        out += [kid, *descendants(kid)]
    return out


def gone(pid: int) -> bool:
    """No process of that pid, not even a zombie."""
    return not os.path.exists(f"/proc/{pid}")


def test_a_child_that_is_no_namespace_init_is_not_taken():
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        wait_for(lambda: len(children(proc.pid)) == 1)
        assert namespace_init(proc) is None  # a child in our own pid namespace
    finally:
        proc.kill()
        proc.wait()


def test_no_child_or_two_are_not_taken():
    lone = subprocess.Popen(["sleep", "30"])
    two = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        assert namespace_init(lone) is None
        wait_for(lambda: len(children(two.pid)) == 2)
        assert namespace_init(two) is None
    finally:
        for p in (lone, two):
            p.kill()
            p.wait()


@requires_root
@pytest.mark.skipif(UNSHARE is None, reason="needs util-linux unshare")
def test_the_init_exits_only_after_every_process_of_its_namespace_is_gone():
    # pid 1 of a new namespace (as a sandbox's agent under bwrap --as-pid-1) with
    # processes that ignore SIGTERM/SIGHUP, one in a session of its own
    script = ("trap '' TERM HUP; setsid sh -c 'trap \"\" TERM HUP; sleep 300' & "
              "sleep 300 & sleep 300 & wait")
    proc = subprocess.Popen([UNSHARE, "--pid", "--fork", "sh", "-c", script])
    fd = None
    try:
        wait_for(lambda: len(descendants(proc.pid)) >= 4)
        fd = namespace_init(proc)
        assert fd is not None
        assert not has_exited(fd)
        init, *others = descendants(proc.pid)
        assert others and all(not gone(p) for p in others)
        os.kill(init, signal.SIGKILL)
        wait_for(lambda: has_exited(fd))
        # the namespace's init counts as exited only once the kernel killed and
        # reaped every other process of it
        assert all(gone(p) for p in others), [p for p in others if not gone(p)]
        proc.wait(30)  # unshare exits after it; not waited for by a delete's reply
    finally:
        if fd is not None:
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
