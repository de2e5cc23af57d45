"""The daemon trusts nothing it reads from a sandbox (issue 11, part 2).

Two kinds of attack, both real:

- A hostile agent: the engine's real :class:`AgentChannel` reads from one end of a
  socketpair, and a Python "agent" on the other end writes crafted frames (forged
  exits, floods, oversized headers, malformed fields, hang-ups). This tests the
  daemon's own parser and state machine, not a mock of it.
- A stuck or hijacked agent in a real sandbox: the agent is stopped (SIGSTOP from the
  host) or its socket is shut down from outside, as sandbox code that stole it would;
  timeouts still hold, file operations still end, and the sandbox's fault is reported
  as the policy's, never as infrastructure (an RL runner does not retry it).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

import corral
from corral.errors import (
    SandboxLost,
    SandboxProtocolError,
    error_from_dict,
    is_sandbox_fault,
)
from corral.runtime import agentconn
from corral.runtime import channel as channel_mod
from corral.runtime.channel import AgentChannel
from corral.runtime.protocol import (
    FIELD,
    HEADER,
    MAX_DATA_FRAME,
    MAX_FRAME,
    U64,
    Fields,
    Msg,
    Tag,
    encode,
)
from corral.schema import SandboxState
from tests.conftest import requires_root
from tests.security.conftest import agent_host_pid

MASK = (1 << 64) - 1


# ----------------------------------------------------------- a hostile agent


class HostileAgent:
    """The agent's end of a socketpair, speaking whatever we make it say."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(30)

    def send(self, msg: int, rid: int, fields=()) -> None:
        self.sock.sendall(encode(msg, rid, fields))

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def started(self, rid: int, pid: int = 42) -> None:
        self.send(Msg.STARTED, rid, [(Tag.PID, pid)])

    def exit(self, rid: int, code: int = 0, **flags: int) -> None:
        fields = [(Tag.CODE, code & MASK), (Tag.KILLED_BY_SIGNAL, max(0, -code))]
        fields += [(getattr(Tag, k.upper()), v) for k, v in flags.items()]
        self.send(Msg.EXIT, rid, fields)

    def read_request(self) -> tuple[int, int, Fields]:
        """The next frame the engine sent: (type, request id, fields)."""
        hdr = self._exactly(HEADER.size)
        length, msg, rid = HEADER.unpack(hdr)
        return msg, rid, Fields(self._exactly(length))

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "the engine closed the channel"
            buf += chunk
        return buf


@pytest.fixture
async def wire():
    """A real AgentChannel (READY already received) and the hostile agent facing it."""
    engine_end, agent_end = socket.socketpair()
    ch = AgentChannel(engine_end, "sb-hostile")
    ends: list[str] = []
    ch.on_close = lambda: ends.append(ch.reason)
    await ch.start()
    agent = HostileAgent(agent_end)
    agent.send(Msg.READY, 0)
    await asyncio.wait_for(ch.ready, 10)
    yield ch, agent, ends
    await ch.close()
    agent_end.close()


async def fault_of(ch: AgentChannel, awaitable) -> SandboxProtocolError:
    """Await something that must fail because the sandbox broke the protocol."""
    with pytest.raises(SandboxProtocolError) as info:
        await asyncio.wait_for(awaitable, 30)
    assert ch.faulted and is_sandbox_fault(ch.reason)
    return info.value


async def exec_on(
    ch: AgentChannel, agent: HostileAgent, max_output: int | None = 1024, output_tail: int = 0
):
    stream = ch.open_exec([(Tag.ARGV, "true")], max_output=max_output, output_tail=output_tail)
    msg, rid, _ = await asyncio.to_thread(agent.read_request)
    assert (msg, rid) == (Msg.EXEC, stream.request_id)
    return stream


def fake_live():
    """What command_events needs of a sandbox: its id and a cgroup with no OOM kills."""
    kills: list[bool] = []
    cgroup = SimpleNamespace(
        oom_kills=lambda: 0, frozen=lambda: False, kill_all=lambda: kills.append(True)
    )
    return SimpleNamespace(id="sb-hostile", state=SandboxState.RUNNING, cgroup=cgroup), kills


