"""``proc.readline()``, ``exchange()`` and ``wait()`` have a default timeout, lose nothing
when it passes, and mix (issue 25, item 6): before, all three waited forever by default
and ``readline()`` then ``exchange()`` raised ``InvalidState``."""

from __future__ import annotations

import inspect

import pytest

import corral
from corral.schema import DEFAULT_EXEC_TIMEOUT_S
from tests.conftest import requires_root

pytestmark = requires_root

# echoes each line upper-cased; a "slow" line is answered in two halves, the second
# only once a "go" line comes (no clock decides what a read finds)
UPPER = (
    "import sys\n"
    "for line in sys.stdin:\n"
    "    if line.startswith('slow'):\n"
    "        sys.stdout.write('HA'); sys.stdout.flush(); sys.stdin.readline()\n"
    "        sys.stdout.write('LF\\n'); sys.stdout.flush(); continue\n"
    "    sys.stdout.write(line.upper()); sys.stdout.flush()\n"
)


def test_the_defaults_are_the_exec_timeout_for_both_clients():
    for cls in (corral.Process, corral.AsyncProcess):
        for name in ("readline", "exchange", "wait"):
            default = inspect.signature(getattr(cls, name)).parameters["timeout"].default
            assert default == DEFAULT_EXEC_TIMEOUT_S, (cls, name)


def test_readline_then_exchange_and_timeouts_lose_nothing(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        proc = sb.spawn(["python3", "-u", "-c", UPPER])
        proc.write("a\n")
        assert proc.readline() == "A\n"
        assert proc.exchange("b\n") == "B\n"  # after a streamed read: no InvalidState
        with pytest.raises(corral.ExecTimeout, match="still runs"):
            proc.readline(timeout=0.2)  # nothing written yet
        proc.write("slow\n")
        with pytest.raises(corral.ExecTimeout):
            proc.readline(timeout=0.3)  # half a line came: kept, not lost
        proc.write("go\n")
        assert proc.readline(timeout=30) == "HALF\n"
        with pytest.raises(corral.ExecTimeout):
            proc.exchange("slow\n", timeout=0.3)
        proc.write("go\n")
        assert proc.readline() == "HALF\n"  # the reply to the timed-out exchange
        with pytest.raises(corral.ExecTimeout, match="its exit"):
            proc.wait(timeout=0.3)  # stdin is open: it runs on, not killed
        assert proc.exchange("c\n") == "C\n"
        proc.close_stdin()
        assert proc.wait().returncode == 0


def test_exchange_then_readline_still_works(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        proc = sb.spawn(["python3", "-u", "-c", UPPER])
        assert proc.exchange("x\n") == "X\n"  # request/reply, no stream open
        proc.write("y\n")
        assert proc.readline() == "Y\n"
        proc.close_stdin()
        assert proc.readline() == ""
        assert proc.wait(timeout=None).returncode == 0


async def test_the_async_process_keeps_the_same_rules(aclient):
    async with await corral.AsyncSandbox.create(memory_mb=128, client=aclient) as sb:
        proc = await sb.spawn(["python3", "-u", "-c", UPPER])
        await proc.write("a\n")
        assert await proc.readline() == "A\n"
        assert await proc.exchange("b\n") == "B\n"
        await proc.write("slow\n")
        with pytest.raises(corral.ExecTimeout):
            await proc.readline(timeout=0.3)
        await proc.write("go\n")
        assert await proc.readline(timeout=30) == "HALF\n"
        with pytest.raises(corral.ExecTimeout):
            await proc.wait(timeout=0.2)
        await proc.close_stdin()
        assert (await proc.wait()).returncode == 0
