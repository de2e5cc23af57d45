"""Red team of concurrent teardown (issue 30: a sandbox's unmounts and cgroup removal run
on the engine's release pool, runtime/engine_end.py). While a tenant's sandboxes are
being deleted all at once, the same tenant keeps using them: exec, spawn, info, file
reads. Every answer is the sandbox's or a typed error (404 not found, 409 a state
conflict, 410 its agent gone), never a 500 or a traceback; once the deletes returned,
nothing of them can be reached, and the tenant's quota (``max_sandboxes``) counts none
of them: the same number can be created again at once. Real daemon on TCP, a tenant, threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.security.tenants_helpers import no_traceback, team_daemon

N = 6  # the tenant's max_sandboxes
TYPED = {200, 201, 204, 404, 409, 410}  # 410: sandbox_lost (its agent went first)


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        t.make_token("dave", max_sandboxes=N)
        yield t


def _create_all(client) -> list[str]:
    ids = []
    for _ in range(N):
        made = client.post("/v1/sandboxes", json={"memory_mb": 64})
        assert made.status_code == 201, made.text
        ids.append(made.json()["id"])
    return ids


def _use(client, sid: str) -> list[tuple[str, int, str]]:
    """Everything a tenant may do to one of its sandboxes, a few times over."""
    got = []
    for _ in range(3):
        for what, reply in (
            ("exec", client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})),
            ("spawn", client.post(f"/v1/sandboxes/{sid}/processes",
                                  json={"cmd": ["sleep", "30"]})),
            ("info", client.get(f"/v1/sandboxes/{sid}")),
            ("file", client.get(f"/v1/sandboxes/{sid}/files", params={"path": "/etc/hostname"})),
            ("processes", client.get(f"/v1/sandboxes/{sid}/processes")),
        ):
            got.append((what, reply.status_code, reply.text[:300]))
    return got


def test_sandboxes_used_while_their_teardown_runs_answer_typed_errors(team):
    with team.tenant("dave") as dave:
        ids = _create_all(dave)
        with ThreadPoolExecutor(2 * N) as pool:
            users = [pool.submit(_use, dave, sid) for sid in ids]
            deletes = [pool.submit(dave.delete, f"/v1/sandboxes/{sid}") for sid in ids]
            assert [d.result().status_code for d in deletes] == [204] * N
            answers = [a for u in users for a in u.result()]
        untyped = [a for a in answers if a[1] not in TYPED
                   or a[1] >= 400 and '"error":{"code":' not in a[2]]
        assert not untyped, untyped
        for sid in ids:  # gone, as if it never existed
            assert dave.get(f"/v1/sandboxes/{sid}").status_code == 404
            ran = dave.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
            assert ran.status_code == 404, ran.text
        again = _create_all(dave)  # the quota counts none of the deleted ones
        assert not set(again) & set(ids)
        for sid in again:
            assert dave.delete(f"/v1/sandboxes/{sid}").status_code == 204
    no_traceback(team)


def test_a_port_socket_into_a_deleted_sandbox_is_closed(team):
    """The daemon's connection into a sandbox (a port socket) does not outlive it: its
    teardown ends the relay (the client sees the close), so nothing holds the deleted
    sandbox's network namespace or the tenant's stream."""
    import corral
    from tests.security.test_uvloop_door import _status, _upgrade, start_echo

    with corral.Client(team.url, token=team.tokens["dave"]) as client:
        sb = corral.Sandbox.create(memory_mb=64, client=client)
        start_echo(sb)
        with _upgrade(team, team.tokens["dave"], sb.id) as ws:
            assert _status(ws) == 101
            ws.sendall(bytes([0x82, 0x80 | 3]) + b"\0\0\0\0" + b"hi\n")
            assert ws.recv(16)[2:] == b"hi\n"
            sb.delete()
            ws.settimeout(60)
            rest = ws.recv(4096)  # the close frame (or EOF), not waiting for the TCP end
            assert rest == b"" or rest[0] == 0x88, rest[:40]  # EOF, or a close frame
