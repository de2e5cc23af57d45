"""The output budget's arithmetic (runtime/output_budget.py, runtime/output_room.py): a
command takes a floor, then the bytes its output really holds; when the budget has no
more its stream's cap is lowered there (head and tail kept, or the gap shown to a
streamed reader); only when not even the floor is free is it refused, typed; tenants
are counted apart, releases are idempotent."""

from __future__ import annotations

import pytest

from corral.errors import OutputBudgetExceeded, error_from_dict
from corral.runtime.channel import Reply
from corral.runtime.output_budget import MIN_GRANT, OutputBudget, host_output_bytes, memory_limit
from corral.runtime.output_room import FRAME_COST, OutputRoom
from corral.runtime.protocol import HEADER, Fields, Msg, Tag, encode
from corral.schema import ExecResult

MiB = 1 << 20


def _frame(msg: int, data: bytes = b"") -> Reply:
    return Reply(msg, Fields(), data)


def _tail(stream: int, dropped: int) -> Reply:
    raw = encode(Msg.TAIL, 0, [(Tag.STREAM, stream), (Tag.DROPPED, dropped)])
    return Reply(Msg.TAIL, Fields(raw[HEADER.size:]))


def test_a_command_takes_a_floor_then_what_its_output_holds():
    budget = OutputBudget(total=64 * MiB, per_tenant=32 * MiB)
    hold = budget.reserve("alice", 1 << 30)  # 1 GiB asked: only the floor is taken
    assert (hold.max_output, hold.limited, hold.nbytes) == (1 << 30, False, 2 * MIN_GRANT)
    small = budget.reserve("alice", 100)  # a cap under the floor: the cap
    assert small.nbytes == 200
    room = OutputRoom(hold, 0, keep=True)
    assert room.admit(_frame(Msg.STDOUT, b"x" * 3 * MIN_GRANT))
    assert hold.nbytes == 4 * MIN_GRANT  # the floor, then what came past it
    assert budget.used == 4 * MIN_GRANT + 200 and budget.by_tenant == {"alice": budget.used}
    hold.release()
    hold.release()  # twice: given back once
    small.release()
    assert budget.used == 0 and budget.by_tenant == {}


def test_hundreds_of_small_commands_fit_where_their_caps_would_not():
    """The Tensorlake case: each asks 64 MiB per stream, prints a line."""
    budget = OutputBudget(total=64 * MiB, per_tenant=32 * MiB)
    holds = [budget.reserve("alice", 64 * MiB) for _ in range(100)]
    for hold in holds:
        room = OutputRoom(hold, 0, keep=False)
        assert [r.data for r in room.admit(_frame(Msg.STDOUT, b"42\n"))] == [b"42\n"]
        assert not hold.limited
    assert budget.used == 100 * 2 * MIN_GRANT
    for hold in holds:
        hold.release()
    assert budget.used == 0


def test_a_kept_stream_is_lowered_mid_stream_to_its_head_and_its_tail():
    budget = OutputBudget(total=64 * MiB, per_tenant=4 * MiB)
    hold = budget.reserve("alice", 16 * MiB)
    room = OutputRoom(hold, 8 * MiB, keep=True)  # the tail asked: 8 MiB; the ring: 32 KiB
    out = []
    for i in range(100):  # 100 × 64 KiB: more than her 4 MiB
        out += room.admit(_frame(Msg.STDOUT, bytes([65 + i % 26]) * (64 << 10)))
    out += room.admit(_tail(1, 123))  # the agent's own gap: the ring goes on
    out += room.admit(_frame(Msg.STDOUT, b"VERDICT ok\n"))
    out += room.admit(_frame(Msg.STDERR, b"warning\n"))  # stderr has its floor
    out += room.admit(_frame(Msg.EXIT))
    assert budget.by_tenant["alice"] == 4 * MiB  # all her share, no more
    stdout = b"".join(r.data for r in out if r.msg == Msg.STDOUT)
    assert b"".join(r.data for r in out if r.msg == Msg.STDERR) == b"warning\n"
    assert out[-1].msg == Msg.EXIT and hold.limited
    assert len(stdout) == hold.max_output == 4 * MiB - MIN_GRANT  # stderr keeps its floor
    assert stdout.startswith(b"A" * (64 << 10)) and stdout.endswith(b"VERDICT ok\n")
    result = ExecResult(0, stdout_dropped=123, output_tail=8 * MiB)
    room.finish(result)
    assert result.stdout_truncated and not result.stderr_truncated
    assert result.output_limited_to == 4 * MiB - MIN_GRANT
    assert result.output_tail == MIN_GRANT // 2
    assert result.stdout_dropped == 123 + 100 * (64 << 10) + 11 - len(stdout)
    hold.release()
    assert budget.used == 0


