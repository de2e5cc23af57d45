"""The embedded default: with no daemon configured, the SDK starts one and shares it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import corral
from corral.client import _embed
from tests.conftest import requires_root

START_LINE = "starts the embedded daemon"

SCRIPT = """
import corral
with corral.Sandbox.create(memory_mb=64) as sb:
    print(sb.exec("echo hi from $0", timeout=10).stdout.strip())
"""


@pytest.fixture
def embed_env(monkeypatch):
    """A private socket and state directory; the embedded daemon is stopped afterwards."""
    base = Path(tempfile.mkdtemp(prefix="corral-embed-"))
    os.chmod(base, 0o711)  # bwrap, as the sandbox's uid, must reach the state directory
    sock = base / "run" / "corral.sock"
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_NO_EMBED")}
    env.update(CORRAL_SOCKET=str(sock), CORRAL_STATE_DIR=str(base / "state"))
    yield env, sock
    _stop_embedded(sock)
    shutil.rmtree(base, ignore_errors=True)


def _stop_embedded(sock: Path) -> None:
    pid_file = _embed.sidecar(sock, ".pid")
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGINT)  # (SIGTERM would hand its sandboxes over)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _run(env: dict[str, str], n: int) -> list[str]:
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(n)
    ]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outputs.append(out.strip())
    return outputs


@requires_root
def test_embedded_daemon_starts_once_and_is_reused(embed_env):
    env, sock = embed_env
    assert not sock.exists()
    # Three processes at once find nothing listening; the lock lets one start a daemon.
    assert _run(env, 3) == ["hi from /bin/sh"] * 3
    log = _embed.sidecar(sock, ".log").read_text()
    assert log.count(START_LINE) == 1, log
    pid = int(_embed.sidecar(sock, ".pid").read_text())
    assert _alive(pid)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert [b"--socket", str(sock).encode(), b"--idle-exit", b"300"] == cmdline[3:7]
    assert os.getsid(pid) == pid  # detached: a session of its own

    # A later process reuses it.
    assert _run(env, 1) == ["hi from /bin/sh"]
    assert _embed.sidecar(sock, ".log").read_text().count(START_LINE) == 1
    assert int(_embed.sidecar(sock, ".pid").read_text()) == pid


@requires_root
def test_embedded_daemon_that_dies_reports_its_log(embed_env):
    env, sock = embed_env
    blocker = Path(env["CORRAL_STATE_DIR"])
    blocker.write_text("not a directory")  # the engine cannot open its state there
    code = "import corral; corral.Sandbox.list()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "DaemonUnavailable" in proc.stderr and "exited with status" in proc.stderr
    log = _embed.sidecar(sock, ".log")
    assert str(log) in proc.stderr
    last_line = log.read_text().strip().splitlines()[-1]
    assert last_line in proc.stderr.split("exited with status", 1)[1]  # the log's tail


def test_no_embed_and_not_root_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("CORRAL_URL", raising=False)
    monkeypatch.setenv("CORRAL_SOCKET", str(tmp_path / "corral.sock"))
    monkeypatch.setenv("CORRAL_NO_EMBED", "1")
    with corral.Client() as c:
        with pytest.raises(corral.DaemonUnavailable, match="corral serve"):
            c.health()
    assert not (tmp_path / "corral.log").exists()

    monkeypatch.setattr(_embed.os, "geteuid", lambda: 1000)
    with pytest.raises(corral.DaemonUnavailable, match="needs root"):
        _embed.ensure_daemon(str(tmp_path / "corral.sock"))
    assert list(tmp_path.iterdir()) == []
