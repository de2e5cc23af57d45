"""The edge's bookkeeping without a daemon (issue 23): connection books, the log's
repeat filter, the failed-auth throttle, the live-stream book and node proofs. The
attacks themselves run against real daemons in tests/security (test_connection_limits,
test_auth_throttle, test_stream_limits, test_node_proof)."""

from __future__ import annotations

import logging

from corral.cluster import proof
from corral.server.auth_throttle import AuthThrottle, name_of, weak_token_warning
from corral.server.conn_limits import (
    Connection,
    ConnectionBook,
    accept_backlog,
    default_max_connections,
)
from corral.server.log_limits import RepeatFilter
from corral.server.stream_limits import StreamBook, is_live


def _conn(book: ConnectionBook, client: str, closed: list[Connection]) -> Connection:
    conn = Connection(client, lambda: closed.append(conn))
    assert book.admit(conn)
    return conn


def test_a_full_book_closes_idle_strangers_first_then_refuses():
    closed: list[Connection] = []
    book = ConnectionBook(max_connections=3, max_client_connections=10)
    known = _conn(book, "a", closed)
    book.promote(known)
    busy = _conn(book, "b", closed)
    busy.busy = 1
    idle = _conn(book, "c", closed)
    _conn(book, "d", closed)  # room made: the idle stranger went, not the busy one
    assert closed == [idle] and book.unauthenticated() == 2
    closed.clear()
    _conn(book, "e", closed)  # the next idle stranger ("d") makes room
    assert [c.client for c in closed] == ["d"]
    for c in list(book._unauth):  # noqa: SLF001
        c.busy = 1
    # no idle stranger left, and the authenticated hold no more than half: refused, the
    # authenticated connection stays
    assert not book.admit(Connection("f", lambda: None))
    assert book.refused == 1 and known not in closed
    crowd = ConnectionBook(max_connections=3, max_client_connections=10)
    first = _conn(crowd, "a", closed)
    crowd.promote(first)
    crowd.promote(_conn(crowd, "b", closed))
    _conn(crowd, "c", closed).busy = 1
    _conn(crowd, "d", closed)  # two of three authenticated: the oldest idle one makes room
    assert closed[-1] is first


def test_one_address_makes_room_among_its_own():
    closed: list[Connection] = []
    book = ConnectionBook(max_connections=100, max_client_connections=2)
    first = _conn(book, "a", closed)
    _conn(book, "a", closed)
    other = _conn(book, "b", closed)
    _conn(book, "a", closed)
    assert closed == [first] and other not in closed
    assert book.unauthenticated("a") == 2


def test_limits_follow_the_open_file_limit():
    assert default_max_connections(1024) == 768
    assert default_max_connections(256) == 128
    assert accept_backlog(1024, 4096) == 128
    assert accept_backlog(1 << 20, 4096) == 4096


def test_repeated_log_lines_become_a_count():
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    repeat = RepeatFilter(burst=3, window=3600)
    handler.addFilter(repeat)
    log = logging.getLogger("corral.test.edge")
    log.addHandler(handler)
    log.propagate = False
    try:
        for i in range(50):
            log.error("accept failed %d", i)
        log.error("another kind")
    finally:
        log.removeHandler(handler)
    assert len(records) == 4


def test_the_throttle_blocks_unchecked_and_remembers_good_addresses():
    throttle = AuthThrottle(free=3, name_free=5)
    for _ in range(4):  # past 3
        assert throttle.refusal("10.0.0.1", "guess") is None
        throttle.failed("10.0.0.1", "guess")
    blocked = throttle.refusal("10.0.0.1", "the-real-token")
    assert blocked is not None and blocked.details["retry_after"] >= 1
    assert throttle.refusal("10.0.0.2", "x") is None  # another address
    throttle.succeeded("10.0.0.9", "admin-token")
    for i in range(6):  # past 5
        throttle.failed(f"10.0.1.{i}", "guess")
    assert throttle.refusal("10.0.2.1", "guess") is not None  # the name: strangers wait
    assert throttle.refusal("10.0.0.9", "admin-token") is None  # its known address does not
    throttle.failed("10.0.3.1", None)  # no credential: no guess
    assert throttle.refusal("10.0.3.1", None) is None