async def run_command(live, stream, timeout=None):
    """Drive a command as Engine.exec does: (stdout, stderr, result)."""
    out, err = [], []
    async for ev in agentconn.command_events(live, stream, timeout, None, 0):
        if ev.kind == "stdout":
            out.append(ev.data)
        elif ev.kind == "stderr":
            err.append(ev.data)
        else:
            return b"".join(out), b"".join(err), ev.result
    raise AssertionError("no exit event")


# ------------------------------------------------------- forged and repeated ends


@pytest.mark.parametrize("target", ["never_sent", "finished", "file_request"])
async def test_forged_exit_for_another_request_is_rejected(wire, target):
    """An EXIT for a request id the engine never sent, one that had ended, or one that
    is a file operation: a violation, and the sandbox's command sees no forged exit."""
    ch, agent, ends = wire
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    if target == "never_sent":
        forged = stream.request_id + 7
    elif target == "finished":
        done = await exec_on(ch, agent)
        agent.started(done.request_id)
        agent.exit(done.request_id, 3)
        assert (await done.next()).msg == Msg.STARTED
        assert (await done.next()).fields.i64(Tag.CODE) == 3
        forged = done.request_id
    else:
        stat = asyncio.ensure_future(ch.request(Msg.FSTAT, [(Tag.PATH, "/")]))
        _, forged, _ = await asyncio.to_thread(agent.read_request)
    agent.exit(forged, 0)
    assert (await stream.next()).msg == Msg.STARTED
    err = await fault_of(ch, stream.next())
    expected = {"never_sent": "unknown_request", "finished": "finished_request",
                "file_request": "unexpected_reply"}[target]
    assert err.details["violation"] == expected
    assert ends == [ch.reason], "the engine is told once, to end the sandbox"
    if target == "file_request":
        with pytest.raises(SandboxProtocolError):
            await stat
    with pytest.raises(SandboxProtocolError):  # nothing more is believed or sent
        ch.open_exec([(Tag.ARGV, "true")])


async def test_a_second_exit_or_output_after_exit_is_a_violation(wire):
    ch, agent, _ = wire
    live, _ = fake_live()
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.exit(stream.request_id, 1)  # the real exit: `...; exit 1`
    _, _, result = await run_command(live, stream)
    assert result.returncode == 1
    agent.exit(stream.request_id, 0)  # the forged one comes too late, and is caught
    err = await fault_of(ch, ch.request(Msg.FSTAT, [(Tag.PATH, "/")]))
    assert err.details["violation"] == "finished_request"
    assert "request 1" in ch.reason


async def test_output_after_exit_is_a_violation(wire):
    ch, agent, _ = wire
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.exit(stream.request_id, 0)
    agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"10 passed")])
    assert (await stream.next()).msg == Msg.STARTED
    assert (await stream.next()).msg == Msg.EXIT
    err = await fault_of(ch, ch.request(Msg.FSTAT, [(Tag.PATH, "/")]))
    assert err.details["violation"] == "finished_request"


@pytest.mark.parametrize("frames, violation", [
    ([(Msg.STARTED, [(Tag.PID, 5)])], "duplicate_started"),
    ([(Msg.READY, [])], "unexpected_ready"),
    ([(Msg.OK, [])], "unexpected_reply"),
])
async def test_out_of_order_frames_are_violations(wire, frames, violation):
    ch, agent, _ = wire
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    for msg, fields in frames:
        agent.send(msg, 0 if msg == Msg.READY else stream.request_id, fields)
    assert (await stream.next()).msg == Msg.STARTED
    err = await fault_of(ch, stream.next())
    assert err.details["violation"] == violation


# ------------------------------------------------------------- output caps


async def test_a_50_mb_output_flood_is_stopped_at_the_cap(wire):
    """50 MB of STDOUT frames for a command that asked for 1024 bytes: past the cap
    without a TAIL is a violation (an agent holds back what goes over the head), and
    the daemon never queued more than the cap nor buffered more than its reader holds."""
    ch, agent, _ = wire
    live, _ = fake_live()
    stream = await exec_on(ch, agent, max_output=1024)
    chunk = b"x" * (64 << 10)
    total = 50 << 20

    def flood() -> None:
        try:
            agent.started(stream.request_id)
            agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"x" * 1000)])
            for _ in range(total // len(chunk)):
                agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, chunk)])
            agent.exit(stream.request_id, 0, trunc_out=0)
        except OSError:
            pass  # the engine hung up on it

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    err = await fault_of(ch, run_command(live, stream))
    writer.join(30)
    assert err.details["violation"] == "output_over_cap" and "stdout" in ch.reason
    assert stream.peak_queued <= 1024, "output past the cap (per stream) was never queued"
    assert ch.peak_buffered <= 2 * channel_mod.READER_LIMIT + (256 << 10) + MAX_DATA_FRAME


