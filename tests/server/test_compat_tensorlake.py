"""Tensorlake's own Python client, unmodified, against a real corral daemon.

Each test runs a plain Tensorlake script (no corral import) in a subprocess whose only
configuration is ``TENSORLAKE_API_URL`` / ``TENSORLAKE_API_KEY``, exactly what a user
changes; the script prints a JSON summary that the test checks. Every test also checks
that the daemon logged no traceback and, through the native API, that nothing leaked.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import pytest

from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime
from tests.server.conftest import free_port, sandbox_ids, uds_client

pytest.importorskip("tensorlake.sandbox", reason="the compat extra (tensorlake) is not installed")

TOKEN = "tl-test-token"
PRELUDE = """
import json, sys, time
from tensorlake.sandbox import (
    AsyncSandbox, PoolNotFoundError, RemoteAPIError, Sandbox, SandboxClient,
    SandboxNotFoundError,
)

def err(f):
    try:
        f()
    except Exception as e:
        return {"type": type(e).__name__, "status": getattr(e, "status_code", None),
                "msg": str(e)}
    return None

out = {}
"""
# tensorlake 0.5.162's Rust extension sometimes aborts while Python finalizes (SIGABRT
# "PyGILState_Release ... finalizing", or SIGSEGV), after everything is done: measured
# 2 of 40 runs against a stub HTTP server, without corral. Skip finalization.
EPILOGUE = """
print(json.dumps(out), flush=True)
import os
os._exit(0)
"""


class TensorlakeDaemon(Daemon):
    port: int

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _start(*args: str, env: dict[str, str] | None = None) -> TensorlakeDaemon:
    port = free_port()
    d = TensorlakeDaemon(_base_dir(), ["--tcp", f"127.0.0.1:{port}", "--token", TOKEN, *args])
    d.port = port
    with mock.patch.dict(os.environ, env or {}):
        d.start()
    return d


@contextlib.contextmanager
def serving(*args: str, env: dict[str, str] | None = None) -> Iterator[TensorlakeDaemon]:
    """A daemon for a module's tests (they are skipped without root), removed after."""
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    d = _start(*args, env=env)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


