"""A hostile agent announces a large frame nobody asked for, and sends it slowly.

Each frame's header was checked against its type's cap alone (16 MiB for an OK, 1 MiB
for output) before its payload was waited for; whether any open request could take it
was asked only once its last byte had come. So an agent (pid 1 of a sandbox whose code
is written by a model optimised to earn reward: the daemon trusts nothing it says)
could make the daemon hold up to 16 MiB a sandbox, outside any budget, for as long as
it liked: an OK for a request never made, output for a command that had ended, or an
FREAD reply far longer than the data asked for. Now a frame longer than a control frame
is refused at its header unless an open request may be answered with that much
(:meth:`corral.runtime.channel.AgentChannel.admit`), and large replies that were asked
for still pass.

The engine's real :class:`AgentChannel` on one end of a socketpair, a Python "agent" on
the other (tests/security/test_daemon_distrust.py's): no mock of the parser. Waits are
on conditions, bounded only to stop a hang.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from corral.runtime.protocol import HEADER, MAX_CONTROL_FRAME, MAX_DATA_FRAME, MAX_FRAME, Msg, Tag
from tests.security.test_daemon_distrust import exec_on, fault_of, wire  # noqa: F401 (a fixture)

SENT = 1 << 20  # of the announced payload, what the agent sends before it stalls
WAIT_S = 60.0


async def _faulted_or_holding(ch, least: int) -> None:
    """Until the channel has faulted, or the wire holds ``least`` bytes of a frame."""
    for _ in range(int(WAIT_S / 0.01)):
        if ch.faulted or (ch._wire is not None and ch._wire.buffered() >= least):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"neither a fault nor {least} bytes held within {WAIT_S} s")


async def _announce(ch, agent, msg: int, rid: int, length: int, sent: int) -> None:
    """The agent announces ``length`` bytes and sends ``sent`` of them, then stalls
    (or finds the channel closed on it: refused at the header)."""
    try:
        await asyncio.to_thread(agent.raw, HEADER.pack(length, msg, rid) + os.urandom(sent))
    except (BrokenPipeError, ConnectionResetError):
        pass
    await _faulted_or_holding(ch, sent)
    held = ch._wire.buffered() if ch._wire is not None else 0
    assert ch.faulted, ("the daemon holds this much of a frame nobody asked for", held)


@pytest.mark.parametrize("msg, length", [(Msg.OK, MAX_FRAME), (Msg.STDOUT, MAX_DATA_FRAME)])
async def test_a_large_frame_for_a_request_never_made_is_refused_at_its_header(wire, msg, length):  # noqa: F811
    ch, agent, _ = wire
    stream = await exec_on(ch, agent)  # (a request open: request 1; this frame is for 7)
    await _announce(ch, agent, msg, 7, length, min(SENT, length - 1))
    err = await fault_of(ch, stream.next())
    assert err.details["violation"] == "unknown_request", err.details
    assert ch.peak_buffered < SENT // 2, ch.peak_buffered  # (before: the whole megabyte)


async def test_output_after_a_commands_exit_is_refused_at_its_header(wire):  # noqa: F811
    ch, agent, _ = wire
    stream = await exec_on(ch, agent)
    agent.started(stream.request_id)
    agent.exit(stream.request_id)
    for _ in range(2):
        await stream.next()
    await _announce(ch, agent, Msg.STDOUT, stream.request_id, MAX_DATA_FRAME, SENT // 2)
    assert ch.faulted and ch.error.details["violation"] == "finished_request"
    assert ch.peak_buffered < SENT // 4, ch.peak_buffered


async def test_an_fread_reply_longer_than_the_data_asked_is_refused_at_its_header(wire):  # noqa: F811
    ch, agent, _ = wire
    read = asyncio.ensure_future(ch.request(Msg.FREAD, [(Tag.PATH, "/f")], max_data=4096))
    _, rid, _ = await asyncio.to_thread(agent.read_request)
    await _announce(ch, agent, Msg.OK, rid, MAX_FRAME, SENT)
    err = await fault_of(ch, read)
    assert err.details["violation"] == "frame_too_large", err.details
    assert ch.peak_buffered < SENT // 2, ch.peak_buffered


async def test_large_replies_that_were_asked_for_still_pass(wire):  # noqa: F811
    """A listing of 2 MiB, and an FREAD answered with all the data it asked for, each
    cut into many writes: handed on whole."""
    ch, agent, _ = wire
    asked = 1 << 20
    read = asyncio.ensure_future(ch.request(Msg.FREAD, [(Tag.PATH, "/f")], max_data=asked))
    _, rid, _ = await asyncio.to_thread(agent.read_request)
    data = os.urandom(asked)
    await asyncio.to_thread(agent.send, Msg.OK, rid, [(Tag.SIZE, asked), (Tag.DATA, data)])
    reply = await asyncio.wait_for(read, WAIT_S)
    assert reply.fields.raw(Tag.DATA) == data
    listing = asyncio.ensure_future(ch.request(Msg.FLIST, [(Tag.PATH, "/d")]))
    _, rid, _ = await asyncio.to_thread(agent.read_request)
    filler = [(250, b"x" * 4096)] * 512  # (tags a listing does not use: ignored)
    await asyncio.to_thread(agent.send, Msg.OK, rid, filler)
    reply = await asyncio.wait_for(listing, WAIT_S)
    assert reply.msg == Msg.OK and not ch.faulted
    assert MAX_CONTROL_FRAME < 2 << 20 < MAX_FRAME