async def test_the_cap_is_the_engines_count_not_the_agents_flag(wire):
    ch, agent, _ = wire
    live, _ = fake_live()
    stream = await exec_on(ch, agent, max_output=1024)
    agent.started(stream.request_id)
    agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"y" * 1024)])  # exactly the cap
    agent.exit(stream.request_id, 0, trunc_out=1)
    out, _, result = await run_command(live, stream)
    assert out == b"y" * 1024 and not result.stdout_truncated


# ------------------------------------------------------------ head and tail


def tail_frame(agent: HostileAgent, rid: int, dropped: int, stream: int = 1) -> None:
    agent.send(Msg.TAIL, rid, [(Tag.STREAM, stream), (Tag.DROPPED, dropped)])


async def test_a_head_a_tail_and_the_dropped_count_are_taken_in_order(wire):
    """The protocol as an honest agent speaks it (head, TAIL, tail, EXIT), the agent's
    truncated flags lying: the engine's own view decides the flags."""
    ch, agent, _ = wire
    live, _ = fake_live()
    stream = await exec_on(ch, agent, max_output=1000, output_tail=100)
    rid = stream.request_id
    agent.started(rid)
    agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"h" * 900)])
    tail_frame(agent, rid, 12345)
    agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"t" * 60)])
    agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"t" * 40)])
    agent.send(Msg.STDERR, rid, [(Tag.DATA, b"e" * 950)])  # within the cap: no TAIL
    agent.exit(rid, 0, trunc_out=0, trunc_err=1)
    out, err, result = await run_command(live, stream)
    assert out == b"h" * 900 + b"t" * 100 and err == b"e" * 950
    assert (result.stdout_truncated, result.stdout_dropped) == (True, 12345)
    assert (result.stderr_truncated, result.stderr_dropped) == (False, 0)
    assert not ch.faulted


@pytest.mark.parametrize("script, violation", [
    # a second TAIL for the same stream (a forged one after the real one)
    (["head", "tail", "ring", "tail"], "duplicate_tail"),
    (["head", "tail", "tail"], "duplicate_tail"),
    # a TAIL before the head is full, or after more than the head
    (["half", "tail"], "misplaced_tail"),
    (["head", "more", "tail"], "misplaced_tail"),
    # more tail than asked for, or less by the exit
    (["head", "tail", "ring", "more"], "tail_over_cap"),
    (["head", "tail", "half_ring", "exit"], "short_tail"),
    (["head", "tail", "exit"], "short_tail"),
    # a TAIL before the command started, or after its exit
    (["tail_first"], "output_before_start"),
    (["head", "tail", "ring", "exit", "tail"], "finished_request"),
    # a TAIL naming no stream, or dropping nothing
    (["head", "tail_stream_3"], "bad_field"),
    (["head", "tail_0"], "bad_field"),
])
async def test_a_forged_tail_is_a_violation(wire, script, violation):
    ch, agent, _ = wire
    stream = await exec_on(ch, agent, max_output=1000, output_tail=100)
    rid = stream.request_id
    steps = {
        "head": lambda: agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"h" * 900)]),
        "half": lambda: agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"h" * 450)]),
        "more": lambda: agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"m")]),
        "tail": lambda: tail_frame(agent, rid, 7),
        "tail_first": lambda: tail_frame(agent, rid, 7),
        "tail_stream_3": lambda: tail_frame(agent, rid, 7, stream=3),
        "tail_0": lambda: tail_frame(agent, rid, 0),
        "ring": lambda: agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"t" * 100)]),
        "half_ring": lambda: agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"t" * 50)]),
        "exit": lambda: agent.exit(rid, 0),
    }
    if script[0] != "tail_first":
        agent.started(rid)
    for step in script:
        steps[step]()

    async def drain() -> None:
        while True:
            await stream.next()

    ended = violation == "finished_request"  # the stream has ended: the next call fails
    err = await fault_of(ch, ch.request(Msg.FSTAT, [(Tag.PATH, "/")]) if ended else drain())
    assert err.details["violation"] == violation