@contextlib.contextmanager
def checked(d: TensorlakeDaemon) -> Iterator[TensorlakeDaemon]:
    """``d`` for one test; afterwards its log holds no traceback and no sandbox is left."""
    logged = d.log.stat().st_size
    yield d
    with open(d.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: {d.log}"
    with uds_client(d.socket) as c:
        assert sandbox_ids(c) == set(), "a test left sandboxes behind"


@pytest.fixture(scope="module")
def tl_daemon():
    # the default output budget: a run holds the bytes it prints, so the fan-out of 50
    # (64 MiB per stream asked each) fits (tests/security/test_output_budget.py)
    with serving(env={"CORRAL_COMPAT_IMAGE_MAP": "my-org/agent-env=python"}) as d:
        yield d


@pytest.fixture
def daemon_ok(tl_daemon):
    """The daemon, checked afterwards: no traceback logged, no sandbox left behind."""
    with checked(tl_daemon) as d:
        yield d


def run_script(d: TensorlakeDaemon, body: str, *, key: str | None = TOKEN) -> dict:
    """Run a Tensorlake script with only the environment pointing it at ``d``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORLAKE_")}
    env["TENSORLAKE_API_URL"] = d.api_url
    if key is not None:
        env["TENSORLAKE_API_KEY"] = key
    script = Path(d.base) / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + EPILOGUE)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_create_run_files_list_delete(daemon_ok):
    out = run_script(
        daemon_ok,
        """
        sb = Sandbox.create(cpus=1, memory_mb=256, timeout_secs=600)
        sid = sb.sandbox_id
        r = sb.run("python3", ["-c", "import gymnasium, sys; print('gym', gymnasium.__version__);"
                               "print('oops', file=sys.stderr); print('tail', end='')"])
        out["run"] = [r.exit_code, r.stdout, r.stderr, r.reason.value]
        r = sb.run("sh", ["-c", "exit 3"])
        out["exit3"] = [r.exit_code, r.reason.value]
        r = sb.run("sleep", ["30"], timeout=1)
        out["timeout"] = [r.exit_code, r.reason.value]
        r = sb.run("pwd", working_dir="/tmp", env={"X": "1"})
        out["cwd"] = r.stdout
        sb.write_file("/workspace/data/a.txt", b"hello\\x00bytes")
        out["read"] = sb.read_file("/workspace/data/a.txt").value.decode()
        out["ls"] = [(e.name, e.is_dir, e.size) for e in sb.list_directory("/workspace/data").entries]
        sb.delete_file("/workspace/data/a.txt")
        out["read_gone"] = err(lambda: sb.read_file("/workspace/data/a.txt"))
        client = SandboxClient(_internal=True)
        out["listed"] = [s.sandbox_id for s in client.list()]
        info = client.get(sid)
        out["info"] = [info.status.value, info.resources.cpus, info.resources.memory_mb,
                       info.timeout_secs, info.image, info.namespace]
        sb.terminate()
        out["sid"] = sid
        out["after_delete"] = err(lambda: client.get(sid))
        """,
    )
    assert out["run"] == [0, "gym 1.4.0\ntail", "oops", "exited"]
    assert out["exit3"] == [3, "exited"]
    assert out["timeout"] == [-9, "timed_out"]
    assert out["cwd"] == "/tmp"
    assert out["read"] == "hello\x00bytes"
    assert out["ls"] == [["a.txt", False, 11]]
    assert out["read_gone"]["type"] == "RemoteAPIError" and out["read_gone"]["status"] == 404
    assert out["listed"] == [out["sid"]]
    assert out["info"] == ["running", 1.0, 256, 600, "rl", "default"]
    assert out["after_delete"]["type"] == "SandboxNotFoundError"


def test_errors_map_to_the_clients_exceptions(daemon_ok):
    out = run_script(
        daemon_ok,
        """
        client = SandboxClient(_internal=True)
        out["connect"] = err(lambda: Sandbox.connect("sb-doesnotexist"))
        out["get"] = err(lambda: client.get("sb-doesnotexist"))
        out["delete"] = err(lambda: client.delete("sb-doesnotexist"))
        out["memory"] = err(lambda: Sandbox.create(memory_mb=1))
        out["image"] = err(lambda: Sandbox.create(image="no-such-image"))
        out["gpu"] = err(lambda: Sandbox.create(gpus=1))
        out["egress"] = err(lambda: Sandbox.create(allow_out=["10.0.0.0/33"],
                                                   deny_out=["0.0.0.0/0"]))
        out["snapshot"] = err(lambda: Sandbox.create(snapshot_id="snap-nope"))
        out["name"] = err(lambda: Sandbox.create(name="not a name!"))
        sb = Sandbox.create(memory_mb=64, name="agent-1")
        out["dup"] = err(lambda: Sandbox.create(memory_mb=64, name="agent-1"))
        out["pty"] = err(lambda: sb.create_pty_session("bash"))
        out["cwd"] = err(lambda: sb.run("ls", working_dir="/no/such/dir"))
        out["pool"] = err(lambda: client.get_pool("pool-nope"))
        sb.terminate()
        """,
    )
    for key in ("connect", "get", "delete"):
        assert out[key]["type"] == "SandboxNotFoundError", out[key]
    expected = {
        "memory": 400, "image": 404, "gpu": 400, "egress": 400, "snapshot": 404,
        "name": 400, "dup": 409, "pty": 501, "cwd": 404,
    }
    for key, status in expected.items():
        assert out[key]["type"] == "RemoteAPIError", out[key]
        assert out[key]["status"] == status, out[key]
    assert "CORRAL_COMPAT_IMAGE_MAP" in out["image"]["msg"]
    assert "memory_mb" in out["memory"]["msg"]
    assert out["pool"]["type"] == "PoolNotFoundError"


def test_bearer_token_is_the_api_key(daemon_ok):
    script = """
    out["create"] = err(lambda: Sandbox.create(memory_mb=64))
    """
    for key in ("wrong-key", None):
        out = run_script(daemon_ok, script, key=key)
        assert out["create"]["type"] == "RemoteAPIError", out
        assert out["create"]["status"] == 401, out


def test_fan_out_50_sandboxes_with_the_async_client(daemon_ok):
    out = run_script(
        daemon_ok,
        """
        import asyncio

        async def one(i):
            sb = await AsyncSandbox.create(memory_mb=64)
            try:
                r = await sb.run("python3", ["-c", f"print({i} * {i})"])
                return [r.exit_code, int(r.stdout)]
            finally:
                await sb.terminate()

        async def main():
            return await asyncio.gather(*(one(i) for i in range(50)))

        out["results"] = asyncio.run(main())
        """,
    )
    assert out["results"] == [[0, i * i] for i in range(50)]


def test_snapshot_restore_and_copy(daemon_ok):
    out = run_script(
        daemon_ok,
        """
        client = SandboxClient(_internal=True)
        sb = Sandbox.create(memory_mb=96, cpus=0.5)
        sb.write_file("/workspace/state.txt", b"step-41")
        snap = sb.checkpoint()
        out["snap"] = [snap.status.value, snap.snapshot_type.value, snap.sandbox_id == sb.sandbox_id]
        out["listed"] = [s.snapshot_id for s in sb.list_snapshots()] == [snap.snapshot_id]
        sb.write_file("/workspace/state.txt", b"step-42")
        restored = Sandbox.create(snapshot_id=snap.snapshot_id)
        info = client.get(restored.sandbox_id)
        out["restored"] = [restored.read_file("/workspace/state.txt").value.decode(),
                           info.resources.memory_mb, info.resources.cpus]
        copies = client.copy(sb.sandbox_id, times=2).sandboxes
        out["copies"] = [Sandbox.connect(c.sandbox_id).read_file("/workspace/state.txt").value.decode()
                         for c in copies]
        client.delete_snapshot(snap.snapshot_id)
        out["gone"] = err(lambda: client.get_snapshot(snap.snapshot_id))
        for s in [sb, restored, *copies]:
            client.delete(s.sandbox_id)
        """,
    )
    assert out["snap"] == ["completed", "filesystem", True]
    assert out["listed"] is True
    assert out["restored"] == ["step-41", 96, 0.5]
    assert out["copies"] == ["step-42", "step-42"]
    assert out["gone"]["status"] == 404


def test_background_processes(daemon_ok):
    out = run_script(
        daemon_ok,
        """
        sb = Sandbox.create(memory_mb=64)
        p = sb.start_process("sh", ["-c", "for i in 1 2 3; do echo line$i; sleep 0.1; done;"
                                          "echo warn >&2; exit 4"])
        out["follow"] = [[e.line, e.stream] for e in sb.follow_output(p.pid)]
        done = sb.get_process(p.pid)
        out["done"] = [done.status.value, done.exit_code]
        out["stdout"] = sb.get_stdout(p.pid).lines
        long = sb.start_process("sleep", ["300"])
        out["running"] = sb.get_process(long.pid).status.value
        out["pids"] = sorted(x.pid for x in sb.list_processes()) == sorted([p.pid, long.pid])
        out["stdin"] = err(lambda: sb.write_stdin(long.pid, b"x"))  # its stdin is closed
        from tensorlake.sandbox.models import StdinMode
        cat = sb.start_process("cat", [], stdin_mode=StdinMode.PIPE)
        sb.write_stdin(cat.pid, b"hello\\nwor")
        sb.write_stdin(cat.pid, b"ld\\n")
        sb.close_stdin(cat.pid)
        for _ in range(200):  # bounded: cat ends once its stdin is closed
            if sb.get_process(cat.pid).status.value != "running":
                break
            time.sleep(0.05)
        piped = sb.get_process(cat.pid)
        out["cat"] = [piped.status.value, piped.exit_code, sb.get_stdout(cat.pid).lines]
        out["term"] = sb.send_signal(long.pid, 15).success
        for _ in range(200):  # bounded: the signal is delivered, the exit follows
            gone = sb.get_process(long.pid)
            if gone.status.value != "running":
                break
            time.sleep(0.05)
        out["killed"] = [gone.status.value, gone.signal]
        out["ps"] = sb.run("sh", ["-c", "cat /proc/[0-9]*/comm | grep -c '^sleep$' || true"]).stdout
        out["unknown"] = err(lambda: sb.get_process(99999))
        sb.terminate()
        """,
    )
    assert out["follow"] == [
        ["line1", "stdout"], ["line2", "stdout"], ["line3", "stdout"], ["warn", "stderr"]
    ]
    assert out["done"] == ["exited", 4]
    assert out["stdout"] == ["line1", "line2", "line3"]
    assert out["running"] == "running" and out["pids"] is True
    assert out["stdin"]["status"] == 409  # started without stdin_mode=PIPE
    assert out["cat"] == ["exited", 0, ["hello", "world"]]
    assert out["term"] is True
    assert out["killed"] == ["signaled", 15]  # the signal sent, not a SIGKILL
    assert out["ps"].strip() == "0"  # the process group is really gone
    assert out["unknown"]["status"] == 404


def test_pools_names_suspend_and_image_map(daemon_ok):
    out = run_script(
        daemon_ok,
        """
        client = SandboxClient(_internal=True)
        pool = client.create_pool(image="python", memory_mb=64, warm_containers=1,
                                  max_containers=2).pool_id
        sb = Sandbox.create(pool_id=pool)
        out["claimed"] = [sb.run("echo", ["warm"]).stdout, client.get(sb.sandbox_id).pool_id == pool]
        states = sorted(c.state for c in client.get_pool(pool).containers)
        out["containers"] = "Running" in states
        client.delete_pool(pool)
        out["pool_gone"] = err(lambda: client.get_pool(pool))
        sb.terminate()

        named = Sandbox.create(name="agent-7", memory_mb=64, image="my-org/agent-env")
        out["by_name"] = Sandbox.connect("agent-7").run("echo", ["named"]).stdout
        out["image"] = client.get("agent-7").image
        client.suspend("agent-7")
        out["suspended"] = client.get(named.sandbox_id).status.value
        client.resume("agent-7")
        out["resumed"] = named.run("echo", ["back"]).stdout
        named.terminate()
        stock = Sandbox.create(image="tensorlake/ubuntu-minimal", memory_mb=64)
        out["stock"] = client.get(stock.sandbox_id).image
        stock.terminate()
        """,
    )
    assert out["claimed"] == ["warm", True]
    assert out["containers"] is True
    assert out["pool_gone"]["type"] == "PoolNotFoundError"
    assert out["by_name"] == "named" and out["image"] == "python"
    assert out["suspended"] == "suspended" and out["resumed"] == "back"
    assert out["stock"] == "rl"


def test_in_sandbox_calls_by_header_and_flat_paths(daemon_ok):
    """What the client sends when its URL is not localhost: flat lifecycle paths and
    ``X-Tensorlake-Sandbox-Id`` instead of ``Host: <id>.local``."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=daemon_ok.api_url, headers=auth, timeout=60) as c:
        made = c.post("/sandboxes", json={"resources": {"cpus": 1, "memory_mb": 64}})
        assert made.status_code == 200, made.text
        sid = made.json()["sandbox_id"]
        try:
            run = c.post(
                "/api/v1/processes/run", headers={"X-Tensorlake-Sandbox-Id": sid},
                json={"command": "echo", "args": ["hi"]},
            )
            assert run.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(x[6:]) for x in run.text.split("\n\n") if x.startswith("data: ")]
            assert events[1]["line"] == "hi" and events[-1]["exit_code"] == 0
            nobody = c.get("/api/v1/files", params={"path": "/etc/hostname"})
            assert nobody.status_code == 400 and nobody.json()["code"] == "invalid_argument"
            # A client that hangs up on a run kills the command.
            host = {"Host": f"{sid}.local"}
            body = {"command": "sh", "args": ["-c", "echo started; exec sleep 300"]}
            with c.stream("POST", "/api/v1/processes/run", headers=host, json=body) as s:
                for line in s.iter_lines():
                    if "started" in line:
                        break
            count = {"command": "sh", "args": ["-c", "cat /proc/[0-9]*/comm | grep -c '^sleep$'"]}
            for _ in range(200):  # the kill follows the hang-up, not instantly
                ran = c.post("/api/v1/processes/run", headers=host, json=count)
                if '"line":"0"' in ran.text:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"the sleep outlived its client: {ran.text}")
        finally:
            assert c.delete(f"/sandboxes/{sid}").status_code == 200


