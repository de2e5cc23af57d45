"""Run the ``corral`` command against the shared test daemon, in process or as a process."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass

import pytest

import corral
from corral.cli.main import main

LIVE = ["pending", "running", "paused", "stopping"]


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self):
        assert self.code == 0, self.err
        return json.loads(self.out)


@pytest.fixture
def client(daemon):
    """An SDK client on the test daemon; fails the test if it leaves sandboxes behind."""
    with corral.Client(daemon.url) as c:
        before = {sb.id for sb in corral.Sandbox.list(client=c)}
        yield c
        leaked = [sb for sb in corral.Sandbox.list(client=c) if sb.id not in before]
        for sb in leaked:
            sb.delete()
        assert not leaked, f"the test left sandboxes behind: {[sb.id for sb in leaked]}"


@pytest.fixture
def tag() -> str:
    """A tag only this test's sandboxes carry."""
    return f"clitest={secrets.token_hex(4)}"


@pytest.fixture
def cli(daemon, client, capsys):
    """``cli("ls", "--json")``: run ``main()`` in this process on the test daemon."""

    def run(*args: str) -> Run:
        capsys.readouterr()
        code = main(["--url", daemon.url, *args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@pytest.fixture
def cli_process(daemon, client):
    """Like ``cli``, but ``python -m corral.cli.main`` in a process of its own."""

    def run(*args: str, input: str | None = None, **kwargs) -> Run:
        p = subprocess.run(
            [sys.executable, "-m", "corral.cli.main", "--url", daemon.url, *args],
            input=input, capture_output=True, text=True, timeout=120,
            env={**os.environ, "COLUMNS": "160"}, **kwargs,
        )
        return Run(p.returncode, p.stdout, p.stderr)

    return run


@pytest.fixture
def sandbox(client, tag):
    """A running sandbox (64 MB) made through the SDK, deleted afterwards."""
    with corral.Sandbox.create(memory_mb=64, tags=[tag], timeout=600, client=client) as sb:
        yield sb
