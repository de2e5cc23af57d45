"""``corral shell`` and ``corral exec -i/-t``, driven through a real pseudo-terminal.

The test is the user: it owns the master of a pty whose slave is the CLI's controlling
terminal (stdin, stdout, stderr), types into it, resizes it (the kernel sends the CLI
SIGWINCH) and reads what the CLI prints, against the shared test daemon.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

import corral
from tests.conftest import requires_root

pytestmark = requires_root

SAFETY_S = 60  # only so that a broken build fails instead of hanging: never reached


class Terminal:
    """The user's side of a pty running ``corral ARGS...`` as its session leader."""

    def __init__(self, daemon, *args: str, rows: int, cols: int) -> None:
        self.master, self.slave = os.openpty()  # the slave kept: its modes stay readable
        self.resize(rows, cols)
        self.cooked = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "corral.cli.main", "--url", daemon.url, *args],
            stdin=self.slave, stdout=self.slave, stderr=self.slave, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # after setsid
        )
        self.text = b""

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, data: bytes | str) -> None:
        os.write(self.master, data.encode() if isinstance(data, str) else data)

    def until(self, marker: bytes) -> bytes:
        """Read until ``marker``; what came before it (both consumed)."""
        deadline = time.monotonic() + SAFETY_S
        while marker not in self.text:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.master], [], [], max(0.0, left))
            assert ready, f"no {marker!r} in {self.text!r}"
            self.text += os.read(self.master, 65536)
        before, _, self.text = self.text.partition(marker)
        return before

    def show(self, expr: str) -> bytes:
        """Type ``echo "<<EXPR>>"`` at the remote shell; what it printed between the
        brackets (the typed line's echo has a quote after ``>>``, the output does not)."""
        self.type(f'echo "<<{expr}>>"\r')
        return self.until(b">>\r\n").rpartition(b"<<")[2]

    def raw(self) -> bool:
        """Is the terminal in raw mode (no echo, no line editing, no Ctrl-C signal)?"""
        return termios.tcgetattr(self.slave)[3] & (termios.ECHO | termios.ICANON | termios.ISIG) == 0

    def wait(self) -> int:
        """The CLI's exit status; it must have given the terminal back as it found it."""
        code = self.proc.wait(SAFETY_S)
        assert termios.tcgetattr(self.slave) == self.cooked
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminal(daemon):
    started: list[Terminal] = []

    def start(*args: str, rows: int = 24, cols: int = 80) -> Terminal:
        term = Terminal(daemon, *args, rows=rows, cols=cols)
        started.append(term)
        return term

    yield start
    for term in started:
        term.close()


def test_shell_sizes_resizes_interrupts_and_exits_with_the_status(terminal, sandbox):
    term = terminal("shell", sandbox.id, rows=30, cols=100)
    term.until(b"$ ")  # the remote prompt: the CLI is attached, this terminal raw
    assert term.raw()
    assert term.show("$(tty) $(stty size) $TERM") == b"/dev/pts/0 30 100 " + os.environ.get(
        "TERM", "xterm").encode()
    # A resize here: SIGWINCH for the CLI, which passes the size on before anything
    # typed after it.
    term.resize(40, 120)
    assert term.show("$(stty size)") == b"40 120"
    # SIGWINCH alone, nothing typed: the job in the sandbox's foreground is told.
    term.type(
        "python3 -c \"import os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, "
        "[signal.SIGWINCH]); print('watch' + 'ing', flush=True); "
        "[print('winch', *os.get_terminal_size(0), flush=True) "
        "for _ in iter(lambda: signal.sigwait([signal.SIGWINCH]), None)]\"\r"
    )
    term.until(b"watching\r\n")
    term.resize(50, 70)
    assert term.until(b"\r\n") == b"winch 70 50"
    term.type(b"\x1c")  # Ctrl-\: SIGQUIT there
    assert term.show("$?") == b"131"
    # Ctrl-C is a byte for the sandbox's terminal: it interrupts the job, not the CLI.
    term.type("sh -c 'echo zz$((1+1)); exec sleep 100'\r")
    term.until(b"zz2\r\n")
    term.type(b"\x03")
    assert term.show("$?") == b"130"
    assert term.proc.poll() is None  # the CLI and the shell live on
    term.type("exit 3\r")
    assert term.wait() == 3  # and the terminal is cooked again


def test_exec_it_types_and_restores_the_terminal_even_on_error(terminal, sandbox, client):
    term = terminal("exec", "-it", sandbox.id, "--", "sh", "-c",
                    "stty size; read x; echo got $x; exit 5", rows=20, cols=60)
    term.until(b"20 60\r\n")
    term.type("hello\r")
    assert term.until(b"\r\n") == b"hello"  # the remote terminal's echo
    assert term.until(b"\r\n") == b"got hello"
    assert term.wait() == 5
    # Ctrl-D (end of input) at a shell prompt ends it.
    term = terminal("shell", sandbox.id, "--", "sh")
    term.until(b"$ ")
    term.type(b"\x04")
    assert term.wait() == 0
    # The sandbox ends under the CLI: an error, and the terminal is still restored.
    doomed = corral.Sandbox.create(memory_mb=64, client=client)
    term = terminal("shell", doomed.id)
    term.until(b"$ ")
    assert term.raw()
    doomed.delete()
    term.until(b"corral: ")
    assert term.wait() == 1
    assert b"sandbox" in term.text, term.text


def test_exec_i_pipes_input_and_t_needs_a_terminal(cli_process, sandbox):
    r = cli_process("exec", "-i", sandbox.id, "--", "sh", "-c",
                    "cat; echo err >&2; exit 4", input="one\ntwo\n")
    assert (r.code, r.out, r.err) == (4, "one\ntwo\n", "err\n")
    r = cli_process("exec", "-it", sandbox.id, "--", "true", input="")
    assert r.code == 2 and "stdin is not a terminal" in r.err and "-i without -t" in r.err
    r = cli_process("shell", sandbox.id, input="")
    assert r.code == 2 and "corral exec -i ID -- sh" in r.err
    r = cli_process("exec", "-i", "--stdin-file", "-", sandbox.id, "--", "true", input="")
    assert r.code == 2 and "drop --stdin-file" in r.err