async def test_a_tail_for_a_process_is_a_violation(wire):
    """A process streams all its output (no cap): a TAIL for it is forged."""
    ch, agent, _ = wire
    stream = await exec_on(ch, agent, max_output=None)
    agent.started(stream.request_id)
    agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"x" * 5000)])
    tail_frame(agent, stream.request_id, 1)
    assert (await stream.next()).msg == Msg.STARTED
    assert (await stream.next()).data == b"x" * 5000
    err = await fault_of(ch, stream.next())
    assert err.details["violation"] == "unexpected_tail"


# ----------------------------------------------------------- frame checks


@pytest.mark.parametrize("msg, length", [
    (Msg.STDOUT, 1 << 30), (Msg.OK, MAX_FRAME + 1), (Msg.EXIT, 1 << 20), (Msg.STDOUT, MAX_DATA_FRAME + 1),
])
async def test_an_oversized_frame_header_is_refused_before_reading_it(wire, msg, length):
    """A header announcing more than its type's cap ends the channel at once: no
    payload is sent at all, so reading (allocating) it would hang this test."""
    ch, agent, _ = wire
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    assert (await stream.next()).msg == Msg.STARTED
    received = ch.received
    agent.raw(HEADER.pack(length, msg, stream.request_id))
    err = await fault_of(ch, stream.next())
    assert err.details["violation"] == "frame_too_large"
    assert ch.received == received, "not a byte of the announced payload was read"


def _field(tag: int, raw: bytes) -> bytes:
    return FIELD.pack(tag, len(raw)) + raw


@pytest.mark.parametrize("payload", [
    _field(Tag.CODE, U64.pack(0))[:-3],                       # a field cut short
    FIELD.pack(Tag.CODE, 1 << 20) + U64.pack(0),              # a length past the payload
    _field(Tag.CODE, b"\x00" * 4),                            # an integer of 4 bytes
    _field(Tag.CODE, U64.pack(1000)),                         # no exit status is 1000
    _field(Tag.CODE, U64.pack(0)) + _field(Tag.CODE, U64.pack(1)),  # two codes
    _field(Tag.TIMED_OUT, U64.pack(0)),                       # no code at all
    _field(Tag.CODE, U64.pack(0)) + _field(Tag.TIMED_OUT, U64.pack(7)),  # a flag of 7
])
async def test_malformed_exit_fields_are_violations(wire, payload):
    ch, agent, _ = wire
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.raw(HEADER.pack(len(payload), Msg.EXIT, stream.request_id) + payload)
    assert (await stream.next()).msg == Msg.STARTED
    err = await fault_of(ch, stream.next())
    assert err.details["violation"] == "bad_field"


async def test_file_replies_are_checked_against_the_request(wire):
    """An FREAD answered with more data than asked, or a listing entry too short to be
    one: violations, not data handed to the caller."""
    ch, agent, _ = wire
    read = asyncio.ensure_future(ch.request(Msg.FREAD, [(Tag.PATH, "/f")], max_data=16))
    _, rid, _ = await asyncio.to_thread(agent.read_request)
    agent.send(Msg.OK, rid, [(Tag.SIZE, 17), (Tag.DATA, b"z" * 17)])
    err = await fault_of(ch, read)
    assert err.details["violation"] == "bad_field"


# ------------------------------------------------------------- hang-ups, silence


async def test_a_hang_up_mid_exec_is_the_sandboxs_fault(wire):
    """The agent's socket closes while a command runs and the engine did not ask for
    it: SandboxProtocolError (the policy's), not SandboxLost (infrastructure)."""
    ch, agent, ends = wire
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.sock.shutdown(socket.SHUT_RDWR)
    assert (await stream.next()).msg == Msg.STARTED
    err = await fault_of(ch, stream.next())
    assert err.details["violation"] == "agent_disconnected"
    assert ends and is_sandbox_fault(ends[0])


async def test_an_end_the_engine_asks_for_is_infrastructure(wire):
    ch, agent, _ = wire
    stream = await exec_on(ch, agent)
    await ch.close()
    with pytest.raises(SandboxLost):
        await asyncio.wait_for(stream.next(), 10)
    assert not ch.faulted and not is_sandbox_fault(ch.reason)


