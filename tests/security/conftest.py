"""Helpers for the attack tests: each runs real code inside a real sandbox."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import have_root_runtime


@pytest.fixture
async def sandbox(engine):
    """A default sandbox (uid 1000, no capabilities, seccomp on): ``(engine, id)``."""
    if not have_root_runtime():
        pytest.skip("needs root")
    info = await engine.create()
    yield engine, info.id


async def run_json(engine, sid: str, code: str, *args: str, timeout: float = 120) -> dict:
    """Run Python ``code`` in the sandbox; it prints one JSON object, which is returned."""
    r = await engine.exec(sid, ["python3", "-c", code, *args], timeout=timeout)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


async def assert_honest(engine, sid: str) -> None:
    """After an attack, a command still gets its real exit code and output back."""
    r = await engine.exec(sid, "echo honest; echo err >&2; exit 3", timeout=60)
    assert (r.returncode, r.stdout, r.stderr, r.timed_out) == (3, b"honest\n", b"err\n", False)
    r = await engine.exec(sid, ["sleep", "30"], timeout=0.5)  # timeouts still enforced
    assert r.timed_out


def agent_host_pid(engine, sid: str) -> int:
    """The host pid of the agent: the only child of the sandbox's outer bwrap."""
    bwrap = engine._live[sid].proc.pid
    children = Path(f"/proc/{bwrap}/task/{bwrap}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.fixture
def shm():
    """A private directory on a tmpfs (/dev/shm), as a sandbox's writable layer is."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs")
    d = Path(tempfile.mkdtemp(prefix="corral-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
