"""sb.spawn(..., pty=True): a pseudo-terminal through the SDK (blocking and asyncio)."""

from __future__ import annotations

import pytest

import corral
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

PROMPT = "sdk-test$ "


def read_until(chunks, marker: str, seen: list[str]) -> str:
    """Text from the chunk iterator until ``marker`` appears; what came before it."""
    text = "".join(seen)
    while marker not in text:
        chunk = next(chunks)  # StopIteration: it exited first (a failure)
        assert chunk.stream == "stdout"  # a terminal has one stream
        text += chunk.text
    before, _, after = text.partition(marker)
    seen[:] = [after]
    return before


def test_a_shell_on_a_terminal(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        with sb.spawn(["bash", "--norc", "--noprofile"], pty=True, rows=20, cols=70,
                      env={"PS1": PROMPT}) as proc:
            assert proc.pty is True
            info = proc.refresh()
            assert (info["pty"], info["rows"], info["cols"]) == (True, 20, 70)
            chunks, seen = proc.chunks(), []
            read_until(chunks, PROMPT, seen)
            proc.write('echo "<<$(tty) $(stty size)>>"\r')
            read_until(chunks, "\r\n", seen)  # the echo of the typed line
            assert read_until(chunks, "\r\n", seen).endswith("<</dev/pts/0 20 70>>")
            read_until(chunks, PROMPT, seen)  # typed ahead, a line is echoed twice (tty, readline)
            proc.resize(30, 90)  # what is typed next sees the new size
            proc.write('echo "<<$(stty size)>>"\r')
            read_until(chunks, "\r\n", seen)
            assert read_until(chunks, "\r\n", seen).endswith("<<30 90>>")
            read_until(chunks, PROMPT, seen)  # a Ctrl-D typed ahead may be flushed by readline
            proc.close_stdin()  # Ctrl-D at the prompt: the shell exits
            assert proc.wait().returncode == 0
            with pytest.raises(corral.InvalidState):
                proc.resize(10, 10)  # it has exited

        plain = sb.spawn(["cat"])
        assert plain.pty is False
        with pytest.raises(corral.InvalidState, match="not started on a terminal"):
            plain.resize(24, 80)
        plain.kill()


def test_sizes_are_checked(client):
    with corral.Sandbox.create(memory_mb=128, client=client) as sb:
        with pytest.raises(corral.InvalidArgument, match="pty=True"):
            sb.spawn(["true"], rows=24)
        for bad in ({"rows": 0}, {"cols": "80"}, {"pty": 1}):
            with pytest.raises(corral.InvalidArgument):
                sb.spawn(["true"], **{"pty": True, **bad})
        with pytest.raises(corral.InvalidArgument, match="4096"):
            sb.spawn(["true"], pty=True, cols=5000)  # the daemon's bound


async def test_async_terminal(aclient):
    sb = await corral.AsyncSandbox.create(memory_mb=128, client=aclient)
    try:
        async with await sb.spawn("read x; stty size; echo got $x", pty=True, cols=100) as proc:
            assert proc.pty
            await proc.resize(25, 101)  # before the line: stty runs after both
            await proc.write("y\r")
            out = "".join([chunk.text async for chunk in proc.chunks()])
            assert out.split("\r\n") == ["y", "25 101", "got y", ""]
            assert proc.result.returncode == 0
    finally:
        await sb.delete()
