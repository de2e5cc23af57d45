"""``Sandbox.run_once``: create, one command, delete, in one call (``POST /v1/run``)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

import corral
from tests.conftest import requires_root

pytestmark = requires_root


def test_run_once_returns_the_result_and_leaves_no_sandbox(client):
    r = corral.Sandbox.run_once("echo $GREETING; cat; touch /tmp/x; exit 3", memory_mb=64,
                                env={"GREETING": "hi"}, stdin="in\n", tags=["run-once"],
                                client=client)
    assert (r.returncode, r.stdout) == (3, "hi\nin\n")
    assert r.sandbox_id.startswith("sb-")
    with pytest.raises(corral.SandboxNotFound):
        corral.Sandbox.connect(r.sandbox_id, client=client)
    with pytest.raises(subprocess.CalledProcessError):
        corral.Sandbox.run_once("exit 1", memory_mb=64, check=True, client=client)
    late = corral.Sandbox.run_once("sleep 30", memory_mb=64, exec_timeout=0.5, client=client)
    assert late.timed_out
    assert corral.Sandbox.list(tags=["run-once"], client=client) == []


def test_each_run_gets_a_fresh_sandbox(daemon):
    async def main() -> list[corral.CommandResult]:
        async with corral.AsyncClient(daemon.url) as client:
            cmd = "test ! -e /tmp/used && touch /tmp/used && echo fresh"
            return await asyncio.gather(*(corral.AsyncSandbox.run_once(cmd, memory_mb=64,
                                                                       client=client)
                                          for _ in range(3)))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == ["fresh\n"] * 3
    assert len({r.sandbox_id for r in results}) == 3


def test_bad_input_is_refused_with_a_typed_error(client):
    with pytest.raises(corral.ImageNotFound):
        corral.Sandbox.run_once("true", "no-such-image-xyz", client=client)
    with pytest.raises(corral.InvalidArgument):
        corral.Sandbox.run_once("true", memory_mb=-5, client=client)
