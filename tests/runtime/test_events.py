"""What the engine announces, and to whom."""

import pytest

from corral.runtime.events import Events, SandboxEnded, StateChanged
from corral.schema import SandboxSpec, SandboxState
from tests.conftest import requires_root


def test_listeners_hear_their_kind_and_one_failing_does_not_stop_the_others():
    events, heard = Events(), []

    def broken(event):
        raise RuntimeError("listener bug")

    events.subscribe(SandboxEnded, broken)
    unsubscribe = events.subscribe(SandboxEnded, heard.append)
    events.subscribe(StateChanged, lambda e: heard.append("state"))
    ended = SandboxEnded("sb-1", SandboxState.STOPPED, "deleted")
    events.emit(ended)
    assert heard == [ended]
    unsubscribe()
    events.emit(ended)
    assert heard == [ended]


@requires_root
@pytest.mark.root
async def test_the_engine_announces_state_changes_and_the_end(engine):
    heard = []
    engine.events.subscribe(StateChanged, lambda e: heard.append((e.old, e.new)))
    engine.events.subscribe(SandboxEnded, lambda e: heard.append(("ended", e.state, e.reason)))
    info = await engine.create(SandboxSpec(memory_mb=64))
    await engine.pause(info.id)
    await engine.resume(info.id)
    await engine.delete(info.id)
    assert heard == [
        (SandboxState.RUNNING, SandboxState.PAUSED),
        (SandboxState.PAUSED, SandboxState.RUNNING),
        (SandboxState.RUNNING, SandboxState.STOPPING),
        (SandboxState.STOPPING, SandboxState.STOPPED),
        ("ended", SandboxState.STOPPED, "deleted"),
    ]