def test_a_connection_counts_the_descriptors_it_holds():
    """Red team: a relayed gRPC connection holds three descriptors; counted as one,
    --max-connections of them exhausted the daemon's open-file limit (accept failed
    for everyone)."""
    closed: list[Connection] = []
    book = ConnectionBook(max_connections=9, max_client_connections=10)
    relayed = [Connection(f"g{i}", lambda i=i: closed.append(relayed[i]), cost=3)
               for i in range(4)]
    assert all(book.admit(c) for c in relayed[:3])  # 9 descriptors: full
    assert book.admit(relayed[3]) and closed == [relayed[0]]  # the oldest stranger goes
    book.promote(relayed[1])
    assert book.admit(Connection("h", lambda: None)) and closed == relayed[:3:2]
    # past what idle strangers free, an authenticated connection is not pushed out
    assert not book.admit(Connection("h2", lambda: None, cost=9))
    assert relayed[1] not in closed

def test_credential_names():
    assert name_of("crl_abc") != name_of("admin-secret")
    assert name_of("alice.0f0f") == name_of("alice.1e1e") != name_of("bob.0f0f")
    assert weak_token_warning("x" * 9) and weak_token_warning("x" * 32) is None


def test_the_stream_book():
    book = StreamBook(per_session=2, per_tenant=3)
    keys = [("session", 1), ("tenant", "t")]
    assert book.take(keys) is None and book.take(keys) is None
    assert book.take(keys) is not None  # the session is full
    assert book.take([("session", 2), ("tenant", "t")]) is None
    assert book.take([("session", 3), ("tenant", "t")]) is not None  # the tenant is full
    book.give(keys)
    assert book.held("session", 1) == 1
    assert is_live({"headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
    assert not is_live({"headers": [(b"content-type", b"application/x-ndjson"),
                                     (b"content-length", b"3")]})
    assert not is_live({"headers": [(b"content-type", b"application/json")]})


def test_a_proof_binds_node_address_and_nonce():
    private, public = proof.make_key()
    sig = proof.sign(private, "n1", "10.0.0.1", 7000, "ab" * 32)
    assert proof.verify(public, sig, "n1", "10.0.0.1", 7000, "ab" * 32)
    assert not proof.verify(public, sig, "n1", "10.0.0.1", 7001, "ab" * 32)  # another port
    assert not proof.verify(public, sig, "n2", "10.0.0.1", 7000, "ab" * 32)
    assert not proof.verify(public, sig, "n1", "10.0.0.1", 7000, "cd" * 32)
    assert not proof.verify(public, "not base64!", "n1", "10.0.0.1", 7000, "ab" * 32)
    pins = proof.Pins([("http://10.0.0.1:7000", "n1", public), ("http://10.0.0.2:1", "n2", "")])
    assert pins.get("10.0.0.1", 7000) == proof.Pin("n1", public)
    assert not pins.lists("http://10.0.0.2:1")  # no key: never contacted


def test_a_call_held_after_its_token_was_revoked_is_cancelled_at_once():
    """Red team: a gRPC call's credential is checked a loop turn before its handler
    registers it; a revoke in between left that call (a StreamExec: for hours) running."""
    from corral.server.caller import Caller
    from corral.server.open_calls import OpenCalls
    from corral.server.tenant_model import Tenant

    calls, cancelled = OpenCalls(), []
    assert calls.close_token("alice") == 0  # revoked while nothing was held yet
    with calls.holding(Caller.of_tenant(Tenant("alice")), lambda: cancelled.append("alice")):
        assert cancelled == ["alice"]
    with calls.holding(Caller.of_tenant(Tenant("bob")), lambda: cancelled.append("bob")):
        assert cancelled == ["alice"]  # another tenant's goes on
