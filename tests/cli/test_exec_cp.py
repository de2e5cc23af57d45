"""exec (streamed output, exit statuses) and cp (both ways, files and directories)."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

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
    # The same kill inside a shell (which then exits 137 itself) is still an OOM.
    r = cli_process("exec", sandbox.id, "--", "true; python3 -c 'b = bytearray(512 << 20)'")
    assert r.code == 137 and "ran out of memory" in r.err, r.err


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


def test_cp_shows_progress_on_a_terminal_only(cli, sandbox, tmp_path, monkeypatch):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(9 << 20))  # past PROGRESS_BYTES
    quiet = cli("cp", str(big), f"{sandbox.id}:/workspace/")
    assert (quiet.code, quiet.err) == (0, "")  # stderr no terminal: nothing
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: stderr is a terminal
    up = cli("cp", str(big), f"{sandbox.id}:/workspace/again.bin")
    assert up.code == 0 and f"big.bin -> {sandbox.id}" in up.err and "MB" in up.err
    down = cli("cp", f"{sandbox.id}:/workspace/again.bin", str(tmp_path / "b"))
    assert down.code == 0 and f"{sandbox.id}:again.bin" in down.err
    assert (tmp_path / "b").read_bytes() == big.read_bytes()


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


def test_cp_copies_symlinks_as_links_and_never_follows_them(cli, sandbox, tmp_path):
    # A virtualenv's layout: absolute links (bin/python), relative ones, links out.
    sandbox.exec(
        "mkdir -p /workspace/venv/bin /workspace/venv/lib && echo hi > /workspace/venv/lib/f && "
        "ln -s /usr/bin/python3 /workspace/venv/bin/python && "
        "ln -s ../lib/f /workspace/venv/bin/rel && ln -s ../../.. /workspace/venv/up",
        check=True,
    )
    r = cli("cp", f"{sandbox.id}:/workspace/venv", str(tmp_path / "venv"))
    assert (r.code, r.err) == (0, "")
    venv = tmp_path / "venv"
    assert os.readlink(venv / "bin/python") == "/usr/bin/python3"
    assert os.readlink(venv / "bin/rel") == "../lib/f" and (venv / "bin/rel").read_text() == "hi\n"
    assert os.readlink(venv / "up") == "../../.."
    assert sorted(os.listdir(tmp_path)) == ["venv"]  # no staging directory left

    # and back in: the links arrive as links
    assert cli("cp", str(venv), f"{sandbox.id}:/workspace/again").code == 0
    assert sandbox.exec("readlink /workspace/again/bin/python").stdout == "/usr/bin/python3\n"


def test_cp_out_of_a_sandbox_leaves_nothing_when_it_fails(cli, sandbox, tmp_path):
    # Files first, then a FIFO, which the host refuses to create: the copy fails part
    # way through, and must not leave the files it had unpacked.
    sandbox.exec("mkdir -p /workspace/d && for i in 1 2 3; do echo $i > /workspace/d/a$i; done "
                 "&& mkfifo /workspace/d/zz-fifo", check=True)
    r = cli("cp", f"{sandbox.id}:/workspace/d", str(tmp_path / "d"))
    assert r.code == 1 and r.err.startswith(f"corral: sandbox {sandbox.id}: refused to unpack")
    assert "nothing was written" in r.err
    assert os.listdir(tmp_path) == []


def test_cp_never_writes_through_a_link_the_copy_made(tmp_path):
    # What a hostile sandbox could send instead of tar's output: a link out of the
    # copy, then a file "inside" that link.
    import io
    import tarfile

    from corral.client._tree import keep_symlinks

    outside = tmp_path / "outside"
    outside.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        link = tarfile.TarInfo("escape")
        link.type, link.linkname = tarfile.SYMTYPE, str(outside)
        tar.addfile(link)
        evil = tarfile.TarInfo("escape/pwned")
        evil.size = 3
        tar.addfile(evil, io.BytesIO(b"bad"))
    dest = tmp_path / "dest"
    dest.mkdir()
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar, pytest.raises(tarfile.FilterError):
        tar.extractall(dest, filter=keep_symlinks)
    assert os.listdir(outside) == []
    assert os.readlink(dest / "escape") == str(outside)


def test_cp_refuses_to_merge_into_an_existing_directory(cli, sandbox, tmp_path):
    sandbox.exec("mkdir -p /workspace/d && echo new > /workspace/d/f", check=True)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine").write_text("keep")
    r = cli("cp", f"{sandbox.id}:/workspace/d", str(tmp_path))  # would be tmp_path/d
    assert r.code == 1 and "exists" in r.err
    assert os.listdir(tmp_path / "d") == ["mine"]


@pytest.mark.parametrize("value", ["0", "1e12", "nan"])
def test_exec_timeout_is_refused_out_of_range(cli_process, sandbox, value):
    r = cli_process("exec", sandbox.id, "--timeout", value, "--", "true")
    assert r.code == 2 and "expected seconds > 0 and <= 2592000 (or 'none' for no limit)" in r.err


def test_exec_timeout_none_means_no_limit(cli, sandbox):
    assert cli("exec", sandbox.id, "--timeout", "none", "--", "echo ok").out == "ok\n"


def test_exec_marks_where_output_was_left_out(cli_process, daemon, sandbox):
    """A stream over --max-output: its head, a marker line (stderr, in order with the
    output), its tail, and a summary; the tail is there by default (issue 13.5)."""
    from corral.cli._exec import size

    out = "".join(f"{i}\n" for i in range(1, 100_001))
    dropped = len(out) - 1001
    argv = ["exec", sandbox.id, "--max-output", "1001", "--output-tail", "100", "--", "seq 1 100000"]
    r = cli_process(*argv)
    assert r.code == 0 and r.out == out[:901] + out[-100:]
    marker = f"corral: [... {size(dropped)} of stdout left out here; its last 100 bytes follow ...]\n"
    summary = (f"corral: {sandbox.id}: stdout was cut: its first 901 bytes and its last 100 bytes "
               f"were kept, {size(dropped)} in between left out\n")
    assert r.err == marker + summary
    # One terminal for both streams: the marker sits on a line of its own, between them
    # (the head ends inside a line).
    merged = subprocess.run(
        [sys.executable, "-m", "corral.cli.main", "--url", daemon.url, *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    ).stdout
    assert out[900] != "\n" and merged == out[:901] + "\n" + marker + out[-100:] + summary

    r = cli_process("exec", sandbox.id, "--max-output", "1K", "--output-tail", "0", "--", "seq 1 100000")
    assert r.out == out[:1024]
    assert r.err == (f"corral: [... {size(len(out) - 1024)} of stdout left out here ...]\n"
                     f"corral: {sandbox.id}: stdout was cut after its first 1.0 KiB (1024 bytes): "
                     f"{size(len(out) - 1024)} left out\n")

    r = cli_process("exec", sandbox.id, "--", "head -c 3000000 /dev/zero | tr '\\0' x; echo VERDICT")
    assert r.code == 0 and len(r.out) == 1 << 20 and r.out.endswith("xxVERDICT\n")
