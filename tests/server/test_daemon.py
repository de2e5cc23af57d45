"""The daemon process: its socket, TCP with a token, shutdown, idle exit."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from corral.runtime.cgroups import detect
from corral.runtime.paths import Layout
from tests.conftest import Daemon, requires_root
from tests.server.conftest import assert_error, free_port, uds_client

pytestmark = [requires_root, pytest.mark.root]

IDLE_EXIT_S = 10  # (with 1 s, a test process that got no CPU for a second after the
# daemon listened found it gone: its create was refused)


def test_socket_is_owner_only(daemon):
    mode = daemon.socket.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert daemon.socket.stat().st_uid == os.geteuid()


def test_socket_parent_is_created_private(tmp_path):
    d = Daemon(tmp_path)
    d.socket = tmp_path / "run" / "corral" / "corral.sock"
    try:
        d.start()
        with uds_client(d.socket) as c:
            assert c.get("/v1/health").status_code == 200
        assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o700
    finally:
        d.stop()
    assert not d.socket.exists()


def test_tcp_needs_the_bearer_token(make_daemon):
    port = free_port()
    d = make_daemon("--tcp", f"127.0.0.1:{port}", "--token", "s3cret-token")
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=30) as c:
        missing = assert_error(c.get("/v1/health"), 401, "unauthorized")
        assert "Authorization: Bearer" in missing["message"]
        wrong = c.get("/v1/info", headers={"Authorization": "Bearer nope"})
        assert "Authorization: Bearer" in assert_error(wrong, 401, "unauthorized")["message"]
        assert wrong.headers["www-authenticate"] == "Bearer"
        assert_error(
            c.get("/v1/info", headers={"Authorization": "Basic s3cret-token"}), 401, "unauthorized"
        )
        assert_error(c.post("/v1/sandboxes", json={}), 401, "unauthorized")
        ok = c.get("/v1/info", headers={"Authorization": "Bearer s3cret-token"})
        assert ok.status_code == 200 and ok.json()["version"]
    with uds_client(d.socket) as c:  # the Unix socket needs no token
        assert c.get("/v1/info").status_code == 200
        assert c.get("/v1/sandboxes").json() == {"sandboxes": []}  # nothing was created


def test_tcp_without_a_token_is_refused_at_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_TOKEN"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "corral.server",
            "--socket",
            str(tmp_path / "s.sock"),
            "--state-dir",
            str(tmp_path / "state"),
            "--tcp",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "--token" in proc.stderr and "CORRAL_TOKEN" in proc.stderr
    assert not (tmp_path / "s.sock").exists()


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_sigint_stops_cleanly_and_leaves_nothing(make_daemon):
    d = make_daemon("--shutdown-grace", "0.5")
    state = str(d.state_dir)
    with uds_client(d.socket) as c:
        ids = [c.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"] for _ in range(3)]
        c.post(f"/v1/sandboxes/{ids[0]}/pause")
        assert len(_processes_mentioning(state)) >= 3
    with uds_client(d.socket) as c:  # a command still running when the signal comes
        with c.stream(
            "POST", f"/v1/sandboxes/{ids[1]}/exec/stream", json={"cmd": "echo go; sleep 60"}
        ) as reply:
            next(reply.iter_lines())
            started = time.monotonic()
            d.proc.send_signal(signal.SIGINT)  # (SIGTERM hands over: test_live_restore.py)
            assert d.proc.wait(30) == 0
    # (a paused sandbox currently takes the engine's 5 s STOP_WAIT_S to die)
    assert time.monotonic() - started < 15
    assert not d.socket.exists()
    assert state not in Path("/proc/self/mountinfo").read_text()
    assert _processes_mentioning(state) == []
    key = Layout(d.state_dir.absolute(), Path("/unused")).engine_key
    assert detect().children(f"corral/{key}") == []
    log = d.log.read_text()
    assert "listening on unix:" in log and "Traceback" not in log


def test_idle_exit(make_daemon):
    d = make_daemon("--idle-exit", str(IDLE_EXIT_S))
    with uds_client(d.socket) as c:
        sid = c.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
    time.sleep(IDLE_EXIT_S + 2)  # no request for longer than --idle-exit (checked each second)
    assert d.proc.poll() is None  # a live sandbox keeps it up
    with uds_client(d.socket) as c:
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert d.proc.wait(IDLE_EXIT_S + 60) == 0
    assert not d.socket.exists()