async def test_an_unanswered_file_request_ends_with_a_typed_error(wire, monkeypatch):
    ch, agent, _ = wire
    monkeypatch.setattr(channel_mod, "REQUEST_TIMEOUT_S", 0.5)
    err = await fault_of(ch, ch.request(Msg.FSTAT, [(Tag.PATH, "/fifo")]))
    assert err.details["violation"] == "agent_unresponsive"


async def test_a_silent_agent_cannot_stretch_a_timeout(wire, monkeypatch):
    """The agent starts the command and never reports its end: past timeout + grace
    the engine kills the sandbox's processes itself and says timed_out."""
    ch, agent, _ = wire
    monkeypatch.setattr(agentconn, "EXEC_GRACE_S", 0.2)
    live, kills = fake_live()
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"partial")])
    out, _, result = await asyncio.wait_for(run_command(live, stream, timeout=0.3), 30)
    assert result.timed_out and result.returncode == -signal.SIGKILL
    assert out == b"partial"
    assert kills == [True], "the engine killed the sandbox's processes itself"
    assert ch.faulted and ch.error.details["violation"] == "agent_unresponsive"


async def test_an_end_in_the_socket_is_read_before_the_deadline_blames_the_agent(wire, monkeypatch):
    """Under load the engine's own loop can stall past a command's deadline while the
    agent's EXIT waits in the socket: the deadline then fired in the loop turn that saw
    the socket readable, before the read loop had parsed the frame, and ended a sandbox
    whose agent had answered in time (test_stopping_every_process_cannot_park_the_agent,
    0.5 s timeouts in a loop, failed so under load)."""
    ch, agent, _ = wire
    monkeypatch.setattr(agentconn, "EXEC_GRACE_S", 0.2)
    live, kills = fake_live()
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)

    def stalled_engine() -> None:  # the agent answers; the engine does not look for 1 s
        agent.exit(stream.request_id, 0)
        time.sleep(1.0)  # past the command's timeout + grace (0.5 s)

    asyncio.get_running_loop().call_later(0.05, stalled_engine)
    _, _, result = await asyncio.wait_for(run_command(live, stream, timeout=0.3), 30)
    assert (result.returncode, result.timed_out) == (0, False), result
    assert kills == [] and not ch.faulted, ch.reason


async def test_bytes_left_unread_cannot_stretch_a_timeout(wire, monkeypatch):
    """Unparsed bytes at the deadline buy the read loop a look, not more: an agent that
    leaves half a frame in the socket (unread for ever) and never reports the end is
    ended all the same."""
    ch, agent, _ = wire
    monkeypatch.setattr(agentconn, "EXEC_GRACE_S", 0.2)
    live, kills = fake_live()
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.raw(encode(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"x" * 100)])[:-10])
    _, _, result = await asyncio.wait_for(run_command(live, stream, timeout=0.3), 30)
    assert result.timed_out
    assert kills == [True] and ch.error.details["violation"] == "agent_unresponsive"


def test_the_error_is_typed_end_to_end_and_never_infrastructure():
    from corral.rl.episodes import INFRA_ERRORS, is_infrastructure_error

    err = error_from_dict({"code": "sandbox_protocol_error", "message": "m",
                           "details": {"violation": "duplicate_started"}})
    assert type(err) is SandboxProtocolError and err.status == 422
    assert corral.SandboxProtocolError is SandboxProtocolError
    assert not is_infrastructure_error(err) and not isinstance(err, INFRA_ERRORS)
    assert not isinstance(err, SandboxLost)


# ------------------------------------------------------------- real sandboxes


def _pidfd_getfd(pid: int, fd: int) -> int:
    """The host's copy of process ``pid``'s descriptor ``fd`` (needs root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
        if got < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        return got
    finally:
        os.close(pidfd)


def shut_agent_socket(pid: int) -> None:
    """Do what sandbox code that stole the agent's socket did: shut it down."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ctl = int(argv[argv.index(b"serve") + 1])
    sock = socket.socket(fileno=_pidfd_getfd(pid, ctl))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


