"""E2B scripts find what they expect (issue 25, item 11): commands start in
``/home/user``, relative file paths land there, and the Code
Interpreter runs IPython's ``!command`` lines. Real ``e2b`` / ``e2b-code-interpreter``
clients, a real daemon."""

from __future__ import annotations

import pytest

from tests.server.test_compat_e2b import run_script, serving

pytest.importorskip("e2b_code_interpreter", reason="the compat extra is not installed")


@pytest.fixture(scope="module")
def e2b():
    with serving() as d:
        yield d


def test_commands_and_files_start_in_home_user(e2b):
    out = run_script(e2b, """
        with Sandbox.create() as sb:
            out["where"] = sb.commands.run("pwd; touch mine; ls -ld .").stdout
            sb.files.write("notes.txt", "relative")
            out["read"] = sb.files.read("/home/user/notes.txt")
            out["ls"] = sorted(e.name for e in sb.files.list("/home/user"))
    """)
    pwd, listing = out["where"].splitlines()
    assert pwd == "/home/user"
    assert listing.startswith("drwx")  # the sandbox's user owns it: it could write there
    assert out["read"] == "relative"
    assert out["ls"] == ["mine", "notes.txt"]


def test_code_interpreter_runs_shell_lines(e2b):
    cell = "x = 6 * 7\n!echo shell says hi; echo to-err >&2\nfor i in range(2):\n    !echo loop\nx"
    out = run_script(e2b, f"""
        from e2b_code_interpreter import Sandbox as CodeSandbox
        with CodeSandbox.create() as sb:
            e = sb.run_code({cell!r})
            out["error"] = e.error and [e.error.name, e.error.value]
            out["stdout"] = "".join(e.logs.stdout)
            out["stderr"] = "".join(e.logs.stderr)
            out["text"] = e.text
            s = sb.run_code("s = '''\\n!not a command\\n'''\\nlen(s.splitlines())")
            out["string"] = s.text
    """)
    assert out["error"] is None
    assert out["stdout"] == "shell says hi\nloop\nloop\n"
    assert out["stderr"] == "to-err\n"
    assert out["text"] == "42"
    assert out["string"] == "2"  # a "!" line inside a string stays text
