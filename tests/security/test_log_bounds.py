"""A sandbox cannot make its log (kept by the daemon, on the host's disk) grow without
bound: not with many commands, not with huge output or a huge argv, not by flooding
faster than the writer. The store is the real one, on real SQLite."""

from __future__ import annotations

import os
import stat

import pytest

from corral.runtime import sandbox_logs
from corral.runtime.cmdtap import MAX_ARGV_BYTES, TAIL_BYTES, CommandTap
from corral.runtime.events import CommandEnded, Events, SandboxDeleted, SandboxStarted
from corral.runtime.sandbox_logs import MAX_COMMANDS, SandboxLogs
from corral.schema import ExecEvent, ExecResult


def _command(events: Events, sid: str, i: int, out: bytes = b"x\n") -> None:
    tap = CommandTap(events, sid, ["echo", str(i)])
    tap.see(ExecEvent("stdout", out))
    tap.see(ExecEvent("exit", result=ExecResult(0)))
    tap.end()


async def test_a_flood_of_commands_keeps_only_the_ring(tmp_path):
    events = Events()
    logs = SandboxLogs(tmp_path / "logs.db")
    logs.attach(events)
    try:
        for i in range(3 * MAX_COMMANDS + 7):  # flushed partly in between, partly at once
            _command(events, "sb-hostile", i)
            if i % 900 == 0:
                logs.flush()
        _command(events, "sb-quiet", 0)
        logs.flush()
        entries = logs.read("sb-hostile", limit=sandbox_logs.MAX_READ)
        assert len(entries) == MAX_COMMANDS
        assert entries[-1]["argv"] == ["echo", str(3 * MAX_COMMANDS + 6)]  # the newest kept
        assert len(logs.read("sb-quiet")) == 1  # another sandbox's entry is untouched
        assert logs.stats()["rows"] == MAX_COMMANDS + 1
        assert stat.S_IMODE(os.stat(tmp_path / "logs.db").st_mode) == 0o600
    finally:
        await logs.close()


async def test_a_started_sandboxs_entries_count_against_its_owner_without_a_lookup(tmp_path):
    """The owner comes with SandboxStarted (no registry read on the loop for the first
    entries); each entry still counts against the tenant's bound, not the admin's."""
    asked: list[str] = []

    def owner_of(sandbox_id: str) -> str | None:
        asked.append(sandbox_id)
        return None  # what a wrong lookup would bill: the admin

    events = Events()
    logs = SandboxLogs(tmp_path / "logs.db", owner_of=owner_of)
    logs.attach(events)
    try:
        events.emit(SandboxStarted("sb-t1", None, "t1"))
        _command(events, "sb-t1", 0)
        logs.flush()
        assert asked == []
        assert logs.owner_bytes("t1") > 0
        assert logs.owner_bytes(None) == 0
        _command(events, "sb-unannounced", 0)  # no SandboxStarted seen: looked up
        assert asked == ["sb-unannounced"]
    finally:
        await logs.close()


async def test_huge_output_and_argv_make_small_entries(tmp_path):
    events = Events()
    logs = SandboxLogs(tmp_path / "logs.db")
    logs.attach(events)
    try:
        tap = CommandTap(events, "sb-big", ["x" * 10_000_000, *["a"] * 100_000])
        for _ in range(100):
            tap.see(ExecEvent("stdout", b"y" * 100_000))
            tap.see(ExecEvent("stderr", os.urandom(50_000)))  # not UTF-8 either
        tap.end()  # no exit seen: cut short
        logs.flush()
        (entry,) = logs.read("sb-big")
        assert entry["outcome"] == "killed" and entry["exit_code"] is None
        assert len(entry["stdout_tail"]) == TAIL_BYTES
        assert len(entry["stderr_tail"].encode("utf-8", "surrogatepass")) <= 4 * TAIL_BYTES
        assert sum(len(a) for a in entry["argv"]) <= MAX_ARGV_BYTES + 64
        assert logs.stats()["bytes"] < 8 * TAIL_BYTES
    finally:
        await logs.close()


async def test_a_flood_faster_than_the_writer_is_dropped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_logs, "MAX_PENDING", 500)
    events = Events()
    logs = SandboxLogs(tmp_path / "logs.db")
    logs.attach(events)
    try:
        for i in range(2000):  # never yielding to the loop: the writer cannot run
            _command(events, "sb-flood", i)
        assert logs.stats()["pending"] == 500 and logs.dropped == 1500
    finally:
        await logs.close()
    assert len(SandboxLogs(tmp_path / "logs.db").read("sb-flood")) == 500


async def test_the_store_total_is_capped_oldest_first(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_logs, "MAX_TOTAL_BYTES", 200_000)
    events = Events()
    logs = SandboxLogs(tmp_path / "logs.db")
    logs.attach(events)
    try:
        for n in range(40):  # many sandboxes, each under its ring
            for i in range(20):
                _command(events, f"sb-{n}", i, out=b"z" * TAIL_BYTES)
            logs.flush()
        assert logs.stats()["bytes"] <= 200_000
        assert logs.read("sb-0") == [] and len(logs.read("sb-39")) == 20
    finally:
        await logs.close()


async def test_retention_sweep_forgets_deleted_sandboxes(tmp_path):
    events = Events()
    logs = SandboxLogs(tmp_path / "logs.db", retention=0)
    logs.attach(events)
    try:
        _command(events, "sb-gone", 0)
        _command(events, "sb-kept", 0)
        events.emit(SandboxDeleted("sb-gone"))
        logs.flush()  # records the deletion (and sweeps: retention 0)
        logs._last_sweep = 0.0
        logs.flush()
        assert not logs.known("sb-gone") and logs.known("sb-kept")
    finally:
        await logs.close()


def test_command_ended_is_frozen():
    ev = CommandEnded("sb", ("a",), 0.0, 1.0, "exit", 0, b"", b"")
    with pytest.raises(AttributeError):
        ev.outcome = "oom"  # type: ignore[misc]
