"""Issue 23, part 5, on the cwsandbox gRPC port: the HTTP API's edge held there too.

Before, gRPC's own server accepted every connection (no cap in total or per address,
kept as long as the client liked), counted no live stream, and never throttled a wrong
token. Now the port is relayed through the daemon's connection book
(:mod:`corral.server.compat.cwsandbox_edge`) and its guard shares the HTTP API's
throttle and stream book (:mod:`corral.server.compat.cwsandbox_guard`). Real daemon,
the real grpc client with cwsandbox's own stubs, raw sockets from loopback addresses;
timeouts only stop hangs. The throttling test runs last: it blocks 127.0.0.1.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from tests.security.edge_daemon import HANG_GUARD_S, closed_by_daemon, silent, source, still_open
from tests.security.tenants_helpers import ADMIN_TOKEN, grpc_team

grpc = pytest.importorskip("grpc")
pytest.importorskip("cwsandbox")
from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc  # noqa: E402

PER_ADDRESS = 8
TOTAL = 48
STREAMS = 2


@pytest.fixture(scope="module")
def team():
    with grpc_team("--max-client-connections", str(PER_ADDRESS), "--max-connections",
                   str(TOTAL), "--max-tenant-streams", str(STREAMS)) as t:
        t.make_token("streamer")
        yield t


def _stub(team) -> tuple[grpc.Channel, sandbox_pb2_grpc.SandboxServiceStub]:
    channel = grpc.insecure_channel(team.grpc)
    return channel, sandbox_pb2_grpc.SandboxServiceStub(channel)


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _listed(team, token: str) -> grpc.StatusCode:
    channel, stub = _stub(team)
    with channel:
        try:
            stub.ListSandboxes(sandbox_pb2.ListSandboxesRequest(), metadata=_auth(token),
                               timeout=HANG_GUARD_S)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_unauthenticated_grpc_connections_are_capped_and_short_lived(team):
    # one address: every connection past the 8th closes that address's oldest at once
    same = [silent(int(team.grpc.rpartition(":")[2]), source(0)) for _ in range(40)]
    # many addresses: past the total, the oldest strangers make room
    many = [silent(int(team.grpc.rpartition(":")[2]), source(1 + i)) for i in range(TOTAL)]
    try:
        assert closed_by_daemon(same[:-PER_ADDRESS], within=HANG_GUARD_S, enough=32) == 32
        # a client with a token is let in over all of them (it was: no cap at all)
        assert _listed(team, team.tokens["alice"]) == grpc.StatusCode.OK
        # none is kept past the edge's short life for strangers (gRPC kept them forever)
        rest = same[-PER_ADDRESS:] + many
        assert still_open(rest) < len(rest)  # the total cap closed some already
        assert closed_by_daemon(rest, within=HANG_GUARD_S) == len(rest)
    finally:
        for s in same + many:
            s.close()


class _Stream:
    """A StreamExec call whose request side stays open until :meth:`end`."""

    def __init__(self, stub, token: str, first=None) -> None:
        self._requests: queue.Queue = queue.Queue()
        if first is not None:
            self._requests.put(first)
        self.done = threading.Event()
        self.call = stub.StreamExec(iter(self._requests.get, None), metadata=_auth(token),
                                    timeout=HANG_GUARD_S)
        self.call.add_done_callback(lambda _: self.done.set())

    def end(self) -> None:
        self.call.cancel()
        self._requests.put(None)


def test_a_tenants_grpc_streams_are_capped(team):
    channel, stub = _stub(team)
    with channel:
        streams = [_Stream(stub, team.tokens["streamer"]) for _ in range(STREAMS + 1)]
        try:
            # the one over the cap is refused (the others wait for their init); it was
            # never refused
            deadline = time.monotonic() + HANG_GUARD_S
            while not (refused := [s for s in streams if s.done.is_set()]):
                assert time.monotonic() < deadline, "no stream was refused"
                streams[-1].done.wait(0.1)
            assert len(refused) == 1, [s.call.code() for s in refused]
            assert refused[0].call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-tenant-streams" in refused[0].call.details()
            # another tenant is not affected, and a stream ended makes room
            held = [s for s in streams if s is not refused[0]]
            held[0].end()
            assert held[0].done.wait(HANG_GUARD_S)
            unknown = sandbox_pb2.ExecStreamRequest(init=sandbox_pb2.ExecStreamInit(
                sandbox_id="sb-0123456789ab", command=["true"]))
            for token in (team.tokens["streamer"], team.tokens["bob"]):
                # the daemon lets go of the ended one as its handler ends: a loop turn
                # or more after the client saw its cancel
                for _ in range(600):  # a hang guard, not a clock
                    admitted = _Stream(stub, token, unknown)
                    assert admitted.done.wait(HANG_GUARD_S)
                    if admitted.call.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        break
                    time.sleep(0.05)
                assert admitted.call.code() == grpc.StatusCode.NOT_FOUND, admitted.call.details()
        finally:
            for s in streams:
                s.end()


def test_a_main_command_the_daemon_would_keep_is_bounded(team):
    """Red team: the front-end keeps a create's main command while the sandbox lives;
    a tenant's creates with 30 MB commands grew the daemon by that much each."""
    channel, stub = _stub(team)
    with channel:
        spec = sandbox_pb2.Sandbox(spec={"containers": [
            {"image": "python", "command": "sh", "args": ["-c", "#" * (300 << 10)]}]})
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateSandbox(sandbox_pb2.CreateSandboxRequest(sandbox=spec),
                               metadata=_auth(team.tokens["bob"]), timeout=HANG_GUARD_S)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "containers[0].files" in refused.value.details()  # says what to do


