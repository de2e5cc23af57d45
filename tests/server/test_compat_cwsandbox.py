"""The real ``cwsandbox`` client against a real daemon started with ``--grpc``.

Nothing here talks gRPC by hand: every call goes through the client a CoreWeave
Sandbox script would use, pointed at corral only by CWSANDBOX_BASE_URL and
CWSANDBOX_API_KEY.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import pytest

from corral.runtime.engine import Engine
from tests.conftest import Daemon, _base_dir, have_root_runtime, requires_root
from tests.server.conftest import free_port, uds_client

cwsandbox = pytest.importorskip("cwsandbox")
from cwsandbox import Sandbox, SandboxStatus  # noqa: E402
from cwsandbox.exceptions import (  # noqa: E402
    CWSandboxAuthenticationError,
    SandboxError,
    SandboxExecutionError,
    SandboxFileError,
    SandboxNotFoundError,
    SandboxResourceExhaustedError,
    SandboxTimeoutError,
    SandboxValidationError,
)

pytestmark = [requires_root, pytest.mark.root]

TOKEN = "cw-test-token"
SMALL = {"cpu": "500m", "memory": "64Mi"}  # the client's flat resources form
ECHO_LINES = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)\n"
PS = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError("the daemon's gRPC port did not open in time")


def _start(*args: str) -> tuple[Daemon, str]:
    port = free_port()
    daemon = Daemon(_base_dir(), ["--grpc", f"127.0.0.1:{port}", "--token", TOKEN, *args])
    daemon.start()
    assert daemon.proc is not None
    _wait_for_port(port, daemon.proc)
    return daemon, f"http://127.0.0.1:{port}"


def _no_traceback(daemon: Daemon, since: int) -> None:
    with open(daemon.log, "rb") as log:
        log.seek(since)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: see {daemon.log}"


@contextlib.contextmanager
def serving() -> Iterator[tuple[Daemon, str]]:
    """A daemon serving cwsandbox clients, the client's environment pointing at it, and
    its URL; removed afterwards (the tests are skipped without root)."""
    if not have_root_runtime():
        pytest.skip("needs root")
    daemon, url = _start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CWSANDBOX_BASE_URL", url)
            mp.setenv("CWSANDBOX_API_KEY", TOKEN)
            mp.setenv("CWSANDBOX_DISABLE_SIGNAL_HANDLERS", "1")  # leave pytest's signals alone
            yield daemon, url
    finally:
        daemon.stop()
        shutil.rmtree(daemon.base, ignore_errors=True)


@pytest.fixture(scope="module")
def cw_daemon():
    """One daemon serving cwsandbox clients, and the client's environment pointing at it."""
    with serving() as (daemon, _):
        yield daemon


@pytest.fixture
def cw(cw_daemon):
    """The shared daemon; it must log no traceback during the test."""
    since = cw_daemon.log.stat().st_size
    yield cw_daemon
    _no_traceback(cw_daemon, since)


@pytest.fixture
def tag():
    return f"cwtest-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sb(cw, tag):
    """A running sandbox, deleted afterwards."""
    sandbox = Sandbox.run(tags=[tag], resources=SMALL)
    sandbox.wait()
    yield sandbox
    Sandbox.delete(sandbox.sandbox_id, missing_ok=True).result()


def _processes(sandbox: Sandbox) -> str:
    return sandbox.exec(["sh", "-c", PS]).result().stdout


def _line(chunks) -> str:
    """The next line of a process's output (chunks arrive as the command writes them)."""
    text = ""
    while not text.endswith("\n"):
        text += next(chunks)
    return text


def _wait_gone(sandbox: Sandbox, marker: str) -> None:
    for _ in range(200):  # the kill follows the cancel asynchronously
        if marker not in _processes(sandbox):
            return
        time.sleep(0.05)
    raise AssertionError(f"{marker!r} still runs in the sandbox:\n{_processes(sandbox)}")


# --------------------------------------------------------------------- tests


