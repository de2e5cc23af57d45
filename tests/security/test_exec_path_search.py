"""Attack on the agent's own PATH search (agent/exec.c: exec_path, written when the agent
moved to musl, whose execvp differs from glibc's): hostile PATHs and names must run
exactly what glibc's ``execvp`` runs — the image's ``env`` (glibc) is the reference,
given the same PATH in the same sandbox — and never crash or wedge the agent.

Cases: empty and relative entries (glibc: the working directory, and relative to it),
an entry longer than PATH_MAX, a regular file as an entry (ENOTDIR), a file without its
x bit ahead of the right one, a name longer than the search buffer, a 64 KiB PATH of
2,000 entries, and a script without ``#!`` whose arguments look like shell options
(``/bin/sh FILE -c CMD`` runs FILE, never CMD)."""

from __future__ import annotations

import pytest

import corral
from tests.conftest import requires_root

pytestmark = requires_root

SETUP = ("mkdir -p /tmp/p/bin /tmp/p/locked && cd /tmp/p"
         " && printf 'echo plain \"$@\"\\n' > bin/plain && chmod +x bin/plain"
         " && cp bin/plain locked/plain && chmod 0644 locked/plain && : > notadir")

LONG = "/" + "a" * 5000
MANY = ":".join(f"/nonexistent/{i:04d}/{'d' * 20}" for i in range(2000))
CASES = [  # (PATH, cwd, argv)
    ("::/nowhere", "/tmp/p/bin", ["plain", "x"]),  # empty entry: the working directory
    ("bin", "/tmp/p", ["plain", "x"]),  # relative entry
    ("nope:.", "/tmp/p/bin", ["plain"]),
    (f"{LONG}:/tmp/p/bin", "/tmp", ["plain", "y"]),
    ("/tmp/p/notadir:/tmp/p/bin", "/tmp", ["plain"]),
    ("/tmp/p/locked:/tmp/p/bin", "/tmp", ["plain"]),  # no x bit: passed over
    ("/tmp/p/locked", "/tmp", ["plain"]),  # ... and reported when nothing else ran
    ("/tmp/p/bin", "/tmp", ["a" * 5000]),
    (f"{MANY}:/tmp/p/bin", "/tmp", ["plain", "z"]),
    ("/tmp/p/bin", "/tmp", ["plain", "-c", "echo injected"]),
    ("/tmp/p/bin", "/tmp", ["/tmp/p/bin/plain", "-c", "echo injected"]),
    ("", "/tmp/p/bin", ["plain"]),  # PATH set but empty: the working directory
]


@pytest.fixture(scope="module")
def sb(daemon):
    with corral.Client(daemon.url) as c:
        box = corral.Sandbox.create(client=c)
        try:
            assert box.exec(["sh", "-c", SETUP]).returncode == 0
            yield box
        finally:
            box.delete()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_agent_finds_commands_as_glibc_execvp_does(sb, case):
    path, cwd, argv = CASES[case]
    ours = sb.exec(argv, env={"PATH": path}, cwd=cwd, timeout=30)
    ref = sb.exec(["/usr/bin/env", f"PATH={path}", *argv], cwd=cwd, timeout=30)
    assert (ours.returncode, ours.stdout) == (ref.returncode, ref.stdout), (ours.stderr, ref.stderr)
    assert "injected" not in ours.stdout.splitlines()  # CMD never ran as a command
    again = sb.exec(["sh", "-c", "echo alive"], timeout=30)  # the agent still serves
    assert (again.returncode, again.stdout) == (0, "alive\n")