def test_a_sandbox_deleted_elsewhere_is_forgotten_by_the_grpc_front_end():
    """Red team: a sandbox made over gRPC but deleted over HTTP (or by its lifetime)
    stayed in the front-end's tables, command and all, for the daemon's life."""
    from corral.runtime.events import SandboxDeleted
    from corral.server.app import create_app
    from corral.server.compat.cwsandbox import CwSandboxFrontend
    from corral.server.compat.cwsandbox_edge import GrpcEdge
    from corral.server.conn_limits import ConnectionBook
    from corral.server.settings import ServerSettings
    from tests.server.test_units import FakeEngine

    settings = ServerSettings(token=ADMIN_TOKEN, max_memory_mb=4096, grpc=("127.0.0.1", 0))
    app = create_app(settings, FakeEngine())
    service = CwSandboxFrontend(
        settings, app.state.engine, app.state.service, app.state.door,
        edge=GrpcEdge(ConnectionBook(16, 4)), throttle=app.state.throttle,
        streams=app.state.streams).service
    service._commands["sb-0123456789ab"] = ("sh", ("-c", "x" * 1000))  # noqa: SLF001
    service._exit_codes["sb-0123456789ab"] = 0  # noqa: SLF001
    app.state.engine.events.emit(SandboxDeleted("sb-0123456789ab", "bob"))
    assert not service._commands and not service._exit_codes  # noqa: SLF001


def test_wrong_grpc_tokens_are_throttled_and_the_block_holds_on_both_ports(team):
    codes = [_listed(team, "crl_" + "x" * 43) for _ in range(30)]
    assert codes[0] == grpc.StatusCode.UNAUTHENTICATED
    assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED, codes  # was: UNAUTHENTICATED forever
    # the address is blocked: its next try is refused before the token is checked, on the
    # gRPC port and on the HTTP API alike (one throttle)
    assert _listed(team, ADMIN_TOKEN) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with team.tcp(ADMIN_TOKEN) as http:
        assert http.get("/v1/info").status_code == 429
    with team.admin() as admin:  # the Unix socket never is
        assert admin.get("/v1/info").status_code == 200
