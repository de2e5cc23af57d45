"""Live restore: sandboxes survive a restart of their daemon (docs/restart.md).

A real daemon (``python -m corral.server`` on a private state directory and cache)
runs a sandbox with files and a running process; the daemon is stopped with SIGTERM
or killed with ``kill -9`` and a new one started on the same state directory. The
sandbox must come back running, with its files, its process (the same pid, still
working), and answer exec, file operations and spawn; its lifetime still ends it when
it was due. A paused one comes back paused and resumes; a hibernated one (its processes
in a checkpoint) comes back hibernated and resumes. Without a next daemon, the
warden ends them after ``--restore-grace``. Waits are bounded polls, never a
wall-clock assertion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.runtime import criu
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root
from tests.faults.host import Host, alive

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(600)]

SECRET = "s3cret-kept-over-restarts"
TICKER = "echo $$ > /tmp/ticker.pid; while :; do echo tick >> /tmp/ticks; sleep 0.05; done"


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host.make("--restore-grace", "120", "--shutdown-grace", "0.5")
    h.start()
    yield h
    h.stop()  # SIGINT: the sandboxes stop with it
    h.remove()


def _client(h: Host) -> corral.Client:
    return corral.Client(f"unix://{h.socket}")


def _restart(h: Host, how: str) -> None:
    assert h.proc is not None
    if how == "kill9":
        h.kill9()
    else:
        h.proc.send_signal(signal.SIGTERM)
        assert h.proc.wait(60) == 0
    h.start()


def _poll(check, what: str, limit: float = 60.0):  # noqa: ANN001, ANN202 - a test helper
    """Poll ``check`` until it returns something truthy (bounded only against a hang)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {limit:g} s: {what}")


def _sandbox_pids(h: Host) -> set[int]:
    """The host pids in the cgroup of the sandbox that runs the ticker (bwrap, its
    agent, the ticker; not its short sleeps): warm slots are other cgroups, and do
    not survive a restart."""
    groups = h.in_cgroups()
    mine = {path for pid, path in groups.items() if b"ticker.pid" in _read(pid, "cmdline")}
    assert len(mine) == 1, groups
    return {pid for pid, path in groups.items()
            if path in mine and _read(pid, "comm").strip() not in (b"sleep", b"")}


