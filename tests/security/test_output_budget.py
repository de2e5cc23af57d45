"""Commands' output cannot exhaust the daemon's memory (runtime/output_budget.py).

The attack: ``max_output`` may be up to 1 GiB per stream, and a command run to
completion keeps its output in the daemon until the reply is sent. A tenant running
many commands at once, each printing as much as it may keep, made the daemon hold the
sum. Now the bytes a command's output really holds count against its tenant's budget
and the daemon's: a command takes a floor of 64 KiB per stream, then grows by what it
prints; when the budget has no more, its cap is lowered there, mid-stream
(``output_limited_to``, its head and tail kept, ``stdout_truncated``; a streamed reader
sees the gap), and only when not even the floor is left is it refused with 429
``output_budget_exceeded``. Never a 500, never the daemon's memory; and many commands
printing little run at once, whatever cap each asked.

Measured on the daemon's own peak resident memory (``VmHWM``, reset before the attack
through ``/proc/PID/clear_refs``), relative to what the commands asked it to hold.
Real daemon, real sandboxes, tenants over TCP.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

import corral
from tests.conftest import requires_root
from tests.security.tenants_helpers import no_traceback, team_daemon

pytestmark = [requires_root, pytest.mark.root]

MiB = 1 << 20
TOTAL_MB, TENANT_MB = 24, 16  # the daemon's budget and a tenant's (small: a quick test)
N = 24  # commands at once
ASK = 16 * MiB  # max_output each asks (per stream)
PRINT = 24 << 20  # bytes each prints to stdout, then a verdict on stderr
PRINTER = ("import sys\nb = b'x' * 65536\nfor _ in range(%d): sys.stdout.buffer.write(b)\n"
           "sys.stdout.flush()\nsys.stderr.write('VERDICT ok\\n')" % (PRINT // 65536))
PATIENCE_S = 120  # a bound on the polls below, never a measure


@pytest.fixture(scope="module")
def team():
    with team_daemon("--output-memory-mb", str(TOTAL_MB),
                     "--tenant-output-memory-mb", str(TENANT_MB)) as t:
        t.make_token("mallory")  # no sandbox quota: N at once
        yield t
        no_traceback(t)


def _sandbox(client: httpx.Client) -> str:
    reply = client.post("/v1/sandboxes", json={"memory_mb": 128})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def _nothing_held(team) -> None:
    """Every byte of the budget came back (the daemon's gauge), once replies are sent."""
    deadline = time.monotonic() + PATIENCE_S
    with team.admin() as admin:
        while True:
            text = admin.get("/metrics").text
            line = next(ln for ln in text.splitlines()
                        if ln.startswith("corral_output_held_bytes "))
            if float(line.split()[1]) == 0:
                return
            assert time.monotonic() < deadline, line
            time.sleep(0.05)


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


async def _flood(url: str, token: str, sids: list[str]) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=PATIENCE_S,
                                 limits=httpx.Limits(max_connections=N)) as client:
        body = {"cmd": ["python3", "-c", PRINTER], "max_output": ASK, "timeout": 60}
        return list(await asyncio.gather(
            *(client.post(f"/v1/sandboxes/{sid}/exec", json=body) for sid in sids)))


def _check_reply(reply: httpx.Response) -> bool:
    """A reply is a lowered cap with head and tail, or a typed refusal; True if it ran."""
    if reply.status_code == 429:
        assert reply.json()["error"]["code"] == "output_budget_exceeded", reply.text
        assert "max_output" in reply.json()["error"]["message"]
        return False
    assert reply.status_code == 200, reply.text
    result = reply.json()
    granted = result["output_limited_to"]
    assert 64 << 10 <= granted < TENANT_MB * MiB, result["output_limited_to"]
    assert result["stdout_truncated"] and len(result["stdout"]) == granted
    assert result["stderr"] == "VERDICT ok\n" and result["returncode"] == 0
    return True


