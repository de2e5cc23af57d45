"""GET /metrics of a real daemon: the figures move as sandboxes are created, run
commands that fail, time out and are OOM-killed, and end by their lifetime."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral._version import __version__
from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime
from tests.server.conftest import TEST_TAG, free_port, uds_client
from tests.server.test_pools import until

TOKEN = "metrics-test-token"
MiB = 1 << 20


def scrape(client: httpx.Client, **kwargs) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``GET /metrics``, parsed by prometheus_client's own parser."""
    reply = client.get("/metrics", **kwargs)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    """How far a sample moved between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)


@contextlib.contextmanager
def tcp_daemon_with(token: str, *args: str) -> Iterator[Daemon]:
    """A daemon on its Unix socket and on TCP (``.port``) with ``token``."""
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    base = _base_dir()
    port = free_port()
    d = Daemon(base, ["--tcp", f"127.0.0.1:{port}", "--token", token, *args]).start()
    d.port = port  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def tcp_daemon():
    """Shared by this module's tests."""
    with tcp_daemon_with(TOKEN) as d:
        yield d


@pytest.fixture
def uds(tcp_daemon):
    with uds_client(tcp_daemon.socket) as c:
        yield c


def create(client: httpx.Client, **spec) -> str:
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG], **spec})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def exec_(client: httpx.Client, sid: str, cmd: list[str], **kw) -> dict:
    reply = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **kw})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_metrics_need_the_token_on_tcp_and_not_on_the_socket(tcp_daemon, uds):
    url = f"http://127.0.0.1:{tcp_daemon.port}"
    with httpx.Client(base_url=url, timeout=30) as tcp:
        assert tcp.get("/metrics").status_code == 401
        assert tcp.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert tcp.get("/metrics", headers={"X-API-Key": "wrong"}).status_code == 401
        samples = scrape(tcp, headers={"Authorization": f"Bearer {TOKEN}"})
    assert value(samples, "corral_build_info", version=__version__) == 1
    assert value(samples, "corral_gpus") == 0 and value(samples, "corral_gpus_held") == 0
    assert ("corral_admission_queue_depth", frozenset()) in scrape(uds)


def test_creates_commands_and_ends_move_the_figures(uds):
    before = scrape(uds)
    sid = create(uds)
    try:
        after = scrape(uds)
        assert moved(before, after, "corral_sandbox_creates_total", result="ok") == 1
        assert moved(before, after, "corral_sandbox_create_seconds_count") == 1
        assert moved(before, after, "corral_admission_wait_seconds_count") == 1
        assert moved(before, after, "corral_sandboxes", state="running") == 1
        assert moved(before, after, "corral_tenant_sandboxes", tenant="admin") == 1
        assert moved(before, after, "corral_committed_memory_bytes") == 64 * MiB

        ok = exec_(uds, sid, ["true"])
        assert ok["returncode"] == 0
        nonzero = exec_(uds, sid, ["sh", "-c", "exit 3"])
        assert nonzero["returncode"] == 3
        slow = exec_(uds, sid, ["sleep", "30"], timeout=0.3)
        assert slow["timed_out"]
        ran = scrape(uds)
        for outcome in ("ok", "nonzero", "timeout"):
            assert moved(after, ran, "corral_exec_results_total", outcome=outcome) == 1, outcome
        assert moved(after, ran, "corral_exec_results_total", outcome="oom") == 0
        assert moved(after, ran, "corral_exec_seconds_count") == 3
        # each command counts the run time its caller was told: the timed-out one its
        # ~0.3 s (measured from its start in the sandbox, so a little under 0.3 on a
        # busy host), not the 30 it asked for
        told = ok["duration"] + nonzero["duration"] + slow["duration"]
        assert moved(after, ran, "corral_exec_seconds_sum") == pytest.approx(told, abs=1e-3)
        assert slow["duration"] < 30
    finally:
        assert uds.delete(f"/v1/sandboxes/{sid}").status_code == 204
    gone = scrape(uds)
    assert moved(before, gone, "corral_sandbox_ends_total", reason="deleted") == 1
    assert moved(before, gone, "corral_committed_memory_bytes") == 0


