"""exec (streamed output, exit statuses) and cp (both ways, files and directories)."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import corral
from tests.conftest import requires_root

pytestmark = requires_root


def test_exec_separates_streams_and_propagates_the_exit_status(cli_process, sandbox):
    r = cli_process("exec", sandbox.id, "--", "echo out; echo err >&2; exit 3")
    assert (r.code, r.out, r.err) == (3, "out\n", "err\n")
    r = cli_process("exec", sandbox.id, "--", "python3", "-c", "import sys; print(sys.argv[1:])", "a b", "--x")
    assert (r.code, r.out) == (0, "['a b', '--x']\n")
    r = cli_process("exec", sandbox.id, "--", "sh", "-c", "kill -TERM $$")
    assert r.code == 128 + 15


def test_exec_timeout_exits_124(cli_process, sandbox):
    r = cli_process("exec", sandbox.id, "--timeout", "1", "--", "echo started; sleep 30")
    assert r.code == 124 and r.out == "started\n"
    assert r.err == f"corral: {sandbox.id}: the command timed out after 1 s and was killed\n"


def test_exec_oom_exits_137(cli_process, sandbox):
    r = cli_process("exec", sandbox.id, "--", "python3", "-c", "b = bytearray(512 << 20)")
    assert r.code == 137 and "ran out of memory" in r.err and "64 MB" in r.err


def test_exec_env_cwd_and_stdin(cli, cli_process, sandbox, tmp_path):
    r = cli_process(
        "exec", sandbox.id, "--env", "GREETING=hi", "--cwd", "/tmp", "--stdin-file", "-",
        "--", "echo $GREETING; pwd; cat", input="from stdin\n",
    )
    assert (r.code, r.out) == (0, "hi\n/tmp\nfrom stdin\n")
    data = tmp_path / "in.bin"
    data.write_bytes(b"\xff\x00binary")
    r = cli("exec", sandbox.id, "--stdin-file", str(data), "--", "od -An -c | tr -s ' '")
    assert r.code == 0 and r.out.split() == ["377", "\\0", "b", "i", "n", "a", "r", "y"]
    r = cli("exec", sandbox.id, "--stdin-file", str(tmp_path / "missing"), "--", "cat")
    assert r.code == 1 and r.err.startswith("corral: No such file or directory")


def test_exec_streams_output_while_the_command_runs(daemon, sandbox):
    # The command prints, then waits for a file that the test creates only after it
    # has read that first line: buffered output would never get there.
    script = "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second >&2; echo third"
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.cli.main", "--url", daemon.url,
         "exec", sandbox.id, "--timeout", "120", "--", script],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no output arrived while the command was running"
        assert proc.stdout.readline() == b"first\n"
        assert proc.poll() is None
        sandbox.files.write("/tmp/go", "")
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, out, err) == (0, b"third\n", b"second\n")


def test_cp_files_both_ways(cli, sandbox, tmp_path):
    src = tmp_path / "tool.sh"
    src.write_text("#!/bin/sh\necho tool\n")
    src.chmod(0o755)
    assert cli("cp", str(src), f"{sandbox.id}:/workspace/").code == 0  # into a directory
    assert cli("exec", sandbox.id, "--", "/workspace/tool.sh").out == "tool\n"
    assert cli("cp", str(src), f"{sandbox.id}:bin/renamed.sh").code == 0  # relative, new name
    assert sandbox.files.read("/workspace/bin/renamed.sh") == src.read_bytes()

    assert cli("cp", f"{sandbox.id}:/workspace/tool.sh", str(tmp_path / "back.sh")).code == 0
    back = tmp_path / "back.sh"
    assert back.read_bytes() == src.read_bytes() and back.stat().st_mode & 0o777 == 0o755
    out = tmp_path / "out"
    out.mkdir()
    assert cli("cp", f"{sandbox.id}:bin/renamed.sh", str(out)).code == 0
    assert (out / "renamed.sh").read_bytes() == src.read_bytes()

    assert cli("cp", f"{sandbox.id}:/workspace/tool.sh", "-").out == "#!/bin/sh\necho tool\n"


def test_cp_stdin_to_a_sandbox_file(cli_process, sandbox):
    r = cli_process("cp", "-", f"{sandbox.id}:/workspace/from-stdin.txt", input="piped\n")
    assert r.code == 0 and sandbox.files.read("/workspace/from-stdin.txt") == b"piped\n"


def test_cp_directories_both_ways(cli, sandbox, tmp_path):
    tree = tmp_path / "proj"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("X = 1\n")
    (tree / "README").write_text("hello\n")

    assert cli("cp", str(tree), f"{sandbox.id}:/workspace/app").code == 0  # new: becomes the copy
    assert cli("cp", str(tree), f"{sandbox.id}:/workspace/app").code == 0  # exists: goes inside
    listing = cli("exec", sandbox.id, "--", "cd /workspace/app && find . -type f | sort").out
    assert listing.split() == ["./README", "./pkg/mod.py", "./proj/README", "./proj/pkg/mod.py"]

    down = tmp_path / "down"
    assert cli("cp", f"{sandbox.id}:/workspace/app/pkg", str(down)).code == 0
    assert (down / "mod.py").read_text() == "X = 1\n"
    assert cli("cp", f"{sandbox.id}:/workspace/app/pkg", str(down)).code == 0
    assert (down / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert sandbox.exec("ls -A /tmp").stdout == ""  # no archive left behind


def test_cp_errors(cli, sandbox, tmp_path):
    r = cli("cp", f"{sandbox.id}:/nope", str(tmp_path / "x"))
    assert r.code == 1 and r.err.startswith("corral: no such file or directory in sandbox")
    r = cli("cp", str(tmp_path / "missing"), f"{sandbox.id}:/workspace/")
    assert r.code == 1 and r.err.startswith("corral: No such file or directory")
    r = cli("cp", f"{sandbox.id}:/workspace", "-")
    assert r.code == 2 and "is a directory" in r.err
    assert not os.path.exists(tmp_path / "x")
    assert sandbox.state == corral.SandboxState.RUNNING