def test_an_unmodified_script_runs(cw, tmp_path, tag):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        from cwsandbox import Sandbox, Session, SandboxDefaults

        with Sandbox.run(tags=["{tag}"]) as sb:
            result = sb.exec(["python", "-c", "import gymnasium, numpy; print('ok')"]).result()
            print("exec:", result.returncode, result.stdout.strip())
            sb.write_file("/workspace/note.txt", b"hello").result()
            print("read:", sb.read_file("/workspace/note.txt").result().decode())
            print("listed:", [s.sandbox_id for s in Sandbox.list(tags=["{tag}"]).result()]
                  == [sb.sandbox_id])
        print("status:", sb.status.value)

        with Session(SandboxDefaults(tags=("{tag}",))) as session:
            @session.function()
            def add(x, y):
                return x + y
            print("function:", add.remote(2, 3).result())
    """))
    env = {**os.environ}  # CWSANDBOX_BASE_URL / CWSANDBOX_API_KEY from the fixture
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "exec: 0 ok", "read: hello", "listed: True", "status: terminated", "function: 5",
    ]
    assert Sandbox.list(tags=[tag], show_terminated=False).result() == []


def test_create_is_a_real_corral_sandbox(cw, sb, tag):
    assert sb.status == SandboxStatus.RUNNING and sb.tags == (tag,)
    with uds_client(cw.socket) as native:
        got = native.get(f"/v1/sandboxes/{sb.sandbox_id}").json()
    assert got["state"] == "running" and got["spec"]["tags"] == [tag]
    assert got["spec"]["memory_mb"] == 64 and got["spec"]["cpus"] == 0.5
    assert got["spec"]["image"] == "rl"  # the client's default python:3.11 maps to it
    assert sb.resource_limits == {"cpu": "500m", "memory": "64Mi"}


def test_create_options_map_to_the_spec(cw, tag):
    sandbox = Sandbox.run(
        tags=[tag], resources={"requests": {"cpu": "1", "memory": "128Mi"},
                               "limits": {"cpu": "2", "memory": "0.25Gi"}},
        environment_variables={"GREETING": "hi"}, working_dir="/app", max_lifetime_seconds=600,
        mounted_files=[{"mount_path": "/app/cfg.json", "file_content": b'{"a": 1}'}],
    )
    try:
        out = sandbox.exec(["sh", "-c", "pwd; echo $GREETING; cat cfg.json"]).result().stdout
        assert out == '/app\nhi\n{"a": 1}'
        with uds_client(cw.socket) as native:
            spec = native.get(f"/v1/sandboxes/{sandbox.sandbox_id}").json()["spec"]
        assert (spec["cpus"], spec["memory_mb"], spec["timeout"]) == (2, 256, 600)
        assert spec["workdir"] == "/app" and spec["env"]["GREETING"] == "hi"
    finally:
        Sandbox.delete(sandbox.sandbox_id).result()


def test_exec_streams_output_and_exit_code(sb):
    proc = sb.exec(["sh", "-c", "echo first; echo oops >&2; "
                    "while [ ! -e /tmp/go ]; do sleep 0.02; done; echo second; exit 3"])
    assert _line(iter(proc.stdout)) == "first\n"  # it arrives while the command still waits
    assert proc.poll() is None
    sb.write_file("/tmp/go", b"").result()
    result = proc.result()
    assert (result.returncode, result.stdout, result.stderr) == (3, "first\nsecond\n", "oops\n")
    assert sb.exec(["sh", "-c", "kill -9 $$"]).result().returncode == 137  # 128 + SIGKILL
    with pytest.raises(SandboxExecutionError) as err:
        sb.exec(["false"], check=True).result()
    assert err.value.exec_result.returncode == 1
    missing = sb.exec(["no-such-program"]).result()
    assert missing.returncode == 127 and "no-such-program" in missing.stderr


def test_exec_timeout_kills_the_process(sb):
    with pytest.raises(SandboxTimeoutError):
        sb.exec(["sleep", "4242"], timeout_seconds=1).result()
    _wait_gone(sb, "sleep 4242")


def test_cancelled_exec_kills_the_process(sb):
    proc = sb.exec(["sh", "-c", "echo started; exec sleep 4343"])
    assert _line(iter(proc.stdout)) == "started\n"
    assert "sleep 4343" in _processes(sb)
    assert proc.cancel()
    _wait_gone(sb, "sleep 4343")


@pytest.mark.skipif(not hasattr(Engine, "spawn"), reason="needs the engine's interactive processes")
def test_stdin_streams_both_ways(sb):
    proc = sb.exec(["python3", "-u", "-c", ECHO_LINES], stdin=True, timeout_seconds=120)
    out = iter(proc.stdout)
    proc.stdin.write(b"ping\n").result()
    assert _line(out) == "got ping\n"  # answered before its stdin is closed
    proc.stdin.write(b"pong\n").result()
    proc.stdin.close().result()
    result = proc.result()
    assert result.returncode == 0 and result.stdout == "got ping\ngot pong\n"


def test_files_round_trip(sb):
    blob = bytes(range(256)) * 64
    sb.write_file("/workspace/deep/dir/blob.bin", blob).result()
    assert sb.read_file("/workspace/deep/dir/blob.bin").result() == blob
    assert sb.read_file("deep/dir/blob.bin").result() == blob  # relative to the workdir
    assert sb.exec(["wc", "-c", "/workspace/deep/dir/blob.bin"]).result().stdout.split()[0] == str(
        len(blob)
    )


def test_big_files_take_the_clients_stream_path(cw, tag):
    # Over the 32 MiB of one ReadFile/WriteFile the client streams through StreamExec
    # (`head -c N > file` fed by stdin, `cat file`). The agent holds stdin not yet read
    # in the sandbox's memory, hence more memory than the other tests' sandboxes.
    sandbox = Sandbox.run(tags=[tag], resources={"cpu": "1", "memory": "512Mi"})
    try:
        big = os.urandom(40 << 20)
        sandbox.write_file("/workspace/big.bin", big).result()
        assert sandbox.read_file("/workspace/big.bin").result() == big
    finally:
        Sandbox.delete(sandbox.sandbox_id).result()


def test_file_errors_are_the_clients(sb):
    with pytest.raises(SandboxFileError) as err:
        sb.read_file("/workspace/missing.txt").result()
    assert err.value.reason == "CWSANDBOX_FILE_NOT_FOUND"
    assert err.value.filepath == "/workspace/missing.txt"
    with pytest.raises(SandboxFileError) as err:
        sb.read_file("/workspace").result()
    assert err.value.reason == "CWSANDBOX_FILE_IS_DIRECTORY"
    with pytest.raises(SandboxFileError) as err:
        sb.write_file("/etc/forbidden", b"x").result()
    assert err.value.reason == "CWSANDBOX_FILE_PERMISSION_DENIED"
    assert "forbidden" not in sb.exec(["ls", "/etc"]).result().stdout
    with pytest.raises(SandboxValidationError):
        sb.read_file("/../escape").result()


def test_list_by_tags_and_state(cw, tag):
    other = f"{tag}-other"
    a = Sandbox.run(tags=[tag, "a"], resources=SMALL)
    b = Sandbox.run(tags=[tag], resources=SMALL)
    c = Sandbox.run(tags=[other], resources=SMALL)
    try:
        def ids(**kw):
            return {s.sandbox_id for s in Sandbox.list(**kw).result()}

        assert ids(tags=[tag]) == {a.sandbox_id, b.sandbox_id}
        assert ids(tags=[tag, "a"]) == {a.sandbox_id}
        assert ids(tags=[other], status="running") == {c.sandbox_id}
        b.stop().result()
        assert b.status == SandboxStatus.TERMINATED
        assert ids(tags=[tag]) == {a.sandbox_id}
        assert ids(tags=[tag], show_terminated=True) == {a.sandbox_id, b.sandbox_id}
        assert ids(tags=[tag], status="terminated") == {b.sandbox_id}
        assert ids(tags=[tag], status="running") == {a.sandbox_id}
        listed = {s.sandbox_id: s for s in Sandbox.list(tags=[tag]).result()}
        assert listed[a.sandbox_id].status == SandboxStatus.RUNNING
    finally:
        for s in (a, b, c):
            Sandbox.delete(s.sandbox_id, missing_ok=True).result()


def test_delete(cw, tag):
    sandbox = Sandbox.run(tags=[tag], resources=SMALL)
    sid = sandbox.sandbox_id
    attached = Sandbox.from_id(sid).result()
    Sandbox.delete(sid).result()
    with uds_client(cw.socket) as native:
        assert native.get(f"/v1/sandboxes/{sid}").status_code == 404  # gone from corral
    assert Sandbox.from_id(sid).result().status == SandboxStatus.TERMINATED
    with pytest.raises(SandboxNotFoundError):
        attached.exec(["true"]).result()
    Sandbox.delete(sid).result()  # deleting again is fine
    with pytest.raises(SandboxNotFoundError):
        Sandbox.delete("sb-000000000000").result()
    Sandbox.delete("sb-000000000000", missing_ok=True).result()
    with pytest.raises(SandboxNotFoundError):
        Sandbox.from_id("sb-000000000000").result()


def test_main_command_completes_with_its_exit_code(cw, tag):
    sandbox = Sandbox.run("sh", "-c", "exit 7", tags=[tag], resources=SMALL)
    try:
        sandbox.wait_until_complete(timeout=120).result()
        assert sandbox.status == SandboxStatus.COMPLETED and sandbox.returncode == 7
        assert Sandbox.list(tags=[tag], status="completed").result()[0].sandbox_id == (
            sandbox.sandbox_id
        )
    finally:
        Sandbox.delete(sandbox.sandbox_id, missing_ok=True).result()


def test_bad_input_gives_the_clients_errors(cw, sb, tag, monkeypatch):
    with pytest.raises(SandboxValidationError) as err:
        Sandbox.run(tags=["has space"])
    assert err.value.field_violations[0].field == "sandbox.spec.tags"
    with pytest.raises(SandboxValidationError):
        Sandbox.run(tags=[tag], resources={"cpu": "1", "memory": "8Mi"})
    with pytest.raises(SandboxError) as err:
        Sandbox.run(tags=[tag], services=[cwsandbox.Service(port=8080)])
    assert err.value.reason == "CWSANDBOX_NOT_IMPLEMENTED"
    with pytest.raises(SandboxValidationError):
        sb.exec(["true"], container="sidecar").result()
    assert Sandbox.list(tags=[tag]).result()[0].sandbox_id == sb.sandbox_id  # nothing leaked

    monkeypatch.setenv("CWSANDBOX_API_KEY", "not-the-token")
    with pytest.raises(CWSandboxAuthenticationError):
        Sandbox.list(tags=[tag]).result()
    monkeypatch.delenv("CWSANDBOX_API_KEY")
    with pytest.raises(CWSandboxAuthenticationError):
        Sandbox.from_id(sb.sandbox_id).result()


def test_fan_out_of_50_sandboxes(cw, tag):
    sandboxes = [Sandbox(tags=[tag], resources=SMALL) for _ in range(50)]
    started = time.monotonic()
    procs = [s.exec(["sh", "-c", f"echo {i}"]) for i, s in enumerate(sandboxes)]  # all at once
    results = [p.result() for p in procs]
    took = time.monotonic() - started
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(50)]
    ids = {s.sandbox_id for s in sandboxes}
    assert len(ids) == 50
    assert {s.sandbox_id for s in Sandbox.list(tags=[tag]).result()} == ids
    for stop in [s.stop() for s in sandboxes]:
        stop.result()
    assert Sandbox.list(tags=[tag]).result() == []
    print(f"50 sandboxes created and ran a command in {took:.2f} s")


def test_admission_control_and_image_mapping(make_daemon, monkeypatch, tag):
    monkeypatch.setenv("CORRAL_COMPAT_DEFAULT_IMAGE", "python")  # read by the daemon
    port = free_port()
    daemon = make_daemon("--grpc", f"127.0.0.1:{port}", "--token", TOKEN,
                         "--max-sandboxes", "1", "--queue-timeout", "0.5")
    _wait_for_port(port, daemon.proc)
    since = daemon.log.stat().st_size
    monkeypatch.setenv("CWSANDBOX_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("CWSANDBOX_API_KEY", TOKEN)
    monkeypatch.setenv("CWSANDBOX_DISABLE_SIGNAL_HANDLERS", "1")
    first = Sandbox.run(tags=[tag], resources=SMALL)  # python:3.11 -> the default, "python"
    no_gym = first.exec(["python", "-c", "import gymnasium"]).result()
    assert no_gym.returncode == 1 and "gymnasium" in no_gym.stderr
    with pytest.raises(SandboxResourceExhaustedError) as err:
        Sandbox.run(tags=[tag], resources=SMALL, container_image="rl")
    assert err.value.reason == "CWSANDBOX_RUNNER_CAPACITY_EXHAUSTED"
    Sandbox.delete(first.sandbox_id).result()
    second = Sandbox.run(tags=[tag], resources=SMALL, container_image="rl")  # room again
    assert second.exec(["python", "-c", "import gymnasium"]).result().returncode == 0
    Sandbox.delete(second.sandbox_id).result()
    _no_traceback(daemon, since)


def test_grpc_needs_a_token_and_a_free_port(tmp_path):
    from corral.errors import InvalidArgument
    from corral.server.__main__ import build_parser, settings_from_args
    from corral.server.settings import ServerSettings

    args = build_parser("corral serve").parse_args(["--grpc", "127.0.0.1:7071", "--token", "t"])
    assert settings_from_args(args).grpc == ("127.0.0.1", 7071)
    with pytest.raises(InvalidArgument, match="--grpc"):
        ServerSettings(socket=tmp_path / "s.sock", grpc=("127.0.0.1", 7071))

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "corral.server", "--socket", str(tmp_path / "c.sock"),
             "--state-dir", str(tmp_path / "state"), "--grpc", f"127.0.0.1:{port}",
             "--token", TOKEN],
            capture_output=True, text=True, timeout=120,
        )
    assert out.returncode == 1
    assert f"cannot listen for gRPC on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "c.sock").exists()
