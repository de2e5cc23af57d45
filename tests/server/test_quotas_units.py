"""Quotas and tokens without a daemon: the book's arithmetic, hashing, revocation."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from corral.errors import InvalidArgument, NotFound, QuotaExceeded
from corral.server.admission import Admission, Limits
from corral.server.quotas import Quotas
from corral.server.tenants import ADMIN, Tenant, Tenants, TokenStore


def _book(**quota) -> Quotas:
    return Quotas(lambda name: Tenant(name, **quota) if name == "t" else None)


def test_hold_settle_release():
    book = _book(max_sandboxes=2, max_memory_mb=100, max_cpus=1.5)
    a = book.hold("t", 40, 0.5)
    book.settle(a, "sb-a")
    b = book.hold("t", 40, 0.5)
    with pytest.raises(QuotaExceeded) as caught:
        book.hold("t", 10, 0.1)
    assert caught.value.details == {"quota": "max_sandboxes", "limit": 2, "used": 2,
                                    "requested": 1, "tenant": "t"}
    book.settle(b, None)  # its create failed: the room is back at once
    with pytest.raises(QuotaExceeded) as caught:
        book.hold("t", 61, 0.1)
    assert caught.value.details["quota"] == "max_memory_mb" and caught.value.status == 429
    with pytest.raises(QuotaExceeded) as caught:
        book.hold("t", 10, 1.01)
    assert caught.value.details["quota"] == "max_cpus"
    book.release("sb-a")
    book.release("sb-a")  # twice: nothing more
    assert book.usage("t").sandboxes == 0
    assert book.hold(None, 1 << 20, 256) is None  # the admin: no quota
    assert book.hold("other", 1 << 20, 256) is not None  # no quotas set: the caps only


async def test_admission_gives_the_quota_back_when_a_create_fails():
    admission = Admission(Limits(max_starting=4, max_sandboxes=4, max_memory_mb=1000,
                                 queue_size=4, queue_timeout=5), _book(max_sandboxes=1))
    with pytest.raises(RuntimeError):
        async with admission.admit(10, tenant="t"):
            raise RuntimeError("the engine failed")
    async with admission.admit(10, tenant="t") as slot:
        slot.commit("sb-1")
    with pytest.raises(QuotaExceeded):
        async with admission.admit(10, tenant="t"):
            pass
    admission.release("sb-1")
    results = await asyncio.gather(*(_try(admission) for _ in range(10)))
    assert sorted(results) == [False] * 9 + [True]


async def _try(admission: Admission) -> bool:
    try:
        async with admission.admit(10, tenant="t") as slot:
            await asyncio.sleep(0)
            slot.commit(f"sb-{id(slot)}")
    except QuotaExceeded:
        return False
    return True


def test_tokens_are_hashed_checked_and_revoked():
    db = sqlite3.connect(":memory:")
    store = TokenStore(db)
    TokenStore(db)  # opening again (the migration) keeps what is there
    tenant, token = store.create("team-a", max_sandboxes=3)
    assert tenant.max_sandboxes == 3 and token.startswith("crl_") and len(token) == 47
    dump = "\n".join(db.iterdump())
    assert token not in dump and token[4:] not in dump
    tenants = Tenants(store, "the-admin-token")
    assert tenants.identify(token).name == "team-a"
    assert tenants.identify("the-admin-token") is ADMIN
    for wrong in ("", token[:-1], token + "x", "the-admin-token ", None):
        assert tenants.identify(wrong) is None
    for name in ("admin", "Team", "", "a" * 64, "-x"):
        with pytest.raises(InvalidArgument):
            store.create(name)
    with pytest.raises(InvalidArgument):
        store.create("team-a")
    store.revoke("team-a")
    assert tenants.identify(token) is None
    with pytest.raises(NotFound):
        store.revoke("team-a")
    # ownership is by name: a revoked tenant's name is never given to a new tenant
    with pytest.raises(InvalidArgument, match="revoked tenant"):
        store.create("team-a")
    assert store.list() == []
    assert Tenants(store, None).identify("") is None  # no admin token: none matches