def test_many_commands_printing_a_lot_leave_the_daemons_memory_bounded(team):
    pid = team.daemon.proc.pid
    with team.tenant("mallory") as mallory:
        sids = [_sandbox(mallory) for _ in range(N)]
        try:
            mallory.post(f"/v1/sandboxes/{sids[0]}/exec", json={"cmd": ["true"]})  # warm-up
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            base = _status(pid, "VmHWM")
            replies = asyncio.run(_flood(team.url, team.tokens["mallory"], sids))
            grown = _status(pid, "VmHWM") - base
        finally:
            for sid in sids:
                mallory.delete(f"/v1/sandboxes/{sid}")
    ran = [_check_reply(r) for r in replies]
    assert any(ran), [r.status_code for r in replies]
    _nothing_held(team)
    # Without the budget the daemon held most of N × ASK (384 MiB) at its peak; with
    # it, the tenant's 16 MiB plus a reply's copies while it is encoded.
    asked = N * ASK
    assert grown < 0.3 * asked, (grown // MiB, [r.status_code for r in replies])


PROCESS_PRINTER = "import sys\nsys.stdout.buffer.write(b'p' * (8 << 20))\nsys.stdout.flush()"


def _hold_share_with_processes(client: httpx.Client, sid: str) -> list[str]:
    """Four processes printing 8 MiB each, unread: they hold the tenant's whole share."""
    base = f"/v1/sandboxes/{sid}/processes"
    ids = [client.post(base, json={"cmd": ["python3", "-c", PROCESS_PRINTER]}).json()["id"]
           for _ in range(4)]
    deadline = time.monotonic() + PATIENCE_S
    while any(client.get(f"{base}/{i}").json()["state"] == "running" for i in ids):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return ids


def test_a_tenants_share_leaves_room_for_others_and_comes_back(team):
    with team.tenant("alice") as alice, team.tenant("bob") as bob:
        a_sid, b_sid = _sandbox(alice), _sandbox(bob)
        try:
            ids = _hold_share_with_processes(alice, a_sid)
            # not even a floor is left for her: refused, typed, saying whose
            more = alice.post(f"/v1/sandboxes/{a_sid}/exec", json={"cmd": ["true"]})
            assert more.status_code == 429, more.text
            details = more.json()["error"]["details"]
            assert details["tenant_used"] == details["tenant_limit"] == TENANT_MB * MiB
            # bob's own command still runs whole...
            small = bob.post(f"/v1/sandboxes/{b_sid}/exec", json={"cmd": ["echo", "hi"]})
            assert small.status_code == 200 and small.json()["stdout"] == "hi\n"
            assert small.json()["output_limited_to"] == 0
            # ...and a big one is lowered, mid-stream, to what the daemon has left
            # (24 - 16 MiB, stderr's floor aside): its head and its tail kept
            big = bob.post(f"/v1/sandboxes/{b_sid}/exec", json={
                "cmd": ["python3", "-c", "print('y' * (12 << 20))"], "max_output": 16 * MiB,
                "output_tail": 1024})
            assert big.status_code == 200, big.text
            result = big.json()
            granted = result["output_limited_to"]
            assert 64 << 10 <= granted <= (TOTAL_MB - TENANT_MB) * MiB, granted
            assert result["stdout_truncated"] and len(result["stdout"]) == granted
            assert result["output_tail"] == 1024 and result["stdout"].endswith("y\n")
            # her processes forgotten: her share comes back
            for i in ids:
                assert alice.delete(f"/v1/sandboxes/{a_sid}/processes/{i}").status_code == 204
            again = alice.post(f"/v1/sandboxes/{a_sid}/exec", json={"cmd": ["true"]})
            assert again.status_code == 200 and again.json()["output_limited_to"] == 0
        finally:
            alice.delete(f"/v1/sandboxes/{a_sid}")
            bob.delete(f"/v1/sandboxes/{b_sid}")
    _nothing_held(team)


def _gauge(team) -> float:
    with team.admin() as admin:
        line = next(ln for ln in admin.get("/metrics").text.splitlines()
                    if ln.startswith("corral_output_held_bytes "))
    return float(line.split()[1])


async def _many_small(url: str, token: str, sids: list[str], per_sandbox: int) -> list:
    """Streamed and run-to-completion commands at once, each asking 64 MiB per stream
    (Tensorlake's cap) and printing one line."""
    headers = {"Authorization": f"Bearer {token}"}
    body = {"cmd": ["echo", "ok"], "max_output": 64 * MiB}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=PATIENCE_S,
                                 limits=httpx.Limits(max_connections=100)) as client:
        async def streamed(sid: str) -> tuple[int, str]:
            async with client.stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                                     json=body) as reply:
                return reply.status_code, (await reply.aread()).decode()

        async def whole(sid: str) -> tuple[int, str]:
            reply = await client.post(f"/v1/sandboxes/{sid}/exec", json=body)
            return reply.status_code, reply.text

        return list(await asyncio.gather(*(
            (streamed if i % 2 else whole)(sid) for sid in sids for i in range(per_sandbox))))


