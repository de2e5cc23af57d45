"""``corral shell`` and ``corral exec -i/-t``: a process in a sandbox, driven from here.

``-t`` runs the command on a pseudo-terminal inside the sandbox (``sb.spawn(...,
pty=True)``) sized like this terminal, and puts this terminal in raw mode: every key,
Ctrl-C included, goes to the sandbox's terminal, whose line discipline makes Ctrl-C a
SIGINT for the job in the foreground there. A resized window is passed on (SIGWINCH
here, a resize there; the size is also checked before each input is sent, so what is
typed after a resize sees the new size). The terminal is restored on the way out,
whatever ends the command. ``-t`` needs a terminal on stdin and refuses to start
without one (use ``-i`` alone to pipe input): raw mode, the size and SIGWINCH all come
from it, and degrading silently would run a shell that nobody can see prompts of.

``-i`` forwards this process's stdin as it comes (end of input closes the command's
stdin; on a terminal, that types Ctrl-D there). Without ``-t``, stdout and stderr stay
apart and Ctrl-C here kills the command.

Input is read on a thread of its own (the main thread reads the output stream), which
also sends the resizes: input and resizes leave in the order they happened.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from typing import Any

import corral
from corral.cli import _exec
from corral.cli._exec import exit_status
from corral.cli._output import Context, UsageError

DEFAULT_SHELL = "command -v bash >/dev/null 2>&1 && exec bash || exec sh"
"""What ``corral shell`` runs without a command: bash if the image has it, else sh."""
READ_SIZE = 65536
STOP_WAIT_S = 5.0  # how long the main thread waits for the input thread to notice the end


def exec_command(args: argparse.Namespace, ctx: Context) -> int:
    """``corral exec``: with ``-i``/``-t`` driven from here, else :func:`_exec.exec_command`."""
    if not (args.interactive or args.tty):
        return _exec.exec_command(args, ctx)
    if args.stdin_file is not None:
        raise UsageError("-i and -t send stdin as it comes: drop --stdin-file (or -i/-t)")
    return run(ctx, args.id, _command(args.cmd), terminal=args.tty, interactive=args.interactive,
               env=args.env, cwd=args.cwd, timeout=args.timeout, verb="exec", user=args.user)


def shell_command(args: argparse.Namespace, ctx: Context) -> int:
    """``corral shell ID [-- CMD...]``: an interactive shell (or CMD, one argument
    through ``/bin/sh -c`` as for ``exec``) on a terminal."""
    cmd = _command(args.cmd) if args.cmd else ["/bin/sh", "-c", DEFAULT_SHELL]
    return run(ctx, args.id, cmd, terminal=True, interactive=True, env=args.env,
               cwd=args.cwd, timeout=None, verb="shell", user=args.user)


def _command(words: list[str]) -> str | list[str]:
    return _exec.command_of(words)


def run(
    ctx: Context, sandbox_id: str, cmd: str | list[str], *, terminal: bool, interactive: bool,
    env: dict[str, str] | None, cwd: str | None, timeout: float | None, verb: str,
    user: str | None = None,
) -> int:
    """Run ``cmd`` as a process of the sandbox, wired to this terminal; its exit status."""
    fd = sys.stdin.fileno()
    options: dict[str, Any] = {}
    if terminal:
        if not os.isatty(fd):
            hint = ("corral exec -i ID -- sh" if verb == "shell" else "-i without -t")
            raise UsageError(
                f"stdin is not a terminal, and -t needs one (for raw mode, its size and "
                f"resizes): run it from a terminal, or pipe input with {hint}"
            )
        rows, cols = _size(fd)
        options = {"pty": True, "rows": rows, "cols": cols}
        env = dict(env or {})
        if os.environ.get("TERM") and "TERM" not in env:
            env["TERM"] = os.environ["TERM"]  # what this terminal understands
    sandbox = corral.Sandbox.connect(sandbox_id, client=ctx.client)
    proc = sandbox.spawn(cmd, env=env or None, cwd=cwd, timeout=timeout, text=False, user=user,
                         **options)
    with proc, _raw(fd, terminal and interactive), _hangup_exits():
        feeder = _Input(proc, fd if interactive else None, terminal)
        feeder.start()
        try:
            for chunk in proc.chunks():
                _write(sys.stdout if chunk.stream == "stdout" else sys.stderr, chunk.data)
        finally:
            feeder.stop()
        result = proc.result
    assert result is not None
    return exit_status(result, sandbox, timeout, ctx.output)


def _size(fd: int) -> tuple[int, int]:
    size = os.get_terminal_size(fd)
    return max(1, size.lines), max(1, size.columns)  # a fresh pty may say 0 x 0


def _write(stream: Any, data: bytes) -> None:
    stream.buffer.write(data)
    stream.flush()


@contextlib.contextmanager
def _raw(fd: int, enable: bool) -> Iterator[None]:
    """This terminal in raw mode (keys unprocessed, no echo) until the block ends."""
    if not enable:
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class _Hangup(SystemExit):
    """SIGHUP or SIGTERM here: leave (killing the command, restoring the terminal)."""


@contextlib.contextmanager
def _hangup_exits() -> Iterator[None]:
    def leave(signum: int, _frame: object) -> None:
        raise _Hangup(128 + signum)

    saved = {sig: signal.signal(sig, leave) for sig in (signal.SIGHUP, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _quietly(call: Any, *args: Any) -> None:
    """Send something to the process; if it is refused (a paused sandbox) or too late
    (it ended), drop it: the output stream tells the main thread how the command ended."""
    with contextlib.suppress(corral.CorralError):
        call(*args)


class _Input(threading.Thread):
    """Sends stdin (if ``fd``) and the terminal's size (if ``terminal``) to ``proc``."""

    def __init__(self, proc: corral.Process, fd: int | None, terminal: bool) -> None:
        super().__init__(name="corral-input", daemon=True)
        self.proc = proc
        self.fd = fd
        self.terminal = terminal
        self.sent_size = _size(sys.stdin.fileno()) if terminal else None
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stopping = False
        self.saved_winch: Any = None
        if terminal:  # handlers can only be set from the main thread: here
            self.saved_winch = signal.signal(signal.SIGWINCH, self._wake)

    def _wake(self, *_: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake_w, b"w")

    def run(self) -> None:
        watched = [self.wake_r] + ([self.fd] if self.fd is not None else [])
        while not self.stopping:
            ready, _, _ = select.select(watched, [], [])
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 512)
            if self.stopping:
                return
            data = b""
            if self.fd is not None and self.fd in ready:
                try:
                    data = os.read(self.fd, READ_SIZE)
                except OSError:  # EIO: this terminal hung up
                    pass
                if not data:
                    watched.remove(self.fd)
            if self.terminal:
                _quietly(self._send_size)
            if data:
                _quietly(self.proc.write, data)
            elif self.fd is not None and self.fd not in watched:
                self.fd = None
                _quietly(self.proc.close_stdin)

    def _send_size(self) -> None:
        try:
            size = _size(sys.stdin.fileno())
        except OSError:
            return
        if size != self.sent_size:
            self.proc.resize(*size)
            self.sent_size = size

    def stop(self) -> None:
        self.stopping = True
        self._wake()
        self.join(STOP_WAIT_S)
        if self.terminal:
            signal.signal(signal.SIGWINCH, self.saved_winch)
        if not self.is_alive():  # else it is stuck in a request: leave it its pipe
            os.close(self.wake_r)
            os.close(self.wake_w)
