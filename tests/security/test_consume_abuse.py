"""A hostile tenant against ``POST .../processes/{id}/consume`` (docs/api.md): the
sandbox is gone whatever the process or the client does, the reply stays bounded, and a
bad query or a race ends in a typed error, never a 500 or a kept sandbox."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import requires_root
from tests.server.conftest import TEST_TAG, assert_error, uds_client

pytestmark = [requires_root, pytest.mark.root]

SILENT = "import sys, time\nsys.stdin.readline(); time.sleep(600)\n"


@pytest.fixture
def client(daemon):
    logged = daemon.log.stat().st_size
    with uds_client(daemon.socket) as c:
        yield c
    with open(daemon.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: see {daemon.log}"


def sandbox(client) -> str:
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG]})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def spawn(client, sid: str, code: str, **body) -> str:
    reply = client.post(f"/v1/sandboxes/{sid}/processes",
                        json={"cmd": ["python3", "-c", code], **body})
    assert reply.status_code == 201, reply.text
    return f"/v1/sandboxes/{sid}/processes/{reply.json()['id']}/consume"


def gone(client, sid: str, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while client.get(f"/v1/sandboxes/{sid}").status_code != 404:
        assert time.monotonic() < deadline, f"consume left {sid} behind"
        time.sleep(0.1)


def test_bad_timeouts_are_refused_and_delete_nothing(client):
    sid = sandbox(client)
    try:
        path = spawn(client, sid, SILENT)
        for value in ("0", "-1", "nan", "inf", "-inf", "1e300", "", "1s", "2592001"):
            for name in ("timeout", "exit_timeout"):
                assert_error(client.post(path, params={name: value}), 400, "invalid_argument")
        assert client.get(f"/v1/sandboxes/{sid}").status_code == 200
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


def test_a_hung_up_client_without_a_timeout_leaves_no_sandbox(client, daemon):
    """No ``timeout``: the line may never come; the client that hangs up must not leave
    the sandbox (and the daemon's task) waiting for it for the sandbox's whole life."""
    sid = sandbox(client)
    path = spawn(client, sid, SILENT)
    with pytest.raises(httpx.ReadTimeout):
        client.post(path, content=b"x\n", timeout=0.5)
    gone(client, sid)


def test_a_hung_up_client_does_not_wait_for_a_far_exit(client):
    """The line came, the process never exits, ``exit_timeout`` is 30 days: the client
    that hangs up leaves nothing waiting."""
    sid = sandbox(client)
    path = spawn(client, sid, "import time\nprint('line', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(httpx.ReadTimeout):
        client.post(path, params={"exit_timeout": "2592000"}, timeout=1)
    gone(client, sid)


def test_a_flood_without_newline_comes_back_bounded(client):
    """A line that never ends: the reply holds at most the process's ``max_buffer``."""
    sid = sandbox(client)
    path = spawn(client, sid, "import sys\nwhile True:\n    sys.stdout.write('A' * 65536)\n",
                 max_buffer=4096)
    reply = client.post(path, params={"timeout": "30", "exit_timeout": "0.1"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["data"] == "A" * 4096 and body["deleted"] is True
    assert body["result"]["returncode"] != 0  # killed
    gone(client, sid)


def test_a_huge_body_to_a_process_that_never_reads(client, daemon):
    """A body far past any pipe's buffer, to a process that never reads its stdin."""
    sid = sandbox(client)
    path = spawn(client, sid, "import time\ntime.sleep(600)\n")
    reply = client.post(path, content=b"y" * (8 << 20), params={"timeout": "1"})
    assert reply.status_code == 200, reply.text
    assert "data" not in reply.json()
    gone(client, sid)


def test_a_child_that_keeps_the_pipe_open_cannot_keep_the_sandbox(client):
    """The process answers and exits, a child it forked holds stdout and lives on."""
    sid = sandbox(client)
    code = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
            "print('done', flush=True)\n")
    reply = client.post(spawn(client, sid, code), params={"timeout": "30",
                                                          "exit_timeout": "2"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["data"] == "done\n"
    gone(client, sid)


def test_concurrent_consumes_of_one_process(client, daemon):
    """Two consumes race for one process: each gets a reply or a typed error, the sandbox
    is deleted once, the daemon logs no error."""
    sid = sandbox(client)
    path = spawn(client, sid, "import sys, time\nsys.stdin.readline()\ntime.sleep(0.5)\n"
                 "print('one', flush=True)\n")
    replies: list[httpx.Response] = []

    def consume() -> None:
        with uds_client(daemon.socket) as c:
            replies.append(c.post(path, content=b"go\n", params={"timeout": "20"}))

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(replies) == 4
    for reply in replies:
        assert reply.status_code in (200, 404, 409, 410), reply.text
        if reply.status_code != 200:
            assert reply.json()["error"]["code"] in ("not_found", "sandbox_not_found", "invalid_state",
                                                     "sandbox_lost"), reply.text
    gone(client, sid)


def test_consume_of_a_gone_or_anothers_process_is_not_found(client):
    sid = sandbox(client)
    path = spawn(client, sid, SILENT)
    client.delete(f"/v1/sandboxes/{sid}")
    assert client.post(path, content=b"x\n").json()["error"]["code"] == "sandbox_not_found"
    other = sandbox(client)
    try:
        forged = path.replace(sid, other)  # a process id of another sandbox
        assert client.post(forged, content=b"x\n").status_code == 404
        assert client.get(f"/v1/sandboxes/{other}").status_code == 200
    finally:
        client.delete(f"/v1/sandboxes/{other}")


def _need_criu():
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")


def test_consume_against_hibernation(client, daemon):
    """A consume waiting on a process while its sandbox is hibernated, and one sent to a
    hibernated sandbox: typed answers, the sandbox deleted by the first, kept by the
    second (nothing was consumed), no traceback."""
    _need_criu()
    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG],
                                               "network": "none", "checkpointable": True})
    assert reply.status_code == 201, reply.text
    sid = reply.json()["id"]
    path = spawn(client, sid, SILENT)
    replies: list[httpx.Response] = []

    def consume() -> None:
        with uds_client(daemon.socket) as c:
            replies.append(c.post(path, content=b"x\n", params={"timeout": "30"}))

    waiting = threading.Thread(target=consume)
    waiting.start()
    time.sleep(0.5)
    hibernated = client.post(f"/v1/sandboxes/{sid}/hibernate")
    waiting.join(60)
    assert replies and replies[0].status_code < 500, replies[0].text
    assert hibernated.status_code < 500, hibernated.text
    gone(client, sid)

    reply = client.post("/v1/sandboxes", json={"memory_mb": 64, "tags": [TEST_TAG],
                                               "network": "none", "checkpointable": True})
    sid = reply.json()["id"]
    try:
        path = spawn(client, sid, SILENT)
        reply = client.post(f"/v1/sandboxes/{sid}/hibernate")
        assert reply.status_code == 200, reply.text
        reply = client.post(path, content=b"x\n", params={"timeout": "5"})
        assert 400 <= reply.status_code < 500, reply.text
    finally:
        client.delete(f"/v1/sandboxes/{sid}")
