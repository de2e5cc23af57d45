"""Pseudo-terminals: nothing typed can be faked, and the daemon believes no terminal
frame it did not expect (issue 13).

- In a real sandbox: ``TIOCSTI`` (type into a terminal's input) and ``TIOCLINUX`` are
  refused by seccomp even on the process's own controlling terminal, where this host's
  kernel would allow ``TIOCSTI`` (``dev.tty.legacy_tiocsti=1``); a command without a
  terminal has no controlling terminal to reach; sandbox code that replaces or locks
  the terminal devices only breaks its own terminals, with a clear error.
- A hostile agent (the engine's real channel against crafted frames): stderr for a
  terminal, or a reply to a resize, is a protocol violation.
"""

from __future__ import annotations

import asyncio
import json

from corral.errors import SandboxProtocolError
from corral.runtime.protocol import Msg, Tag
from corral.runtime.terminal import TerminalSize
from tests.conftest import requires_root
from tests.security.conftest import assert_honest, run_json
from tests.security.test_daemon_distrust import fault_of, wire  # noqa: F401 (a fixture)

INJECT = r"""
import fcntl, json, os, termios
def attempt(fd, request, arg):
    try:
        fcntl.ioctl(fd, request, arg)
        return "allowed"
    except OSError as e:
        return e.errno
out = {
    "own_tty": os.ttyname(0),
    "tiocsti": attempt(0, termios.TIOCSTI, b"x"),
    "tioclinux": attempt(0, termios.TIOCLINUX, bytes([2]) + bytes(16)),  # TIOCL_SETSEL
}
# A terminal of its own making, as the controlling one of a child: the same answer.
master, slave = os.openpty()
pid = os.fork()
if pid == 0:
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    os._exit(1 if attempt(slave, termios.TIOCSTI, b"y") == 1 else 0)
out["child_tiocsti_eperm"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1
print(json.dumps(out), flush=True)
"""


@requires_root
async def test_no_sandbox_code_can_fake_typed_input(sandbox):
    engine, sid = sandbox
    proc = await engine.spawn(sid, ["python3", "-c", INJECT], terminal=TerminalSize())
    result = await proc.wait()
    assert result.returncode == 0, result.stdout
    text = result.stdout.decode()
    out = json.loads(text[text.index("{"):])  # an injected byte would be echoed before it
    assert out == {"own_tty": "/dev/pts/0", "tiocsti": 1, "tioclinux": 1,
                   "child_tiocsti_eperm": True}  # 1: EPERM, from the filter
    # A command without a terminal has no controlling one: no terminal outside the
    # sandbox (the daemon's, a user's) is reachable through /dev/tty.
    out = await run_json(engine, sid, (
        "import json, os\n"
        "try:\n    os.open('/dev/tty', os.O_RDWR); r = 'opened'\n"
        "except OSError as e:\n    r = e.errno\n"
        "print(json.dumps({'tty': r, 'isatty': [os.isatty(fd) for fd in (0, 1, 2)]}))\n"
    ))
    assert out == {"tty": 6, "isatty": [False, False, False]}  # ENXIO
    await assert_honest(engine, sid)


@requires_root
async def test_tampered_terminal_devices_break_only_the_sandboxs_own_terminals(sandbox):
    engine, sid = sandbox
    # /dev is read-only: /dev/ptmx cannot become a FIFO (an open would block on it),
    # and /dev/pts cannot be moved aside for a fake one. (Were it writable, the agent
    # opens the devpts mount's own ptmx and never blocks.)
    r = await engine.exec(sid, "rm /dev/ptmx || mkfifo /dev/ptmx2 || mv /dev/pts /dev/old")
    assert r.returncode != 0 and r.stderr.count(b"Read-only file system") == 3, r.stderr
    proc = await engine.spawn(sid, ["tty"], terminal=TerminalSize())
    assert (await proc.wait()).stdout == b"/dev/pts/0\r\n"
    r = await engine.exec(sid, "rmdir /dev/pts")  # a mount point
    assert r.returncode != 0, r.stderr
    # The devpts ptmx is root's (the launcher mounts the sandbox's devpts): the sandbox
    # cannot lock it to break later terminals (red team: it could).
    r = await engine.exec(sid, "chmod 000 /dev/pts/ptmx")
    assert r.returncode != 0 and b"not permitted" in r.stderr, r.stderr
    proc = await engine.spawn(sid, ["tty"], terminal=TerminalSize())
    assert (await proc.wait()).returncode == 0
    await assert_honest(engine, sid)


async def test_a_sandbox_holds_at_most_32_terminals(sandbox):
    """Every devpts on the host shares kernel.pty.max: the sandbox's own devpts is
    capped, so one sandbox cannot use them all up (red team: 300 were opened)."""
    engine, sid = sandbox
    script = (
        "import os\n"
        "fds = []\n"
        "try:\n"
        "    while len(fds) < 200:\n"
        "        fds.append(os.openpty())\n"
        "except OSError as e:\n"
        "    print(len(fds), e.errno)\n"
    )
    r = await engine.exec(sid, ["python3", "-c", script], timeout=60)
    assert r.stdout.split() == [b"32", b"28"], (r.stdout, r.stderr)  # ENOSPC at the cap
    proc = await engine.spawn(sid, ["tty"], terminal=TerminalSize())  # they were freed
    assert (await proc.wait()).returncode == 0


async def test_stderr_for_a_terminal_is_a_violation(wire):  # noqa: F811
    ch, agent, ends = wire
    stream = ch.open_exec([(Tag.ARGV, "sh"), (Tag.ROWS, 24), (Tag.COLS, 80)], terminal=True)
    msg, rid, fields = await asyncio.to_thread(agent.read_request)
    assert (msg, fields.u64(Tag.ROWS), fields.u64(Tag.COLS)) == (Msg.EXEC, 24, 80)
    agent.started(rid)
    agent.send(Msg.STDOUT, rid, [(Tag.DATA, b"$ ")])
    agent.send(Msg.STDERR, rid, [(Tag.DATA, b"forged")])
    assert (await stream.next()).msg == Msg.STARTED
    assert (await stream.next()).data == b"$ "
    error = await fault_of(ch, stream.next())
    assert error.details["violation"] == "stderr_on_terminal"
    assert "terminal" in ends[0]


async def test_a_reply_to_a_resize_is_a_violation(wire):  # noqa: F811
    ch, agent, _ = wire
    stream = ch.open_exec([(Tag.ARGV, "sh"), (Tag.ROWS, 24), (Tag.COLS, 80)], terminal=True)
    _, rid, _ = await asyncio.to_thread(agent.read_request)
    agent.started(rid)
    assert (await stream.next()).msg == Msg.STARTED
    stream.resize(50, 132)
    msg, resize_rid, fields = await asyncio.to_thread(agent.read_request)
    assert (msg, resize_rid) == (Msg.RESIZE, rid)
    assert (fields.u64(Tag.ROWS), fields.u64(Tag.COLS)) == (50, 132)
    agent.send(Msg.OK, rid)  # a resize has no reply: an agent inventing one is hostile
    error = await fault_of(ch, stream.next())
    assert isinstance(error, SandboxProtocolError)
    assert error.details["violation"] == "unexpected_reply"
