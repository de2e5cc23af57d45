"""Fixtures for the RL toolkit's tests."""

from __future__ import annotations

import pytest

import corral


@pytest.fixture
def client(daemon):
    """A client of a private daemon that fails the test if it leaves sandboxes running."""
    with corral.Client(daemon.url) as c:
        before = {sb.id for sb in corral.Sandbox.list(state="running", client=c)}
        yield c
        leaked = {sb.id for sb in corral.Sandbox.list(state="running", client=c)} - before
        for sid in leaked:
            corral.Sandbox.connect(sid, client=c).delete()
        assert not leaked, f"the test left sandboxes behind: {sorted(leaked)}"
