"""Attacks on the daemon's request handling: every request costs a bounded amount, and
nothing is read or parsed before the client is authenticated (issue 12, part 3).

Each test states how the code before this change failed it. Figures are measured and
printed (``pytest -s``); wall-clock times are never asserted, timeouts only stop hangs.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import httpx
import pytest

import corral
from tests.conftest import Daemon, _base_dir, have_root_runtime
from tests.server.conftest import free_port, uds_client

TOKEN = "bounds-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UNKNOWN = "/v1/sandboxes/sb-0123456789ab"
HANG_GUARD_S = 120  # generous: only keeps a broken daemon from hanging the suite


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _wait_for_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


class Served:
    def __init__(self, daemon: Daemon, http: int, grpc: int) -> None:
        self.daemon, self.http_port, self.grpc_port = daemon, http, grpc
        self.base = f"http://127.0.0.1:{http}"
        assert daemon.proc is not None
        self.pid = daemon.proc.pid

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=AUTH, timeout=HANG_GUARD_S, **kwargs)


def _serve(*extra: str) -> Served:
    http, grpc_port = free_port(), free_port()
    daemon = Daemon(_base_dir(), ["--tcp", f"127.0.0.1:{http}", "--token", TOKEN,
                                  "--grpc", f"127.0.0.1:{grpc_port}", *extra]).start()
    _wait_for_port(http)
    _wait_for_port(grpc_port)
    return Served(daemon, http, grpc_port)


@pytest.fixture(scope="module")
def served():
    """One daemon on a Unix socket, TCP (token) and gRPC (token)."""
    if not have_root_runtime():
        pytest.skip("needs root")
    s = _serve()
    yield s
    s.daemon.stop()
    shutil.rmtree(s.daemon.base, ignore_errors=True)


def _error(reply: httpx.Response, status: int, code: str) -> dict:
    assert reply.status_code == status, reply.text[:500]
    body = reply.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return body["error"]


# ------------------------------------------------------------------- amplification


def test_a_4mb_array_body_gets_a_small_typed_error_at_once(served):
    """Before: 43.9 s, a 262 MB reply (one error per element), /v1/health held for
    37 s, the daemon 445 MB bigger. Now: refused by the bounded parse before pydantic."""
    body = b'{"cmd": [' + b",".join([b"1"] * 2_000_000) + b"]}"
    assert len(body) > 4_000_000
    replies: dict[str, httpx.Response] = {}
    took: dict[str, float] = {}

    def post() -> None:
        started = time.monotonic()
        with served.client() as c:
            replies["attack"] = c.post(UNKNOWN + "/exec", content=body)
        took["attack"] = time.monotonic() - started

    before = rss_mb(served.pid)
    attacker = threading.Thread(target=post)
    attacker.start()
    started = time.monotonic()
    with served.client() as c:  # a bystander's health check, while the attack is sent
        replies["health"] = c.get("/v1/health")
    took["health"] = time.monotonic() - started
    attacker.join(HANG_GUARD_S)
    assert not attacker.is_alive()
    growth = rss_mb(served.pid) - before
    print(f"4 MB body: {len(replies['attack'].content)} bytes back in {took['attack']:.3f} s; "
          f"health in {took['health']:.3f} s; RSS +{growth:.1f} MB")
    assert replies["health"].status_code == 200
    err = _error(replies["attack"], 400, "invalid_argument")
    assert err["details"]["limit"] == "max_json_items"
    assert len(replies["attack"].content) < 4096
    assert growth < 50  # before: +445 MB


def test_validation_errors_are_capped_in_count_and_size(served):
    """Before: 1000 wrong elements gave 1000 errors (and a message naming each)."""
    with served.client() as c:
        reply = c.post(UNKNOWN + "/exec", json={"cmd": [1] * 1000})
    err = _error(reply, 400, "invalid_argument")
    assert 1 <= len(err["details"]["errors"]) <= 10
    assert "more errors" in err["message"]
    assert len(reply.content) < 4096
    long_tag = "x" * 5000  # an invalid value is not echoed back whole
    with served.client() as c:
        reply = c.post("/v1/sandboxes", json={"tags": [long_tag]})
    err = _error(reply, 400, "invalid_argument")
    assert all(len(e["message"]) <= 200 for e in err["details"]["errors"])
    assert len(reply.content) < 2048


def test_deep_nesting_is_a_typed_400(served):
    """Before: json.loads raised RecursionError: a 500 ``internal``."""
    deep = b'{"cmd": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with served.client() as c:
        reply = c.post(UNKNOWN + "/exec", content=deep)
    err = _error(reply, 400, "invalid_argument")
    assert err["details"]["limit"] == "max_json_depth"
    with served.client() as c:  # depth in strings does not count
        reply = c.post(UNKNOWN + "/exec", json={"cmd": "[" * 100_000})
    _error(reply, 404, "sandbox_not_found")


# ---------------------------------------------------------------- strict types

STRICT = [  # (method, path, body, field): each was coerced before (e.g. "512" → 512)
    ("POST", "/v1/sandboxes", {"memory_mb": "512"}, "memory_mb"),  # before: 201, created
    ("POST", "/v1/sandboxes", {"cpus": "1"}, "cpus"),
    ("POST", "/v1/sandboxes", {"disk_mb": 512.0}, "disk_mb"),
    ("POST", UNKNOWN + "/fork", {"n": "2"}, "n"),  # before: 404 (n taken as 2)
    ("POST", UNKNOWN + "/stop", {"grace": False}, "grace"),  # before: 404 (grace 0)
    ("POST", UNKNOWN + "/exec", {"cmd": "true", "timeout": "5"}, "timeout"),
    ("POST", UNKNOWN + "/files/mkdir", {"path": "/x", "parents": "yes"}, "parents"),
    ("POST", UNKNOWN + "/processes/proc-1/signal", {"signal": True}, "signal"),  # was SIGHUP
    ("POST", "/v1/pools", {"min_ready": "1"}, "min_ready"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), STRICT,
                         ids=[f"{p} {f}" for _, p, _, f in STRICT])
def test_strict_types_are_refused(served, method, path, body, field):
    with served.client() as c:
        reply = c.request(method, path, json=body)
    err = _error(reply, 400, "invalid_argument")
    assert any(e["field"].split(".")[0] == field for e in err["details"]["errors"]), err


def test_5000_tags_are_refused(served):
    """Before: accepted (a sandbox with 5000 tags in the registry)."""
    with served.client() as c:
        reply = c.post("/v1/sandboxes", json={"tags": [f"t{i}" for i in range(5000)]})
    err = _error(reply, 400, "invalid_argument")
    assert err["details"]["errors"][0]["field"] == "tags"
    assert len(reply.content) < 2048


# ------------------------------------------------------------ before authentication


def _raw(port: int, data: bytes, timeout: float = HANG_GUARD_S) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(data)
    return sock


def _read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole reply (status, headers, body), read until the server closes."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def test_a_slow_body_before_auth_is_cut(served):
    """Before: the 401 came back but the connection stayed open (keep-alive) while the
    client trickled its 10 MB body, every byte resetting the idle timer."""
    sock = _raw(served.http_port, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n{")
    with sock:
        sock.settimeout(HANG_GUARD_S)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 401"), first[:200]
        assert b"connection: close" in first.lower()
        closed = False
        for _ in range(50):  # bounded: 50 × 0.1 s of trickling
            try:
                sock.sendall(b" ")
                sock.settimeout(0.1)
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:  # reset: closed too
                closed = True
                break
        assert closed, "the daemon kept reading an unauthenticated body"


def test_slow_headers_are_cut_with_a_typed_408(served):
    """Before: a connection that never finished its headers stayed open for good."""
    sock = _raw(served.http_port, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")  # no end
    with sock:
        started = time.monotonic()
        status, headers, body = _read_reply(sock)
        print(f"unfinished headers cut after {time.monotonic() - started:.1f} s")
    assert status == 408 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_oversized_headers_get_a_typed_431(served):
    """Before: 1 MB of headers was read whole (httptools sets no limit) and answered 401."""
    junk = b"".join(b"X-Junk-%d: %s\r\n" % (i, b"a" * 1000) for i in range(1000))
    sock = _raw(served.http_port, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + junk + b"\r\n")
    with sock:
        status, _, body = _read_reply(sock)
    assert status == 431
    assert json.loads(body)["error"]["code"] == "headers_too_large"


def test_a_malformed_request_gets_the_json_error_shape(served):
    """Before: uvicorn's plain-text 'Invalid HTTP request received.'"""
    with _raw(served.http_port, b"NOT HTTP AT ALL\x00\r\n\r\n") as sock:
        status, headers, body = _read_reply(sock)
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "invalid_argument"


