"""What the CLI does without a daemon: parsing, formatting, errors before any request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from corral.cli._copy import parse_remote
from corral.cli._output import humanize_age
from corral.cli.main import build_parser, main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corral.cli.main", *args],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")},
    )


def test_humanize_age():
    assert [humanize_age(s) for s in (-1, 0, 59, 60, 3599, 3600, 86399, 86400 * 3)] == [
        "0s", "0s", "59s", "1m", "59m", "1h", "23h", "3d",
    ]


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("sb-1a2b:/app/x.py", ("sb-1a2b", "/app/x.py")),
        ("sb-1a2b:rel/x", ("sb-1a2b", "rel/x")),
        ("sb-1a2b:", ("sb-1a2b", ".")),
        ("/tmp/a:b", None),
        ("./a:b", None),
        ("file.txt", None),
        ("-", None),
    ],
)
def test_parse_remote(arg, expected):
    assert parse_remote(arg) == expected


def test_global_options_go_before_or_after_the_command():
    parser = build_parser()
    before = parser.parse_args(["--url", "unix:///a.sock", "--token", "t", "ls"])
    after = parser.parse_args(["ls", "--url", "unix:///a.sock", "--token", "t"])
    neither = parser.parse_args(["ls"])
    assert (before.url, before.client_token) == (after.url, after.client_token) == ("unix:///a.sock", "t")
    assert (neither.url, neither.client_token) == (None, None)


def test_exec_takes_a_shell_string_or_argv():
    parser = build_parser()
    one = parser.parse_args(["exec", "sb-1", "--timeout", "5", "--", "echo $HOME | wc -c"])
    argv = parser.parse_args(["exec", "sb-1", "--env", "A=1", "--", "ls", "-la", "--", "x"])
    assert one.cmd == ["echo $HOME | wc -c"] and one.timeout == 5.0
    assert argv.cmd == ["ls", "-la", "--", "x"] and argv.env == {"A": "1"}
    assert parser.parse_args(["exec", "sb-1", "--timeout", "none", "--", "x"]).timeout is None


def test_serve_takes_the_daemons_options():
    r = run("serve", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: corral serve")
    for option in ("--socket", "--state-dir", "--tcp", "--token", "--max-starting", "--idle-exit"):
        assert option in r.stdout
    r = run("serve", "--tcp", "127.0.0.1:0", "--socket", "/nonexistent/x.sock")
    assert r.returncode == 1 and r.stderr.startswith("corral: listening on TCP needs a bearer token")
    assert run("serve", "--no-such-option").returncode == 2


def test_unreachable_daemon_is_a_message(tmp_path):
    r = run("--url", f"unix://{tmp_path}/none.sock", "ls")
    assert r.returncode == 1 and r.stderr.startswith("corral: ") and "Traceback" not in r.stderr


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["create", "--env", "NOEQUALS"])
    assert exc.value.code == 2 and "NAME=VALUE" in capsys.readouterr().err
    assert main(["--url", "unix:///nonexistent.sock", "cp", "a", "b"]) == 2
    assert "one side of cp must be a sandbox path" in capsys.readouterr().err
    assert main(["--url", "unix:///nonexistent.sock", "create", "-n", "0"]) == 2


def test_rich_is_loaded_only_to_print_through_it():
    """Every ``corral`` call imports the CLI: ``--help``, ``exec``, ``cp`` and ``rm`` never
    print a table or a bar, so they do not pay for rich (nor httpx's command line)."""
    probe = ("import sys; from corral.cli.main import build_parser; build_parser(); "
             "from corral.cli._output import Output; Output().err; "
             "print(sorted(m for m in ('rich.table', 'rich.progress', 'click', 'pygments') "
             "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
