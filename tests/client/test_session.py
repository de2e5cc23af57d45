"""Sessions: shared defaults and tags, everything deleted on close."""

from __future__ import annotations

import pytest

import corral


def test_session_applies_defaults_and_tags(client):
    with corral.Session(defaults=dict(image="python", memory_mb=256), tags=["job=7"], client=client) as s:
        assert s.id.startswith("ses-") and s.tag == f"session={s.id}"
        a = s.create()
        b = s.create(memory_mb=512, tags=["big"])
        assert (a.info.spec.memory_mb, b.info.spec.memory_mb) == (256, 512)
        assert a.tags == ["job=7", s.tag] and b.tags == ["job=7", s.tag, "big"]
        assert [x.id for x in s.sandboxes] == [a.id, b.id]
        assert {x.id for x in corral.Sandbox.list(tags=[s.tag], client=client)} == {a.id, b.id}
    assert s.closed and s.sandboxes == []
    assert corral.Sandbox.list(tags=[s.tag], client=client) == []
    with pytest.raises(corral.InvalidState, match="closed"):
        s.create()
    s.close()  # twice is fine


def test_session_cleans_up_after_an_exception(client):
    with pytest.raises(ValueError, match="bad reward"):
        with corral.Session(tags=["job=8"], client=client) as s:
            for _ in range(3):
                s.create(memory_mb=64)
            raise ValueError("bad reward")
    assert corral.Sandbox.list(tags=[s.tag], client=client) == []


def test_session_deletes_tagged_sandboxes_it_did_not_see(client):
    s = corral.Session(client=client)
    stray = corral.Sandbox.create(tags=[s.tag], client=client)  # e.g. a create whose reply was lost
    s.close()
    with pytest.raises(corral.SandboxNotFound):
        stray.refresh()


def test_session_rejects_bad_defaults_at_once():
    with pytest.raises(corral.InvalidArgument, match="memory_mb"):
        corral.Session(defaults={"memory_mb": -1})
    with pytest.raises(corral.InvalidArgument, match="no_such_field"):
        corral.Session(defaults={"no_such_field": 1})
