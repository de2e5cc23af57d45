"""The async exec stream reads its reply to the end after the exit: the output written
right before the exit arrives whole, and the connection goes back to the pool instead
of being closed (the same fix as ``AsyncProcess``'s drain, ``DRAIN_S``)."""

from __future__ import annotations

import corral
from tests.client.conftest import astreamed_connection, streamed_connection

RUNS = 20
"""Short runs, each writing right before it exits: bounded, a few seconds in all."""


async def test_async_exec_stream_reads_to_the_end(aclient):
    sb = await corral.AsyncSandbox.create(memory_mb=128, client=aclient)
    try:
        stream = await astreamed_connection(aclient)
        for i in range(RUNS):
            seen: list[bytes] = []
            async with sb.exec_stream(f"printf 'a%.0s' $(seq 300); echo {i}; echo e{i} >&2",
                                      timeout=10) as run:
                async for chunk in run:
                    seen.append(chunk.data)
            assert (run.result.stdout, run.result.stderr) == ("a" * 300 + f"{i}\n", f"e{i}\n")
            assert sorted(b"".join(seen)) == sorted(f"{'a' * 300}{i}\ne{i}\n".encode())
            # the reply was read to its end: the next call reuses the same connection
            assert await astreamed_connection(aclient) is stream, i
    finally:
        await sb.delete()


def test_sync_exec_stream_reads_to_the_end(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        stream = streamed_connection(client)
        for i in range(3):
            with sb.exec_stream(f"echo {i}", timeout=10) as run:
                assert [c.text for c in run] == [f"{i}\n"]
            assert run.result.stdout == f"{i}\n"
            assert streamed_connection(client) is stream, i