def test_an_oom_kill_is_counted(uds):
    sid = create(uds, memory_mb=64)
    try:
        before = scrape(uds)
        bomb = "x = [bytearray(1 << 20) for _ in range(4096)]"
        result = exec_(uds, sid, ["python3", "-c", bomb], timeout=60)
        assert result["oom_killed"], result
        after = scrape(uds)
    finally:
        uds.delete(f"/v1/sandboxes/{sid}")
    assert moved(before, after, "corral_exec_results_total", outcome="oom") == 1


def test_a_lifetime_timeout_is_counted(uds):
    before = scrape(uds)
    sid = create(uds, timeout=1)
    try:
        until(lambda: uds.get(f"/v1/sandboxes/{sid}").json()["state"] == "stopped",
                 "the sandbox's lifetime ran out")
        after = scrape(uds)
    finally:
        uds.delete(f"/v1/sandboxes/{sid}")
    assert moved(before, after, "corral_sandbox_ends_total", reason="timeout") == 1
    assert moved(before, after, "corral_sandboxes", state="stopped") == 1


def test_refused_creates_are_counted_by_their_error(uds):
    before = scrape(uds)
    reply = uds.post("/v1/sandboxes", json={"image": "no-such-image", "tags": [TEST_TAG]})
    assert reply.status_code == 404, reply.text
    after = scrape(uds)
    assert moved(before, after, "corral_sandbox_creates_total", result="image_not_found") == 1
    assert moved(before, after, "corral_sandbox_create_seconds_count") == 0


def test_pools_report_ready_sandboxes_and_acquires(uds):
    name = "metrics-pool"
    body = {"name": name, "spec": {"memory_mb": 64, "tags": [TEST_TAG]}, "min_ready": 1}
    assert uds.post("/v1/pools", json=body).status_code == 201
    try:
        until(lambda: value(scrape(uds), "corral_pool_ready", pool=name) == 1,
                 "the pool's sandbox is ready")
        before = scrape(uds)
        got = uds.post(f"/v1/pools/{name}/acquire", json={"timeout": 30})
        assert got.status_code == 200, got.text
        uds.delete(f"/v1/sandboxes/{got.json()['id']}")
        after = scrape(uds)
        assert moved(before, after, "corral_pool_acquire_seconds_count") == 1
    finally:
        uds.delete(f"/v1/pools/{name}")
    assert not any(n == "corral_pool_ready" and dict(labels).get("pool") == name
                   for n, labels in scrape(uds))


def test_no_metrics_turns_the_endpoint_off(make_daemon):
    d = make_daemon("--no-metrics")
    with uds_client(d.socket) as c:
        assert c.get("/metrics").status_code == 404
        assert c.get("/v1/info").status_code == 200


def test_a_queued_create_shows_in_the_queue_and_its_wait(make_daemon):
    d = make_daemon("--max-sandboxes", "1")
    with uds_client(d.socket) as c, uds_client(d.socket) as waiting:
        first = create(c)
        before = scrape(c)
        second: list[str] = []
        queued = threading.Thread(target=lambda: second.append(create(waiting)))
        queued.start()
        try:
            until(lambda: value(scrape(c), "corral_admission_queue_depth") == 1,
                  "the second create waits in the queue")
            assert c.delete(f"/v1/sandboxes/{first}").status_code == 204
        finally:
            queued.join(60)
        after = scrape(c)
        assert second and value(after, "corral_admission_queue_depth") == 0
        assert moved(before, after, "corral_admission_wait_seconds_count") == 1
        assert moved(before, after, "corral_admission_wait_seconds_sum") > 0
        c.delete(f"/v1/sandboxes/{second[0]}")