def test_many_small_commands_run_at_once_beside_a_bounded_flood(team):
    """Mallory streams a flood nobody reads (64 MiB asked and printed): the daemon
    holds her share of it, no more, and her next command is refused; meanwhile bob runs
    40 commands at once, each asking 64 MiB per stream (2 × 64 MiB each was reserved
    before they started: all but the first refused at a 16 MiB share), and every one
    runs whole."""
    import json
    import socket

    flood = "import sys\nb = b'f' * 65536\nfor _ in range(1024): sys.stdout.buffer.write(b)"
    with team.tenant("mallory") as mallory, team.tenant("bob") as bob:
        m_sid = _sandbox(mallory)
        b_sids = [_sandbox(bob) for _ in range(4)]
        sock = None
        try:
            body = json.dumps({"cmd": ["python3", "-c", flood], "max_output": 64 * MiB}).encode()
            sock = socket.create_connection(("127.0.0.1", team.port), timeout=PATIENCE_S)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.sendall((f"POST /v1/sandboxes/{m_sid}/exec/stream HTTP/1.1\r\nHost: x\r\n"
                          f"Authorization: Bearer {team.tokens['mallory']}\r\n"
                          "Content-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
            deadline = time.monotonic() + PATIENCE_S
            while (held := _gauge(team)) < TENANT_MB * MiB:  # her share, filled by the flood
                assert time.monotonic() < deadline, held
                time.sleep(0.05)
            assert held == TENANT_MB * MiB  # and no more
            refused = mallory.post(f"/v1/sandboxes/{m_sid}/exec", json={"cmd": ["true"]})
            assert refused.status_code == 429, refused.text
            replies = asyncio.run(_many_small(team.url, team.tokens["bob"], b_sids, 10))
            assert all(code == 200 for code, _ in replies), replies
            for _, text in replies:
                assert '"output_limited_to":0' in text.replace(" ", ""), text
                assert "ok\\n" in text, text
            assert _gauge(team) == TENANT_MB * MiB  # bob's given back, hers still held
        finally:
            if sock is not None:
                sock.close()  # the stream's reader has gone: the command is killed
            mallory.delete(f"/v1/sandboxes/{m_sid}")
            for sid in b_sids:
                bob.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


def test_run_once_is_budgeted_too_and_the_sdk_says_so(team):
    """Through the real SDK: ``CommandResult.output_limited_to`` says the cap it got."""
    with corral.Client(team.url, token=team.tokens["bob"]) as client:
        r = corral.Sandbox.run_once(["python3", "-c", "print('z' * (20 << 20))"],
                                    max_output=1 << 30, memory_mb=128, client=client)
        assert 64 << 10 <= r.output_limited_to < TENANT_MB * MiB
        assert len(r.stdout) == r.output_limited_to
        assert r.stdout_truncated and r.stdout.endswith("z\n") and r.ok
    _nothing_held(team)


def test_processes_unread_output_counts_against_the_same_budget(team):
    """Processes' unread output (max_buffer, 16 MiB per stream by default) is held by
    the daemon too: four printing 8 MiB each, unread, hold at most the tenant's 16 MiB
    (32 MiB before), the rest is dropped and flagged; forgetting them gives it back."""
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        base = f"/v1/sandboxes/{sid}/processes"
        try:
            ids = _hold_share_with_processes(mallory, sid)
            infos = [mallory.get(f"{base}/{i}").json() for i in ids]
            held = sum(p["unread_bytes"] for p in infos)
            # all her share, no more (each chunk of 64 KiB at most counts CHUNK_COST too)
            assert TENANT_MB * MiB * (1 - 1 / 256) <= held <= TENANT_MB * MiB, held
            assert any(p["result"]["stdout_truncated"] for p in infos)
            # while they hold it, her commands are refused (typed); then they come back
            refused = mallory.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
            assert refused.status_code == 429, refused.text
            for i in ids:
                assert mallory.delete(f"{base}/{i}").status_code == 204
            ok = mallory.post(f"/v1/sandboxes/{sid}/exec",
                              json={"cmd": ["true"], "max_output": 4 * MiB})
            assert ok.status_code == 200 and ok.json()["output_limited_to"] == 0, ok.text
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)


def test_replies_not_read_keep_holding_their_room(team):
    """A client that sends exec after exec and reads none of the replies: each reply's
    output stays in the daemon until written, so it keeps its room in the budget (the
    whole body went into uvicorn's buffer in one send, the room given back at once: the
    gauge said 0 while the daemon held them, and every request ran at full cap). Closing
    the connections gives the room back."""
    import json
    import socket

    printer = "import sys\nsys.stdout.buffer.write(b'x' * (8 << 20))"
    with team.tenant("mallory") as mallory:
        sid = _sandbox(mallory)
        try:
            body = json.dumps({"cmd": ["python3", "-c", printer], "max_output": 8 * MiB}).encode()
            head = (f"POST /v1/sandboxes/{sid}/exec HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {team.tokens['mallory']}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            held, status = [], []
            for _ in range(3):
                s = socket.create_connection(("127.0.0.1", team.port), timeout=PATIENCE_S)
                s.sendall(head + body)
                got = b""
                while len(got) < 12 and (more := s.recv(12 - len(got))):
                    got += more
                status.append(got.decode())
                held.append(s)
            with team.admin() as admin:
                gauge = next(ln for ln in admin.get("/metrics").text.splitlines()
                             if ln.startswith("corral_output_held_bytes "))
            for s in held:
                s.close()
            # the first runs whole; the others get what is left: a lowered cap, or no
            # floor at all (429) while the replies before hold her share
            assert status[0] == "HTTP/1.1 200", status
            assert set(status) <= {"HTTP/1.1 200", "HTTP/1.1 429"}, status
            # The kernel takes a few MiB of each reply (the client's receive buffer,
            # the daemon's send buffer); the rest is still the daemon's, and counted.
            assert float(gauge.split()[1]) >= 2 * MiB, gauge
        finally:
            mallory.delete(f"/v1/sandboxes/{sid}")
    _nothing_held(team)
