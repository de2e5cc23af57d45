"""``sb.state`` once the lifetime ran out, and binary output as bytes (issue 25, item 9)."""

from __future__ import annotations

import time

import corral
from tests.conftest import requires_root

pytestmark = requires_root


def test_state_is_not_running_once_the_lifetime_ran_out(client):
    sb = corral.Sandbox.create(memory_mb=64, timeout=1, client=client)
    try:
        assert sb.info.state == corral.SandboxState.RUNNING  # as the create saw it
        time.sleep(1.2)
        # no call since the create: the lifetime alone says it
        assert sb.state == corral.SandboxState.STOPPED
        deadline = time.monotonic() + 30
        while sb.refresh().state != corral.SandboxState.STOPPED:
            assert time.monotonic() < deadline, sb.info
            time.sleep(0.2)
        assert sb.info.reason.startswith("timeout")
    finally:
        sb.delete()


def test_a_longer_lifetime_set_later_counts(client):
    # 15 s: the set_timeout must reach the daemon before the first lifetime ends (1 s
    # could run out first under load, and 5 s is not much more)
    made = time.time()
    with corral.Sandbox.create(memory_mb=64, timeout=15, client=client) as sb:
        sb.set_timeout(600)
        time.sleep(max(0.0, made + 17 - time.time()))  # past the first lifetime (the
        # reaper looks every half second)
        assert sb.state == corral.SandboxState.RUNNING
        assert sb.refresh().state == corral.SandboxState.RUNNING


def test_binary_output_comes_back_as_bytes(client):
    with corral.Sandbox.create(memory_mb=64, client=client) as sb:
        r = sb.exec(["python3", "-c", "import sys; sys.stdout.buffer.write(bytes(range(256)))"])
        assert r.stdout_bytes == bytes(range(256))
        assert "\ufffd" in r.stdout  # the text view replaces what is not UTF-8