def _read(pid: int, name: str) -> bytes:
    """``/proc/PID/NAME``, or nothing if the process has gone meanwhile (a short sleep)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _ticks(sb: corral.Sandbox) -> int:
    return int(sb.exec("wc -l < /tmp/ticks").stdout.strip() or 0)


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_a_running_sandbox_survives_a_restart(host: Host, how: str) -> None:
    with _client(host) as c:
        sb = corral.Sandbox.create(client=c, memory_mb=128, timeout=600,
                                   secrets={"API_KEY": SECRET})
        sb.files.write("/home/sandbox/notes.txt", b"written before the restart")
        ticker = sb.spawn(["sh", "-c", TICKER])
        inner_pid = _poll(lambda: sb.exec("cat /tmp/ticker.pid").stdout.strip(), "ticker up")
        assert ticker.id
        sid = sb.id
        lease = c.request("POST", "/v1/leases", json={"ttl": 60}).json()["id"]
        # an upload half sent: it resumes with the next daemon (server/upload_routes.py)
        blob = os.urandom(2 << 20)
        up = c.request("POST", f"/v1/sandboxes/{sid}/uploads",
                       json={"path": "up.bin", "size": len(blob)}).json()
        upload = f"/v1/sandboxes/{sid}/uploads/{up['upload_id']}"
        c.request("PATCH", upload, content=blob[:1 << 20], headers={"Upload-Offset": "0"})
        # another's, deleted after the restart before any upload request: its bytes go
        gone = corral.Sandbox.create(client=c, memory_mb=64, timeout=600)
        c.request("PATCH", f"/v1/sandboxes/{gone.id}/uploads/" + c.request(
            "POST", f"/v1/sandboxes/{gone.id}/uploads", json={"path": "x", "size": 10}
        ).json()["upload_id"], content=b"12345", headers={"Upload-Offset": "0"})
        staged = sorted((host.state / "uploads").glob("*.part"))
        assert len(staged) == 2
    before = _sandbox_pids(host)
    assert len(before) >= 3  # bwrap, the agent, the ticker
    _restart(host, how)
    with _client(host) as c:
        sb = corral.Sandbox.connect(sid, client=c)
        assert sb.state == corral.SandboxState.RUNNING, sb.info
        assert c.info()["committed_memory_mb"] >= 128  # counted by the new daemon's caps
        c.request("POST", f"/v1/leases/{lease}/renew")  # leases are kept too
        corral.Sandbox.connect(gone.id, client=c).delete()
        assert c.request("GET", upload).json()["offset"] == 1 << 20
        kept = host.state / "uploads" / f"{up['upload_id']}.part"
        assert list((host.state / "uploads").glob("*.part")) == [kept]  # the other's went
        assert not sb.files.exists("up.bin")
        done = c.request("PATCH", upload, content=blob[1 << 20:],
                         headers={"Upload-Offset": str(1 << 20)}).json()
        assert done["done"] and sb.files.read("up.bin") == blob
        # the same processes, never restarted: every one alive before still is
        assert all(alive(pid) for pid in before), (before, _sandbox_pids(host))
        assert sb.files.read("/home/sandbox/notes.txt") == b"written before the restart"
        # its process ran through the restart and still runs: the same pid, ticking
        assert sb.exec("cat /tmp/ticker.pid").stdout.strip() == inner_pid
        assert sb.exec(f"kill -0 {inner_pid}").returncode == 0
        n = _ticks(sb)
        _poll(lambda: _ticks(sb) > n, "the process keeps writing after the restart")
        # and it answers everything, as a sandbox of the new daemon
        r = sb.exec(["python3", "-c", "print(6 * 7)"], timeout=30)
        assert (r.returncode, r.stdout.strip()) == (0, "42")
        # its secrets, in clear for its new commands (kept root-only: runtime/secret_store.py)
        assert sb.exec("printenv API_KEY").stdout == f"{SECRET}\n"
        sb.files.write("/home/sandbox/after.txt", b"after")
        assert sb.files.read("/home/sandbox/after.txt") == b"after"
        proc = sb.spawn(["sh", "-c", "echo spawned after the restart"])
        assert proc.wait().returncode == 0
        assert sb.stop().state == corral.SandboxState.STOPPED
        # its files are kept after the stop, as any sandbox's
        assert sb.files.read("/home/sandbox/after.txt") == b"after"


def test_a_lifetime_still_ends_the_sandbox_after_a_restart(host: Host) -> None:
    lifetime = 8
    with _client(host) as c:
        sb = corral.Sandbox.create(client=c, memory_mb=64, timeout=lifetime)
        sid = sb.id
        created = time.monotonic()
    _restart(host, "sigterm")
    with _client(host) as c:
        state = corral.Sandbox.connect(sid, client=c).state
        if time.monotonic() - created < lifetime - 1:  # a loaded host's restart may take longer
            assert state == corral.SandboxState.RUNNING
        info = _poll(lambda: (i := corral.Sandbox.connect(sid, client=c).info).state.terminal
                     and i, "the sandbox's lifetime ends it", limit=120)
        assert info.state == corral.SandboxState.STOPPED
        assert (info.reason or "").startswith("timeout"), info.reason


def test_a_paused_sandbox_comes_back_paused_and_resumes(host: Host) -> None:
    with _client(host) as c:
        sb = corral.Sandbox.create(client=c, memory_mb=64, timeout=600)
        sb.files.write("/tmp/x", b"paused")
        sb.pause()
        sid = sb.id
    _restart(host, "kill9")
    with _client(host) as c:
        sb = corral.Sandbox.connect(sid, client=c)
        assert sb.state == corral.SandboxState.PAUSED
        sb.resume()
        assert sb.exec("cat /tmp/x").stdout == "paused"
        sb.delete()


# (written aside and renamed: a reader never sees the file empty, between truncate and write)
COUNTER = ("nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; "
           "mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &")


def _snapshots(c: corral.Client) -> list[dict]:
    return c.request("GET", "/v1/snapshots").json()["snapshots"]


def test_a_hibernated_sandbox_survives_restarts_and_resumes(host: Host) -> None:
    """Hibernated, then a SIGTERM handover and a ``kill -9``: each next daemon lists it
    hibernated (its checkpoint with it, its lifetime standing still); resumed, its
    process counts on and the checkpoint goes."""
    cached = criu.find(default_cache_dir())
    if cached is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    (host.cache / "criu").mkdir(exist_ok=True)  # the daemon's private cache gets it too
    subprocess.run(["cp", "-al", str(cached.path.parent), str(host.cache / "criu")], check=True)
    with _client(host) as c:
        sb = corral.Sandbox.create(client=c, memory_mb=128, timeout=600, checkpointable=True,
                                   secrets={"API_KEY": SECRET})
        sb.exec(COUNTER)
        before = _poll(lambda: sb.exec("cat /tmp/count 2>/dev/null").stdout.strip(), "count")
        info = sb.hibernate()
        sid, left, created = sb.id, info.spec.timeout, info.created_at
    for how in ("sigterm", "kill9"):
        _restart(host, how)
        with _client(host) as c:
            info = corral.Sandbox.connect(sid, client=c).info
            assert (info.state, info.reason) == (corral.SandboxState.PAUSED, "hibernated"), info
            assert info.spec.timeout == left  # standing still
            assert [s["kind"] for s in _snapshots(c)] == ["live"]
    with _client(host) as c:
        sb = corral.Sandbox.connect(sid, client=c)
        info = sb.resume()
        assert info.state == corral.SandboxState.RUNNING and info.created_at == created
        n = int(sb.exec("cat /tmp/count").stdout)
        assert n >= int(before)
        _poll(lambda: int(sb.exec("cat /tmp/count").stdout) > n, "it counts on")
        assert sb.exec("printenv API_KEY").stdout == f"{SECRET}\n"  # its secrets, not masked
        assert _snapshots(c) == []  # its checkpoint went once it ran
        sb.delete()


def test_without_a_next_daemon_the_warden_ends_them_after_the_grace() -> None:
    h = Host.make("--restore-grace", "2")
    try:
        h.start()
        with _client(h) as c:
            corral.Sandbox.create(client=c, memory_mb=64, timeout=600)
        assert h.in_cgroups()
        h.kill9()
        _poll(lambda: not h.in_cgroups() and not h.cgroup_exists(),
              "the warden cleans up once the grace has passed", limit=120)
        # a daemon started later finds it lost, with a reason
        h.start()
        with _client(h) as c:
            [sb] = corral.Sandbox.list(client=c)
            info = sb.info
            assert info.state == corral.SandboxState.FAILED
            assert (info.reason or "").startswith("lost:"), info.reason
    finally:
        h.stop()
        h.remove()


def test_a_client_waits_through_the_restart(host: Host) -> None:
    """A call made while no daemon answers (it restarts) waits for the next one: a
    script mid-episode never notices (``Client.reconnect_wait``)."""
    c = _client(host)
    try:
        sb = corral.Sandbox.create(client=c, memory_mb=64, timeout=600)
        host.kill9()
        starter = threading.Timer(1.0, host.start)
        starter.start()
        try:
            assert sb.exec("echo after").stdout == "after\n"  # sent while it was down
        finally:
            starter.join()
        sb.delete()
    finally:
        c.close()


def test_a_policy_sandbox_survives_a_kill9_with_its_network(host: Host, monkeypatch) -> None:
    """A sandbox under a network policy: after ``kill -9`` the warden holds its link's
    lock, so its namespace stays; the next daemon enforces its policy again (runtime/
    engine_restore.py; the engine-level SIGTERM case: tests/runtime/test_restore_policy.py)."""
    from tests.security.net_helpers import PROXY_VARS, server_ns

    probe = ("import socket\ntry:\n s = socket.create_connection(('good.test', 80), timeout=10)\n"
             " s.sendall(b'GET / HTTP/1.0\\r\\nHost: good.test\\r\\n\\r\\n')\n"
             " print(s.makefile('rb').read().split(b'\\r\\n\\r\\n', 1)[-1].decode())\n"
             "except Exception as e:\n print(type(e).__name__)\n")
    with server_ns(10, "GOOD") as good:
        monkeypatch.setenv("CORRAL_NETWORK_HOSTS", f"good.test={good}")
        for var in PROXY_VARS:  # the daemon dials the test's server itself
            monkeypatch.delenv(var, raising=False)
        _restart(host, "kill9")  # a daemon started with the mapping
        with _client(host) as c:  # on a private network too, with a peer (net/private.py)
            net = corral.Network.create("ep", private=True, client=c)
            sb = corral.Sandbox.create(client=c, memory_mb=64, timeout=600,
                                       network=net.member("a", allow=["good.test"]))
            peer = corral.Sandbox.create(client=c, memory_mb=64, timeout=600,
                                         network=net.member("b"))
            peer.exec(["sh", "-c", "nohup python3 -m http.server 8080 >/dev/null 2>&1 &"])
            assert sb.exec(["python3", "-c", probe], timeout=60).stdout.strip() == "GOOD GET / HTTP/1.0"
        _restart(host, "kill9")
        with _client(host) as c:
            sb = corral.Sandbox.connect(sb.id, client=c)
            assert sb.state == corral.SandboxState.RUNNING
            assert sb.exec(["python3", "-c", probe], timeout=60).stdout.strip() == "GOOD GET / HTTP/1.0"
            to_peer = probe.replace("('good.test', 80)", "('b', 8080)")
            _poll(lambda: "Directory listing" in sb.exec(["python3", "-c", to_peer]).stdout,
                  "the peer, by name, on the bridge kept through the restart")
            sb.delete()
            corral.Sandbox.connect(peer.id, client=c).delete()
            corral.Network("ep", client=c).delete()  # no member left
