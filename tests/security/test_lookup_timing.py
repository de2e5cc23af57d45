"""Attack 8 of issue 23, its last line: another tenant's real sandbox id answered a
little slower than an id that never existed (its row was read and its spec parsed
before ownership was checked), so timing told a tenant which ids were live. Now the
owner is part of the query (:meth:`corral.runtime.registry.Registry.get`): another's
row is never read, so both cost the same work. Asserted as work done (rows parsed),
never as time.
"""

from __future__ import annotations

import pytest

import corral.runtime.registry as registry_module
from corral.errors import SandboxNotFound
from corral.schema import SandboxSpec


async def test_another_tenants_id_costs_what_an_unknown_id_costs(engine, monkeypatch):
    theirs = await engine.create(SandboxSpec(memory_mb=64, tenant="alice"))
    try:
        parsed = []
        real = registry_module._info

        def counting(row, *rest):
            parsed.append(row[0])
            return real(row, *rest)

        monkeypatch.setattr(registry_module, "_info", counting)
        unknown = theirs.id[:-4] + ("0000" if not theirs.id.endswith("0000") else "1111")
        for sid in (theirs.id, unknown):
            with pytest.raises(SandboxNotFound) as refused:
                engine.get(sid, owner="bob")
            assert refused.value.message == f"no sandbox {sid!r}: it never existed or was deleted"
            assert await engine.delete(sid, owner="bob") is False  # deleting reads no row either
        assert parsed == []  # no lookup read a sandbox's row
        assert engine.get(theirs.id, owner="alice").id == theirs.id  # its owner still finds it
        assert parsed == [theirs.id]
    finally:
        await engine.delete(theirs.id)