def test_405_names_every_allowed_method(served):
    """Before: Allow named only the first route matching the path (``GET, HEAD``)."""
    with served.client() as c:
        reply = c.request("PUT", UNKNOWN)
    err = _error(reply, 405, "method_not_allowed")
    allowed = {m.strip() for m in reply.headers["allow"].split(",")}
    assert {"GET", "DELETE", "PATCH"} <= allowed
    assert set(err["details"]["allow"]) == allowed


def test_an_unauthenticated_95mb_grpc_message_is_not_buffered(served):
    """Before: authentication ran in the handler, after the 100 MB-capped message was
    read: 8 such messages grew the daemon by ~890 MB. Now the interceptor refuses the
    call before any message is read, and an authenticated one is capped at 33 MiB."""
    grpc = pytest.importorskip("grpc")
    from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc

    payload = b"x" * (95 << 20)
    options = [("grpc.max_send_message_length", 200 << 20)]
    before = rss_mb(served.pid)
    codes = []
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}", options=options) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        request = sandbox_pb2.WriteFileRequest(sandbox_id="x", path="/a", content=payload)
        for _ in range(8):
            try:
                stub.WriteFile(request, timeout=HANG_GUARD_S)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        try:  # with the token: over the message cap, refused by size
            stub.WriteFile(request, timeout=HANG_GUARD_S,
                           metadata=[("authorization", f"Bearer {TOKEN}")])
        except grpc.RpcError as exc:
            codes.append(exc.code())
    growth = rss_mb(served.pid) - before
    print(f"9 × 95 MB gRPC messages: daemon RSS +{growth:.1f} MB")
    assert codes[:8] == [grpc.StatusCode.UNAUTHENTICATED] * 8
    assert codes[8] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert growth < 50