def test_admission_control_applies_to_tensorlake_creates():
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    d = _start("--max-sandboxes", "1", "--queue-timeout", "0.3")
    try:
        out = run_script(
            d,
            """
            first = Sandbox.create(memory_mb=64)
            out["second"] = err(lambda: Sandbox.create(memory_mb=64))
            first.terminate()
            again = Sandbox.create(memory_mb=64)
            out["after"] = again.run("echo", ["room"]).stdout
            again.terminate()
            """,
        )
        assert out["second"]["status"] == 503 and "max_sandboxes" in out["second"]["msg"]
        assert out["after"] == "room"
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


def test_suspend_hibernates_a_sandbox_without_network(daemon_ok):
    """Tensorlake's suspend keeps memory: a sandbox on no network (made checkpointable)
    is hibernated, its memory freed (the native API says so); resumed, its process
    counts on."""
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    try:  # a failed check leaves no sandbox behind for the next test to trip on
        out = run_script(daemon_ok, """
            sb = Sandbox.create(memory_mb=128)
            out["id"] = sb.sandbox_id
            sb.run("sh", ["-c", "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; "
                                "mv /tmp/n.new /tmp/n; sleep 0.05; done' >/dev/null 2>&1 &"])
            client = SandboxClient(_internal=True)
            client.suspend(sb.sandbox_id)
            out["status"] = client.get(sb.sandbox_id).status.value
        """)
        assert out.get("status") == "suspended", out
        with uds_client(daemon_ok.socket) as c:
            info = c.get(f"/v1/sandboxes/{out['id']}").json()
        hibernated = (info["state"], info["reason"]) == ("paused", "hibernated")
        assert hibernated, [line for line in daemon_ok.log.read_text().splitlines()
                            if "could not hibernate" in line]
        again = run_script(daemon_ok, f"""
            client = SandboxClient(_internal=True)
            client.resume({out["id"]!r})
            sb = Sandbox.connect({out["id"]!r})
            n = int(sb.run("cat", ["/tmp/n"]).stdout)
            for _ in range(300):
                if int(sb.run("cat", ["/tmp/n"]).stdout) > n:
                    out["counts_on"] = n > 0
                    break
        """)
    finally:  # (the module's tests run one at a time: what is left is this one's)
        with uds_client(daemon_ok.socket) as c:
            for sid in sandbox_ids(c):
                c.delete(f"/v1/sandboxes/{sid}")
    assert again == {"counts_on": True}