async def wait_ended(engine, sid: str, limit: float = 30.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        info = engine.get(sid)
        if info.state.terminal:
            return info
        await asyncio.sleep(0.05)
    raise AssertionError(f"{sid} did not end: {engine.get(sid).state}")


def left_in(cgroup) -> list[int]:
    try:
        return cgroup.pids()
    except OSError:
        return []


@requires_root
@pytest.mark.root
async def test_a_stopped_agent_cannot_stretch_an_exec_timeout(engine):
    """The agent is stopped while a command runs: exec(timeout=5) still returns
    timed_out, its processes are killed from the host, and the sandbox ends as its
    own fault; later calls raise SandboxProtocolError, not an infrastructure error."""
    info = await engine.create()
    cgroup = engine.cgroup(info.id)
    # 5 s: the echo comes, and the SIGSTOP, before it on a loaded host (1 s could not)
    events = engine.exec_stream(info.id, "echo started; exec sleep 600", timeout=5)
    first = await asyncio.wait_for(events.__anext__(), 30)
    assert first.data == b"started\n"
    os.kill(agent_host_pid(engine, info.id), signal.SIGSTOP)

    async def rest() -> list:
        return [ev async for ev in events]

    result = (await asyncio.wait_for(rest(), 60))[-1].result
    assert result.timed_out and result.returncode == -signal.SIGKILL
    ended = await wait_ended(engine, info.id)
    assert ended.state == SandboxState.FAILED and is_sandbox_fault(ended.reason)
    assert "did not report the end of a command" in ended.reason
    assert left_in(cgroup) == [], "nothing of the sandbox survives"
    with pytest.raises(SandboxProtocolError):
        await engine.exec(info.id, "true")


@requires_root
@pytest.mark.root
async def test_a_sandbox_the_engine_froze_is_not_blamed(engine, monkeypatch):
    """Paused past a command's timeout + grace: the engine's deadline waits for the
    resume (the freeze was the engine's doing), then the agent reports the timeout."""
    monkeypatch.setattr(agentconn, "EXEC_GRACE_S", 0.5)
    info = await engine.create()
    # 4 s: the echo comes, and the pause, before it on a loaded host (1 s could not)
    events = engine.exec_stream(info.id, "echo started; exec sleep 600", timeout=4)
    assert (await asyncio.wait_for(events.__anext__(), 30)).data == b"started\n"
    await engine.pause(info.id)
    await asyncio.sleep(6)  # the engine's deadline (4.5 s) passes while it is frozen
    await engine.resume(info.id)

    async def rest() -> list:
        return [ev async for ev in events]

    result = (await asyncio.wait_for(rest(), 60))[-1].result
    assert result.timed_out
    assert engine.get(info.id).state == SandboxState.RUNNING, engine.get(info.id).reason
    assert (await engine.exec(info.id, "echo still here")).stdout == b"still here\n"


@requires_root
@pytest.mark.root
async def test_a_stopped_agent_cannot_hang_a_file_read_or_a_process(engine, monkeypatch):
    monkeypatch.setattr(channel_mod, "REQUEST_TIMEOUT_S", 2.0)
    info = await engine.create()
    await engine.write_file(info.id, "/tmp/a", b"a")
    os.kill(agent_host_pid(engine, info.id), signal.SIGSTOP)
    with pytest.raises(SandboxProtocolError) as err:
        await asyncio.wait_for(engine.read_file(info.id, "/tmp/a"), 60)
    assert err.value.details["violation"] == "agent_unresponsive"
    ended = await wait_ended(engine, info.id)
    assert ended.state == SandboxState.FAILED and is_sandbox_fault(ended.reason)

    # A spawned process with a timeout: its wait ends timed_out though the agent stops.
    other = await engine.create()
    proc = await engine.spawn(other.id, ["sleep", "60"], timeout=1)
    os.kill(agent_host_pid(engine, other.id), signal.SIGSTOP)
    result = await asyncio.wait_for(proc.wait(), 60)
    assert result.timed_out and result.returncode == -signal.SIGKILL
    assert is_sandbox_fault((await wait_ended(engine, other.id)).reason)


@requires_root
@pytest.mark.root
async def test_a_shut_down_agent_socket_is_the_sandboxs_fault_a_host_kill_is_not(engine):
    """Shutting the agent's socket down (what code that stole it would do) while a
    command runs: SandboxProtocolError and a "sandbox fault" reason. Killing the
    sandbox's outer process from the host: SandboxLost, an infrastructure loss."""
    hijacked = await engine.create()
    run = asyncio.ensure_future(engine.exec(hijacked.id, "sleep 60", timeout=120))
    await asyncio.sleep(0.2)
    shut_agent_socket(agent_host_pid(engine, hijacked.id))
    with pytest.raises(SandboxProtocolError) as err:
        await asyncio.wait_for(run, 60)
    assert err.value.details["violation"] == "agent_disconnected"
    assert is_sandbox_fault((await wait_ended(engine, hijacked.id)).reason)

    killed = await engine.create()
    run = asyncio.ensure_future(engine.exec(killed.id, "sleep 60", timeout=120))
    await asyncio.sleep(0.2)
    os.kill(engine._live[killed.id].proc.pid, signal.SIGKILL)
    with pytest.raises(SandboxLost):
        await asyncio.wait_for(run, 60)
    ended = await wait_ended(engine, killed.id)
    assert ended.state == SandboxState.FAILED and not is_sandbox_fault(ended.reason)
    assert "killed from outside" in ended.reason


def _agent_of(marker: str, limit: float = 30.0) -> int:
    """The host pid of the agent whose sandbox holds /tmp/<marker>."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"serve" in argv and argv[0].endswith(b"/agent") and \
                        Path(f"/proc/{pid}/root/tmp/{marker}").exists():
                    return int(pid)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no agent holds /tmp/{marker}")


@requires_root
@pytest.mark.root
def test_the_episode_runner_scores_a_broken_sandbox_and_does_not_retry(daemon):
    """Through the daemon and the SDK: an episode whose sandbox hangs up on its engine
    is an error of the policy (status error, one attempt), not an infrastructure
    failure to retry."""
    from corral.rl import EpisodeStatus, run_episodes

    def episode(sb: corral.Sandbox, seed: int) -> float:
        marker = f"marker-{uuid.uuid4().hex}"
        sb.exec(["touch", f"/tmp/{marker}"])
        attack = threading.Thread(target=lambda: shut_agent_socket(_agent_of(marker)))
        attack.start()
        try:
            sb.exec("sleep 60", timeout=120)  # the "grader"; its sandbox breaks under it
        finally:
            attack.join(60)
        return 1.0

    with corral.Client(daemon.url) as client:
        [record] = run_episodes(episode, [0], sandbox={"memory_mb": 128}, retries=2,
                                client=client)
    assert record.status is EpisodeStatus.ERROR, record
    assert record.attempts == 1 and record.infra_errors == ()
    assert "SandboxProtocolError" in record.error and record.reward is None


# ------------------------------------------------------- a command started quietly
# A command run to completion asks its agent for no STARTED (Tag.QUIET_START): its first
# output or exit says it started. The rest of the order is checked as before.


async def quiet_exec_on(ch: AgentChannel, agent: HostileAgent):
    stream = ch.open_exec([(Tag.ARGV, "true")], max_output=1024, quiet_start=True)
    msg, rid, fields = await asyncio.to_thread(agent.read_request)
    assert (msg, rid) == (Msg.EXEC, stream.request_id)
    assert Tag.QUIET_START in fields.tags()  # the agent is told
    return stream


async def test_a_quiet_command_starts_with_its_first_output(wire):
    ch, agent, _ = wire
    stream = await quiet_exec_on(ch, agent)
    agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"hi")])
    agent.exit(stream.request_id, 0)
    assert (await stream.next()).msg == Msg.STDOUT
    assert (await stream.next()).msg == Msg.EXIT
    assert not ch.faulted


async def test_an_agent_that_says_started_anyway_is_believed(wire):
    """An agent older than the tag (a sandbox restored from before it) sends STARTED."""
    ch, agent, _ = wire
    stream = await quiet_exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.exit(stream.request_id, 0)
    assert (await stream.next()).msg == Msg.STARTED
    assert (await stream.next()).msg == Msg.EXIT
    assert not ch.faulted


@pytest.mark.parametrize("late", ["started", "err"])
async def test_a_quiet_command_cannot_start_twice_or_fail_after_output(wire, late):
    """After its first output a quiet command has started: a STARTED then is a second
    one, an ERR is an error after the start."""
    ch, agent, _ = wire
    stream = await quiet_exec_on(ch, agent)
    agent.send(Msg.STDOUT, stream.request_id, [(Tag.DATA, b"x")])
    if late == "started":
        agent.started(stream.request_id)
    else:
        agent.send(Msg.ERR, stream.request_id, [(Tag.ERRNO, 2), (Tag.MESSAGE, "no")])
    assert (await stream.next()).msg == Msg.STDOUT
    err = await fault_of(ch, stream.next())
    assert err.details["violation"] == ("duplicate_started" if late == "started"
                                        else "error_after_start")
