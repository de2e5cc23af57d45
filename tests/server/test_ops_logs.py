"""A sandbox's log outlives it (SDK, HTTP, CLI, follow), and its lifetime can be moved
(PATCH / set_timeout, both ways, within --max-lifetime) — on a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

import corral
from tests.server.conftest import assert_error, uds_client

MAX_LIFETIME = 600
# A deleted sandbox's logs are kept this long: 15 s, so the read just after the delete
# comes within it (2 s could pass first on a loaded host: the log was swept, a 404)
LOG_RETENTION_S = 15


@pytest.fixture(scope="module")
def ops_daemon(tmp_path_factory):
    from tests.conftest import Daemon, _base_dir, have_root_runtime

    if not have_root_runtime():
        pytest.skip("needs root, bubblewrap and cgroups (CI runs as root)")
    d = Daemon(_base_dir(), ["--log-retention", str(LOG_RETENTION_S),
                             "--max-lifetime", str(MAX_LIFETIME)])
    d.start()
    yield d
    d.stop()


@pytest.fixture
def sdk(ops_daemon):
    with corral.Client(ops_daemon.url) as c:
        yield c


def _wait_state(sb: corral.Sandbox, states: set[str], limit: float = 60) -> corral.SandboxInfo:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        info = sb.refresh()
        if info.state.value in states:
            return info
        time.sleep(0.2)
    raise AssertionError(f"{sb.id} did not reach {states}: {sb.refresh()}")


def _cli(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corral.cli.main", "--url", daemon.url, *args],
                          capture_output=True, text=True, timeout=120)


def test_logs_readable_after_a_timeout_stop_and_after_delete(ops_daemon, sdk):
    sb = corral.Sandbox.create(client=sdk, timeout=300)
    try:
        assert sb.exec(["sh", "-c", "echo hello; echo oops >&2; exit 3"]).returncode == 3
        assert sb.exec(["sleep", "30"], timeout=0.5).timed_out
        sb.set_timeout(1)  # shortened: it ends by itself, with reason timeout
        info = _wait_state(sb, {"stopped", "failed"})
        assert info.reason and info.reason.startswith("timeout"), info.reason
        entries = sb.logs()
        commands = [e for e in entries if e["kind"] == "command"]
        assert [c["argv"] for c in commands] == [
            ["sh", "-c", "echo hello; echo oops >&2; exit 3"], ["sleep", "30"]]
        first, second = commands
        assert (first["outcome"], first["exit_code"]) == ("exit", 3)
        assert (first["stdout_tail"], first["stderr_tail"]) == ("hello\n", "oops\n")
        assert first["ended_at"] >= first["started_at"]
        assert (second["outcome"], second["exit_code"]) == ("timeout", None)
        events = [e["event"] for e in entries if e["kind"] == "event"]
        assert events[0] == "ready" and events[-1] == "timeout", events
        assert "stopping" in events
        assert [e["seq"] for e in entries] == sorted(e["seq"] for e in entries)
        assert sb.logs(after=entries[-2]["seq"]) == entries[-1:]
        # The CLI prints the same log, also as JSON lines.
        run = _cli(ops_daemon, "logs", sb.id)
        assert run.returncode == 0, run.stderr
        assert "$ sleep 30  -> timeout" in run.stdout and "[timeout]" in run.stdout
        run = _cli(ops_daemon, "logs", sb.id, "--json")
        assert [json.loads(line)["seq"] for line in run.stdout.splitlines()] == [
            e["seq"] for e in entries]
    finally:
        sb.delete()
    # Deleted: still readable for --log-retention, with a "deleted" event ...
    with uds_client(ops_daemon.socket) as http:
        reply = http.get(f"/v1/sandboxes/{sb.id}/logs")
        assert reply.status_code == 200, reply.text
        assert reply.json()["entries"][-1]["event"] == "deleted"
        # ... then swept: the id answers 404 like any unknown one.
        deadline = time.monotonic() + LOG_RETENTION_S + 120
        while reply.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
            reply = http.get(f"/v1/sandboxes/{sb.id}/logs")
        assert_error(reply, 404, "sandbox_not_found")


def test_follow_streams_entries_until_the_sandbox_ends(ops_daemon, sdk):
    sb = corral.Sandbox.create(client=sdk, timeout=300)
    seen: list[dict] = []

    def follow() -> None:
        with corral.Client(ops_daemon.url) as c:
            seen.extend(corral.Sandbox.connect(sb.id, client=c).follow_logs())

    reader = threading.Thread(target=follow)
    reader.start()
    try:
        for i in range(3):
            sb.exec(["echo", str(i)])
        sb.stop()
        reader.join(60)
        assert not reader.is_alive(), "follow did not end when the sandbox stopped"
        outs = [e["stdout_tail"] for e in seen if e["kind"] == "command"]
        assert outs == ["0\n", "1\n", "2\n"]
        assert seen[-1] == {"kind": "end", "state": "stopped"}
        assert [e["event"] for e in seen if e["kind"] == "event"][-1] == "stopped"
        run = _cli(ops_daemon, "logs", "-f", sb.id)  # ended: prints all, then returns
        assert run.returncode == 0 and "-- end of log (sandbox stopped)" in run.stdout
    finally:
        sb.delete()


def test_set_timeout_extends_a_sandbox_past_its_deadline(ops_daemon, sdk):
    # 15 s: the set_timeout must come before this first deadline (2 s could pass first
    # under load, and 5 s is not much more)
    made = time.time()
    sb = corral.Sandbox.create(client=sdk, timeout=15)
    try:
        info = sb.set_timeout(120)
        assert info.spec.timeout > 100
        run = _cli(ops_daemon, "timeout", sb.id, "90")
        assert run.returncode == 0 and "now ends at" in run.stdout, run.stderr
        time.sleep(max(0.0, made + 17 - time.time()))  # past its first deadline (the
        # reaper looks every second)
        assert sb.refresh().state.value == "running"
        assert sb.exec(["true"]).returncode == 0
    finally:
        sb.delete()


def test_set_timeout_bad_values_are_typed_errors(ops_daemon, sdk):
    sb = corral.Sandbox.create(client=sdk, timeout=300)
    try:
        for bad in (0, -1, float("nan"), "10", True):
            with pytest.raises(corral.InvalidArgument):
                sb.set_timeout(bad)  # type: ignore[arg-type]
        with uds_client(ops_daemon.socket) as http:
            path = f"/v1/sandboxes/{sb.id}"
            err = assert_error(http.patch(path, json={"timeout": MAX_LIFETIME + 1}),
                               400, "invalid_argument")
            assert "--max-lifetime" in err["message"]
            assert_error(http.patch(path, json={"timeout": "60"}), 400, "invalid_argument")
            assert_error(http.patch(path, json={"timeout": 0}), 400, "invalid_argument")
            assert_error(http.patch(path, json={}), 400, "invalid_argument")
            assert_error(http.patch(path, json={"timeout": 5, "x": 1}), 400, "invalid_argument")
            assert_error(http.patch("/v1/sandboxes/sb-nope", json={"timeout": 5}),
                         404, "sandbox_not_found")
            assert sb.refresh().spec.timeout == 300  # nothing changed
            sb.stop()
            assert_error(http.patch(path, json={"timeout": 5}), 409, "invalid_state")
            assert_error(http.get(f"{path}/logs?after=x"), 400, "invalid_argument")
        run = _cli(ops_daemon, "timeout", sb.id, "0")
        assert run.returncode == 2 and "seconds > 0" in run.stderr
    finally:
        sb.delete()


def test_files_of_a_stopped_sandbox_can_still_be_downloaded(ops_daemon, sdk, tmp_path):
    sb = corral.Sandbox.create(client=sdk, timeout=300)
    try:
        sb.files.write("/workspace/out/result.txt", b"reward=1\n")
        sb.exec(["ln", "-s", "out/result.txt", "/workspace/link"])
        sb.stop()
        assert sb.refresh().state.value == "stopped"
        assert sb.files.read("/workspace/out/result.txt") == b"reward=1\n"
        assert sb.files.read("link") == b"reward=1\n"  # a symlink, resolved in its tree
        assert [e.name for e in sb.files.list("/workspace")] == ["link", "out"]
        assert sb.files.stat("/workspace/out/result.txt").size == 9
        with pytest.raises(corral.FileNotFound, match="only the files it wrote"):
            sb.files.read("/etc/os-release")  # the image's: not kept
        run = _cli(ops_daemon, "cp", f"{sb.id}:/workspace/out/result.txt", str(tmp_path / "r"))
        assert run.returncode == 0, run.stderr
        assert (tmp_path / "r").read_bytes() == b"reward=1\n"
        with pytest.raises(corral.InvalidState):
            sb.files.write("/workspace/x", b"no")  # read-only once stopped
    finally:
        sb.delete()
    stopped = ops_daemon.state_dir / "stopped"
    deadline = time.monotonic() + 30
    while (stopped / sb.id).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (stopped / sb.id).exists()  # deleting it removed its files
