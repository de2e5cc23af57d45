"""``corral exec ID -- /bin/hello`` runs the program itself, not a shell running it
(issue 25, item 9); a single argument with shell syntax is still a script."""

from __future__ import annotations

from corral.cli._exec import command_of
from tests.conftest import requires_root

# prints the pid of its parent: 1 (the sandbox's agent) when exec'd directly, a shell's
# pid when `sh -c` ran it
PPID = "#!/bin/sh\ncut -d' ' -f4 /proc/$$/stat\n"


def test_one_plain_word_is_argv_and_shell_syntax_is_a_script():
    assert command_of(["/bin/hello"]) == ["/bin/hello"]
    assert command_of(["ls"]) == ["ls"]
    assert command_of(["./run-tests.sh"]) == ["./run-tests.sh"]
    for script in ("echo out; exit 3", "ls *.py", "echo $HOME", "a|b", "x=1", "cd /tmp && ls",
                   "echo 'q'", "sleep 1 &", "f(){ :; }"):
        assert command_of([script]) == script, script
    assert command_of(["python3", "-c", "print(1)"]) == ["python3", "-c", "print(1)"]


@requires_root
def test_exec_runs_a_single_program_directly(cli, sandbox):
    sandbox.files.write("/workspace/ppid", PPID, mode=0o755)
    r = cli("exec", sandbox.id, "--", "/workspace/ppid")
    assert (r.code, r.out) == (0, "1\n"), r.err
    r = cli("exec", sandbox.id, "--", "/workspace/ppid; true")  # a script: sh is its parent
    assert r.code == 0 and r.out != "1\n"
    r = cli("exec", sandbox.id, "--", "/workspace/missing")
    assert r.code != 0 and "missing" in r.err
    r = cli("exec", sandbox.id, "--user", "root", "--", "id -u; id -u -n")  # docs/users.md
    assert (r.code, r.out) == (0, "0\nroot\n"), r.err
    r = cli("exec", "-u", "1234", sandbox.id, "--", "true")
    assert r.code != 0 and "sandbox user" in r.err
