"""Closing the engine while warm slots are being made leaves no slot behind.

A slot is made in steps: its cgroup in a thread (``SlotPool.spawn``'s ``make``), then a
launcher that joins it and says it is ready. ``SlotPool.close`` cancels the spawns under
way; a cancelled ``asyncio.to_thread`` does not stop its thread, so a cgroup made after
the cancel used to be nobody's: a ``slot-…`` cgroup outlived a clean daemon stop; and a
create cancelled while its launcher got ready left that launcher waiting, in its
cgroup, with its uid taken, until the engine closed. Here each step is held,
deterministically (until the engine's close has begun; until the cancel), and then
nothing of the slot may be left once close or the cancelled create returns.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from corral.runtime import launcher
from corral.runtime.engine import Engine
from corral.runtime.reconcile import remove_cgroup
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

HOLD_S = 1.0  # how long a held step waits for close to return (with the fix it cannot)


class HeldCreate:
    """The pool's cgroup driver, whose ``create`` waits until the pool is closing, then
    until its close returned (or ``HOLD_S``: a close that waits for it never returns
    first), and only then makes the group: the cancelled thread's late effect."""

    def __init__(self, real, pool) -> None:
        self._real, self._pool = real, pool
        self.entered, self.close_returned, self.done = (threading.Event() for _ in range(3))
        self.made: list[str] = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def create(self, path: str, **limits):
        self.entered.set()
        try:
            deadline = time.monotonic() + 60  # only against a hang
            while not self._pool.closed and time.monotonic() < deadline:
                time.sleep(0.005)
            self.close_returned.wait(HOLD_S)
            group = self._real.create(path, **limits)
            self.made.append(path)
            return group
        finally:
            self.done.set()


def slot_dirs(eng: Engine) -> list[str]:
    """The engine's slot cgroups, in any hierarchy."""
    return [g for g in eng.cgroups.children(eng.cgroup_parent) if g.startswith("slot-")]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


async def test_close_waits_for_a_slot_cgroup_a_cancelled_thread_still_makes(state_dir):
    eng = await Engine.open(state_dir, warm_slots=0)
    pool = eng._pool
    held = HeldCreate(pool.cgroups, pool)
    pool.cgroups = held
    free = len(eng.uids._free)
    try:
        pool.target = 1
        pool.refill()  # a background spawn: its cgroup is made in a thread
        assert await asyncio.to_thread(held.entered.wait, 60)
        await eng.close()
        held.close_returned.set()
        assert await asyncio.to_thread(held.done.wait, 60)
        assert held.made, "the held create never made its group"
        assert slot_dirs(eng) == [], "a slot cgroup was made after the engine closed"
        assert len(eng.uids._free) == free, "the slot's uid was not given back"
    finally:
        await eng.close()
        remove_cgroup(eng.cgroups, eng.cgroup_parent)  # what the bug left: not for the next


async def test_a_create_cancelled_while_its_launcher_got_ready_leaves_nothing(state_dir,
                                                                           monkeypatch):
    waiting = asyncio.Event()

    async def never_ready(fd: int) -> bytes:  # the launcher is up; its "ready" is slow
        waiting.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    monkeypatch.setattr(launcher, "_read_ready", never_ready)
    eng = await Engine.open(state_dir, warm_slots=0)  # a create spawns its own slot
    free = len(eng.uids._free)
    try:
        create = asyncio.create_task(eng.create())
        await asyncio.wait_for(waiting.wait(), 60)
        started = launchers()
        assert started and slot_dirs(eng), "the slot's launcher and cgroup should exist"
        create.cancel()
        with pytest.raises(asyncio.CancelledError):
            await create
        # the engine is still open: nothing else would ever remove them
        assert [pid for pid in started if alive(pid)] == [], "its launcher outlived the cancel"
        assert slot_dirs(eng) == [], "its cgroup outlived the cancel"
        assert len(eng.uids._free) == free, "the slot's uid was not given back"
    finally:
        await eng.close()
        for pid in launchers():  # what the bug left: not for the next test
            os.kill(pid, signal.SIGKILL)
        remove_cgroup(eng.cgroups, eng.cgroup_parent)


def launchers() -> list[int]:
    """Our child processes that are slot launchers (``corral-agent launch``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] != b"Z" and argv[1:2] == [b"launch"]:
            found.append(int(pid))
    return found