def test_one_client_cannot_hold_every_request_slot(make_daemon):
    """Before: no per-client cap (any number of requests in flight per client)."""
    port = free_port()
    daemon = make_daemon("--tcp", f"127.0.0.1:{port}", "--token", TOKEN,
                         "--max-client-requests", "2")
    _wait_for_port(port)
    held = []  # two requests in flight: bodies announced, never sent
    for _ in range(2):
        held.append(_raw(port, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                     + f"Authorization: Bearer {TOKEN}\r\n".encode()
                     + b"Content-Length: 100\r\n\r\n{"))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                          timeout=HANG_GUARD_S) as c:
            for _ in range(600):  # bounded: until both held requests are counted
                reply = c.get("/v1/health")
                if reply.status_code == 429:
                    break
                time.sleep(0.1)
        err = _error(reply, 429, "too_many_requests")
        assert err["details"] == {"limit": "max_client_requests", "value": 2}
        with uds_client(daemon.socket) as local:  # the Unix socket's owner is not capped
            assert local.get("/v1/health").status_code == 200
    finally:
        for sock in held:
            sock.close()


# ------------------------------------------------------------------- host network


def test_host_network_over_tcp_needs_the_daemons_consent(served):
    """Before: any TCP client with the token got a sandbox on the host's network (its
    loopback services, the cloud metadata address)."""
    spec = {"memory_mb": 64, "network": "host"}
    with served.client() as c:
        error = _error(c.post("/v1/sandboxes", json=spec), 403, "forbidden")
        assert "--allow-host-network" in error["message"]
        _error(c.post("/v1/pools", json={"name": "hostnet", "spec": spec}), 403, "forbidden")
    # The Unix socket (the daemon's owner) may always ask for it.
    with corral.Client(served.daemon.url) as client:
        with corral.Sandbox.create(network="host", memory_mb=64, client=client) as sb:
            assert sb.info.spec.network.value == "host"


def test_allow_host_network_lets_tcp_clients_ask(tmp_path):
    if not have_root_runtime():
        pytest.skip("needs root")
    s = _serve("--allow-host-network")
    try:
        with s.client() as c:
            reply = c.post("/v1/sandboxes", json={"memory_mb": 64, "network": "host"})
            assert reply.status_code == 201, reply.text
            assert c.delete(f"/v1/sandboxes/{reply.json()['id']}").status_code == 204
    finally:
        s.daemon.stop()
        shutil.rmtree(s.daemon.base, ignore_errors=True)