def test_a_streamed_reader_gives_room_back_and_sees_the_gap_it_left():
    budget = OutputBudget(total=64 * MiB, per_tenant=1 * MiB)
    hold = budget.reserve("alice", 64 * MiB)
    room = OutputRoom(hold, 0, keep=False)
    queued = []
    for _ in range(32):  # 2 MiB, nobody reading: her 1 MiB is held, the rest dropped
        queued += room.admit(_frame(Msg.STDOUT, b"y" * (64 << 10)))
    assert budget.used == 1 * MiB and hold.limited
    kept = sum(len(r.data) for r in queued)
    # stderr's floor aside; each queued frame counts its objects too (FRAME_COST)
    assert kept == (1 * MiB - MIN_GRANT) // ((64 << 10) + FRAME_COST) * (64 << 10)
    for r in queued:  # the reader catches up: the room shrinks back to the floor
        room.handed(r)
    assert budget.used == 2 * MIN_GRANT
    after = room.admit(_frame(Msg.STDOUT, b"z"))
    assert after[0].msg == Msg.TAIL and after[0].fields.u64(Tag.DROPPED) == 2 * MiB - kept
    assert after[1].data == b"z"
    result = ExecResult(0)
    room.finish(result)
    assert result.stdout_truncated and result.stdout_dropped == 2 * MiB - kept
    assert result.output_limited_to == 1 * MiB - MIN_GRANT
    hold.release()
    assert budget.used == 0


def test_only_when_not_even_the_floor_is_free_is_a_command_refused():
    budget = OutputBudget(total=64 * MiB, per_tenant=4 * MIN_GRANT)
    first = budget.reserve("alice", 1 << 30)
    second = budget.reserve("alice", 1 << 30)
    with pytest.raises(OutputBudgetExceeded) as err:
        budget.reserve("alice", 1 * MiB)
    assert err.value.status == 429 and err.value.code == "output_budget_exceeded"
    assert "its tenant's" in str(err.value) and "max_output" in str(err.value)
    assert err.value.details["tenant_limit"] == 4 * MIN_GRANT
    # the error crosses the wire as itself
    again = error_from_dict({"code": err.value.code, "message": str(err.value)})
    assert isinstance(again, OutputBudgetExceeded)
    # another tenant is not touched by alice's share
    assert budget.reserve("bob", 4 * MiB).nbytes == 2 * MIN_GRANT
    first.release()
    second.release()
    assert not budget.reserve("alice", 1 * MiB).limited


def test_the_daemons_total_binds_every_tenant_and_says_so():
    budget = OutputBudget(total=3 * MIN_GRANT, per_tenant=2 * MIN_GRANT)
    budget.reserve("alice", MIN_GRANT)
    with pytest.raises(OutputBudgetExceeded) as err:
        budget.reserve("bob", MIN_GRANT)  # bob has its share, the daemon has not
    assert "the daemon's" in str(err.value)
    zero = budget.reserve("bob", 0)  # no output kept: always fits
    assert zero.nbytes == 0 and not zero.limited


def test_a_reply_holds_only_its_real_size():
    budget = OutputBudget(total=4 * MiB, per_tenant=4 * MiB)
    hold = budget.reserve(None, 2 * MiB)
    hold.shrink(100)
    hold.shrink(1000)  # never grows
    assert budget.used == 100 and budget.by_tenant == {None: 100}
    hold.release()
    assert budget.used == 0


def test_a_budget_smaller_than_one_grant_is_refused():
    with pytest.raises(ValueError):
        OutputBudget(total=MIN_GRANT)


def test_a_process_takes_what_fits_and_gives_it_back():
    budget = OutputBudget(total=4 * MiB, per_tenant=2 * MiB)
    assert budget.take("alice", 3 * MiB) == 2 * MiB  # her share
    assert budget.take("alice", 1) == 0  # spent: dropped, never refused
    assert budget.take("bob", 3 * MiB) == 2 * MiB  # the daemon's rest
    budget.give("alice", 2 * MiB)
    budget.give("bob", 2 * MiB)
    assert budget.used == 0 and budget.by_tenant == {}


def test_the_default_follows_the_daemons_own_memory_limit(tmp_path):
    """A daemon in a container: its cgroup's limit (v2 or v1, or an ancestor's) is what
    it may use, not the host's RAM."""
    ram = memory_limit(tmp_path / "none", tmp_path)
    assert ram > 0 and memory_limit() <= ram and host_output_bytes() <= ram // 8
    (tmp_path / "v2").write_text("0::/box/daemon\n")
    (tmp_path / "box" / "daemon").mkdir(parents=True)
    (tmp_path / "box" / "daemon" / "memory.max").write_text("max\n")
    (tmp_path / "box" / "memory.max").write_text(f"{512 * MiB}\n")
    assert memory_limit(tmp_path / "v2", tmp_path) == min(ram, 512 * MiB)
    (tmp_path / "v1").write_text("5:cpu,cpuacct:/x\n4:memory:/box\n")
    (tmp_path / "memory" / "box").mkdir(parents=True)
    (tmp_path / "memory" / "box" / "memory.limit_in_bytes").write_text(f"{256 * MiB}\n")
    assert memory_limit(tmp_path / "v1", tmp_path) == min(ram, 256 * MiB)
