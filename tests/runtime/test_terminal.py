"""Processes on a pseudo-terminal: a real pty allocated by the agent inside the sandbox."""

from __future__ import annotations

import asyncio
import signal

import pytest

from corral.errors import InvalidArgument, InvalidState
from corral.runtime.terminal import MAX_SIDE, TerminalSize
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root]

PROMPT = b"corral-test$ "
SAFETY_S = 20  # only so that a broken build fails instead of hanging: never reached


class Screen:
    """Everything a process on a terminal wrote, read as it comes."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.events = proc.output()
        self.text = b""

    async def until(self, marker: bytes) -> bytes:
        """Read until ``marker`` shows up after what was consumed; return what came
        before it and consume both."""
        try:
            async with asyncio.timeout(SAFETY_S):
                while marker not in self.text:
                    event = await anext(self.events)
                    if event.kind == "exit":
                        raise AssertionError(f"exited before {marker!r}; output {self.text!r}")
                    assert event.kind == "stdout"  # a terminal has one stream
                    self.text += event.data
        except TimeoutError:
            raise AssertionError(f"no {marker!r} in {self.text!r}") from None
        before, _, self.text = self.text.partition(marker)
        return before

    async def exit(self):
        async with asyncio.timeout(SAFETY_S):
            async for event in self.events:
                if event.kind == "exit":
                    return event.result
                self.text += event.data
        raise AssertionError("no exit event")


async def shell(engine, sid: str, size: TerminalSize = TerminalSize()):
    """bash on a terminal, waiting at its prompt (readline then owns the terminal)."""
    proc = await engine.spawn(
        sid, ["bash", "--norc", "--noprofile"], terminal=size, env={"PS1": PROMPT.decode()}
    )
    screen = Screen(proc)
    await screen.until(PROMPT)
    return proc, screen


async def show(proc, screen: Screen, expr: str) -> bytes:
    """Type ``echo "<<EXPR>>"`` at the shell; what it printed between the brackets
    (the echo of the typed line has a quote after the ``>>``, the output does not)."""
    await proc.write(f'echo "<<{expr}>>"\n')
    return (await screen.until(b">>\r\n")).rpartition(b"<<")[2]


async def test_tty_names_a_pts_and_both_streams_share_it(engine):
    info = await engine.create()
    proc = await engine.spawn(
        info.id, "tty; stty size; echo out; echo err >&2; echo $TERM; exit 3",
        terminal=TerminalSize(30, 100),
    )
    assert proc.info()["pty"] is True and (proc.info()["rows"], proc.info()["cols"]) == (30, 100)
    screen = Screen(proc)
    result = await screen.exit()
    # The terminal's output processing turns \n into \r\n, as on any terminal.
    assert screen.text.split(b"\r\n") == [b"/dev/pts/0", b"30 100", b"out", b"err", b"xterm", b""]
    assert result.returncode == 3 and result.stderr == b""
    # Without pty: pipes, no terminal.
    plain = await engine.spawn(info.id, "tty; echo $TERM")
    result = await plain.wait()
    assert result.stdout == b"not a tty\n\n" and result.returncode == 0
    assert plain.info()["pty"] is False and plain.info()["rows"] is None


async def test_resize_reaches_stty_and_the_foreground_job(engine):
    info = await engine.create()
    proc, screen = await shell(engine, info.id)
    assert await show(proc, screen, "$(stty size)") == b"24 80"
    proc.resize(40, 120)  # in order with the input that follows it
    assert proc.terminal == TerminalSize(40, 120) and proc.info()["cols"] == 120
    assert await show(proc, screen, "$(stty size)") == b"40 120"
    watch = (  # SIGWINCH blocked and waited for: printing from a handler could reenter print
        "import os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGWINCH]); "
        "print('watch' + 'ing', flush=True); "
        "[print('winch', *os.get_terminal_size(0), flush=True) "
        "for _ in iter(lambda: signal.sigwait([signal.SIGWINCH]), None)]"
    )
    await proc.write(f'python3 -c "{watch}"\n')
    await screen.until(b"watching\r\n")
    proc.resize(50, 70)  # no input: SIGWINCH alone tells the job
    assert await screen.until(b"\r\n") == b"winch 70 50"
    await proc.write(b"\x1c")  # Ctrl-\\: SIGQUIT (SIGINT would wait for the sigwait)
    assert await show(proc, screen, "$?") == b"131"
    await proc.write("exit\n")
    assert (await screen.exit()).returncode == 0


async def test_ctrl_c_interrupts_the_foreground_job_and_the_shell_survives(engine):
    info = await engine.create()
    proc, screen = await shell(engine, info.id)
    # The job announces itself once it is the foreground job (the typed line echoes
    # "zz$((1+1))", the job prints "zz2"), so the Ctrl-C cannot reach the shell first.
    await proc.write("sh -c 'echo zz$((1+1)); exec sleep 100'\n")
    await screen.until(b"zz2\r\n")
    await proc.write(b"\x03")  # through the line discipline: SIGINT to the foreground job
    assert await show(proc, screen, "$?") == b"130"  # 128 + SIGINT
    assert proc.state.value == "running"
    await proc.write("exit 7\n")
    result = await screen.exit()
    assert result.returncode == 7 and not result.timed_out


async def test_closing_stdin_types_eof_and_ends_the_shell(engine):
    info = await engine.create()
    proc, screen = await shell(engine, info.id)
    await proc.close_stdin()
    assert (await screen.exit()).returncode == 0
    # A program reading lines gets end-of-file after what was typed.
    proc = await engine.spawn(info.id, ["python3", "-c", "import sys; print(len(sys.stdin.read()))"],
                              terminal=TerminalSize())
    screen = Screen(proc)
    await proc.write("abc\n")
    await proc.close_stdin()
    result = await screen.exit()
    assert result.returncode == 0 and screen.text.endswith(b"\r\n4\r\n")


async def test_signal_and_timeout_reach_the_terminals_session(engine):
    info = await engine.create()
    proc, screen = await shell(engine, info.id)
    assert proc.signal("SIGKILL")
    assert (await screen.exit()).returncode == -signal.SIGKILL
    proc = await engine.spawn(info.id, ["sleep", "60"], terminal=TerminalSize(), timeout=0.3)
    result = await proc.wait()
    assert result.timed_out and result.returncode == -signal.SIGKILL


async def test_resize_and_size_are_checked(engine):
    info = await engine.create()
    for rows, cols in ((0, 80), (24, 0), (MAX_SIDE + 1, 80), (True, 80), (24, 8.5)):
        with pytest.raises(InvalidArgument, match="terminal's"):
            await engine.spawn(info.id, ["true"], terminal=TerminalSize(rows, cols))
    plain = await engine.spawn(info.id, ["cat"])
    with pytest.raises(InvalidState, match="not started on a terminal"):
        plain.resize(24, 80)
    await plain.kill()
    proc = await engine.spawn(info.id, ["true"], terminal=TerminalSize())
    await proc.wait()
    with pytest.raises(InvalidState, match="has exited"):
        proc.resize(24, 80)
    proc = await engine.spawn(info.id, ["cat"], terminal=TerminalSize())
    with pytest.raises(InvalidArgument):
        proc.resize(0, 10)
    assert proc.terminal == TerminalSize()
    await proc.kill()
