"""Revoking a token ends everything it holds, at once, on every front-end (issue 23).

Attack 1: a tenant's E2B sandbox kept answering its envd access token after
``corral token revoke`` (the token was derived from the daemon's token and the sandbox
id only, and acted as the admin). Attack 2: streams a token opened outlived it — a
native exec stream, a process's output, ``logs?follow=1`` (which even delivered a
command the admin ran later), a cwsandbox gRPC exec, and the dashboard's live stream
after logout. Each attack runs through the client it came from (E2B's SDK,
cwsandbox's, httpx for the native API and the dashboard). The daemon runs with
``--on-revoke keep`` so the sandboxes outlive the revoke and only the door can stop
the attacker; the default (``stop``) is tested last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from tests.security.tenants_helpers import Team, grpc_team, team_daemon

END_S = 60  # a stream that lives on past this after the revoke never ends (today: 600 s)
TICK = "while :; do echo tick; sleep 0.2; done"


@pytest.fixture(scope="module")
def team():
    with grpc_team("--on-revoke", "keep") as t:
        yield t


def revoke(team: Team, name: str) -> None:
    with team.admin() as admin:
        assert admin.delete(f"/v1/tokens/{name}").status_code == 204


class Follower(threading.Thread):
    """Reads one streaming reply until it ends (or fails), noting its first chunk."""

    def __init__(self, open_stream: Callable[[], AbstractContextManager[httpx.Response]]):
        super().__init__(daemon=True)
        self.open_stream = open_stream
        self.first, self.ended = threading.Event(), threading.Event()
        self.chunks: list[bytes] = []
        self.status = 0

    def run(self) -> None:
        try:
            with self.open_stream() as reply:
                self.status = reply.status_code
                for chunk in reply.iter_raw():
                    self.chunks.append(chunk)
                    self.first.set()
        except httpx.HTTPError:
            pass  # the connection was cut: the stream ended
        finally:
            self.first.set()
            self.ended.set()


def follow(open_stream: Callable[[], AbstractContextManager[httpx.Response]]) -> Follower:
    f = Follower(open_stream)
    f.start()
    assert f.first.wait(END_S) and f.status == 200, f.status
    return f


def test_revoking_ends_native_exec_process_output_and_log_streams(team):
    token = team.make_token("streamer")
    clients = [httpx.Client(base_url=team.url, timeout=None,
                            headers={"Authorization": f"Bearer {token}"}) for _ in range(3)]
    c = clients[0]
    sid = c.post("/v1/sandboxes", json={"memory_mb": 64, "timeout": 600}).json()["id"]
    pid = c.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": TICK}).json()["id"]
    streams = [
        follow(lambda: clients[0].stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                                         json={"cmd": TICK, "timeout": 600})),
        follow(lambda: clients[1].stream("GET", f"/v1/sandboxes/{sid}/processes/{pid}/output")),
        follow(lambda: clients[2].stream("GET", f"/v1/sandboxes/{sid}/logs",
                                         params={"follow": 1})),
    ]
    revoke(team, "streamer")
    for name, f in zip(("exec", "process output", "logs?follow=1"), streams, strict=True):
        assert f.ended.wait(END_S), f"the {name} stream outlived the revoke"
    before = b"".join(streams[2].chunks)
    with team.admin() as admin:  # kept (--on-revoke keep): the admin's now
        assert admin.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert admin.post(f"/v1/sandboxes/{sid}/exec",
                          json={"cmd": "echo admin-only-42"}).json()["returncode"] == 0
        admin.delete(f"/v1/sandboxes/{sid}")
    assert b"admin-only-42" not in b"".join(streams[2].chunks) == before
    for client in clients:
        client.close()


def _script(team: Team, env: dict[str, str], body: str) -> subprocess.Popen[str]:
    """A client package's script, talking to the test line by line on stdout/stdin."""
    path = Path(team.daemon.base) / f"script-{os.getpid()}-{threading.get_ident()}.py"
    path.write_text("import json, sys\n" + textwrap.dedent(body))
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    return subprocess.Popen([sys.executable, str(path)], env=full, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _line(proc: subprocess.Popen[str], wait: float = 300) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], wait)
    assert ready, f"the client script said nothing in {wait} s: its call outlived the revoke"
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(proc.stderr.read()[-4000:])
    return json.loads(line)


def _finish(proc: subprocess.Popen[str]) -> dict:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    try:
        return _line(proc, END_S)
    finally:
        proc.kill()
        proc.wait(30)


def test_a_revoked_tenants_e2b_access_token_dies_with_it(team):
    """The envd access token the create reply gave names the token that minted it and
    dies with it: after the revoke the SDK's commands and file writes are refused,
    though the sandbox itself still runs (--on-revoke keep)."""
    pytest.importorskip("e2b")
    token = team.make_token("e2b-tenant")
    env = {"E2B_API_URL": team.url, "E2B_SANDBOX_URL": team.url, "E2B_API_KEY": token}
    proc = _script(team, env, """
        from e2b import Sandbox
        def err(f):
            try:
                f()
            except Exception as e:
                return type(e).__name__
            return None
        sb = Sandbox.create(timeout=600)
        before = sb.commands.run("echo before").stdout
        print(json.dumps({"sid": sb.sandbox_id, "before": before}), flush=True)
        sys.stdin.readline()
        out = {"run": err(lambda: sb.commands.run("touch /tmp/after")),
               "write": err(lambda: sb.files.write("/tmp/written", "x")),
               "background": err(lambda: sb.commands.run("sleep 100", background=True))}
        print(json.dumps(out), flush=True)
    """)
    made = _line(proc)
    assert made["before"] == "before\n"
    revoke(team, "e2b-tenant")
    after = _finish(proc)
    assert after["run"] and after["write"] and after["background"], after
    with team.admin() as admin:
        sid = made["sid"]
        assert admin.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        for path in ("/tmp/after", "/tmp/written"):
            assert admin.get(f"/v1/sandboxes/{sid}/files", params={"path": path}
                             ).status_code == 404, path
        admin.delete(f"/v1/sandboxes/{sid}")


def test_an_e2b_access_token_is_scoped_to_its_tenant_and_sandbox(team):
    """One tenant's access token for its own sandbox does not open another's, and
    a token that names another minter is refused."""
    a, b = team.make_token("scoped-a"), team.make_token("scoped-b")
    reply = {}
    for name, key in (("a", a), ("b", b)):
        got = httpx.post(f"{team.url}/v2/sandboxes", headers={"X-API-KEY": key},
                         json={"templateID": "base", "timeout": 600}, timeout=60)
        assert got.status_code == 201, got.text
        reply[name] = got.json()
    token_a, sid_b = reply["a"]["envdAccessToken"], reply["b"]["sandboxID"]
    assert token_a.startswith("scoped-a.")
    forged = "scoped-b." + token_a.partition(".")[2]  # another minter's name on a's MAC
    for given in (token_a, forged):
        r = httpx.post(f"{team.url}/process.Process/Start", content=b"", headers={
            "E2b-Sandbox-Id": sid_b, "X-Access-Token": given,
            "Content-Type": "application/connect+json"}, timeout=30)
        assert r.status_code == 401, (given, r.text)
    team.cleanup()


def test_revoking_ends_a_cwsandbox_exec_stream(team):
    """A gRPC exec stream with stdin open is cancelled by the revoke: the client's
    exec fails with the revoke's refusal, and stdin written after is never delivered.

    The revoke comes once the command is known to run (it printed ``started`` through
    the stream): before, it came as soon as the script had queued its stdin, which
    under load could be before the call reached the daemon (then a new call is refused,
    not an open stream ended) or while the command still started (cwsandbox gives up
    on a call whose command is not ready in 5 s: its own error, not the revoke's). Such
    a give-up is retried, a few times."""
    pytest.importorskip("cwsandbox")
    token = team.make_token("grpc-tenant")
    env = {"CWSANDBOX_BASE_URL": f"http://{team.grpc}", "CWSANDBOX_API_KEY": token,
           "CWSANDBOX_DISABLE_SIGNAL_HANDLERS": "1"}
    proc = _script(team, env, """
        from cwsandbox import Sandbox
        sb = Sandbox.run(resources={"cpu": "500m", "memory": "64Mi"})
        sb.wait()
        for attempt in range(5):  # cwsandbox waits 5 s for a command to start, no more
            fed = f"/tmp/fed{attempt}"  # (one given up on may still start, and truncate)
            p = sb.exec(["sh", "-c", f"echo started; cat > {fed}"], stdin=True,
                        timeout_seconds=600)
            if "started" in next(iter(p.stdout), ""):
                break
        else:
            raise SystemExit("the command never started within cwsandbox's wait")
        p.stdin.write(b"before\\n").result()
        print(json.dumps({"sid": sb.sandbox_id, "fed": fed}), flush=True)
        sys.stdin.readline()
        out = {}
        try:
            r = p.result()
            out["result"] = r.returncode
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        try:
            p.stdin.write(b"after\\n").result()
            out["wrote"] = True
        except Exception as e:
            out["wrote"] = type(e).__name__
        print(json.dumps(out), flush=True)
    """)
    made = _line(proc)
    with team.admin() as admin:  # the stream is open: its stdin reached the command
        _poll(lambda: b"before" in admin.get(f"/v1/sandboxes/{made['sid']}/files",
                                             params={"path": made["fed"]}).content,
              "the command never got the stdin written before the revoke")
    revoke(team, "grpc-tenant")
    out = _finish(proc)
    assert "revoked" in out.get("error", ""), out  # the revoke's refusal, not another
    with team.admin() as admin:
        fed = admin.get(f"/v1/sandboxes/{made['sid']}/files", params={"path": made["fed"]})
        assert fed.content == b"before\n"  # and nothing after
    team.cleanup()


def _poll(check: Callable[[], bool], what: str, limit: float = 120.0) -> None:
    """Poll ``check`` until it holds (bounded only against a hang)."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_revoking_ends_a_tensorlake_output_follow(team):
    """Tensorlake's client follows a process's output until it exits; the revoke ends
    the stream under it (the process itself is the kept sandbox's, the admin's)."""
    pytest.importorskip("tensorlake.sandbox")
    token = team.make_token("tl-tenant")
    env = {"TENSORLAKE_API_URL": team.url, "TENSORLAKE_API_KEY": token}
    proc = _script(team, env, f"""
        from tensorlake.sandbox import Sandbox
        sb = Sandbox.create(memory_mb=64, timeout_secs=600)
        p = sb.start_process("sh", ["-c", {TICK!r}])
        print(json.dumps({{"sid": sb.sandbox_id}}), flush=True)
        sys.stdin.readline()
        try:
            out = {{"events": len(list(sb.follow_stdout(p.pid)))}}
        except Exception as e:
            out = {{"error": type(e).__name__}}
        print(json.dumps(out), flush=True)
    """)
    _line(proc)
    proc.stdin.write("follow\n")
    proc.stdin.flush()
    time.sleep(1)  # let the follow open (a later one is refused 401: ends as well)
    revoke(team, "tl-tenant")
    out = _line(proc, END_S)
    proc.kill()
    proc.wait(30)
    assert out, out
    team.cleanup()


def _login(client: httpx.Client, token: str) -> str:
    assert client.post("/ui/login", data={"token": token}).status_code == 303
    page = client.get("/ui", headers={"Accept": "text/html"})
    match = re.search(r'name="csrf-token" content="([^"]+)"', page.text)
    assert match is not None, page.text[:500]
    return match.group(1)


def test_logout_and_revoke_end_the_dashboards_live_stream(team):
    token = team.make_token("dash-tenant")
    with httpx.Client(base_url=team.url, timeout=httpx.Timeout(None)) as out, \
            httpx.Client(base_url=team.url, timeout=httpx.Timeout(None)) as kept:
        csrf = _login(out, token)
        _login(kept, token)
        by_logout = follow(lambda: out.stream("GET", "/ui/events"))
        by_revoke = follow(lambda: kept.stream("GET", "/ui/events"))
        assert out.post("/ui/logout", headers={"X-CSRF-Token": csrf}).status_code == 303
        assert by_logout.ended.wait(END_S), "the live stream outlived the logout"
        assert not by_revoke.ended.is_set()  # the other session's goes on
        revoke(team, "dash-tenant")
        assert by_revoke.ended.wait(END_S), "the live stream outlived the revoke"


def test_by_default_a_revoked_tenants_sandboxes_stop():
    """``--on-revoke stop`` (the default): what the revoked token started ends; its
    records stay for the admin."""
    with team_daemon() as t:
        with t.tenant("alice") as a:
            sid = a.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        revoke(t, "alice")
        with t.admin() as admin:
            info = admin.get(f"/v1/sandboxes/{sid}").json()
            assert info["state"] == "stopped" and info["spec"]["tenant"] == "alice"
            assert admin.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_keep_leaves_a_reserve_to_its_lease(team):
    """``--on-revoke keep`` ends no lease at the revoke (with ``stop`` they end at once:
    test_pool_reserve): a rotated token's reserved sandboxes run on until their lease,
    no longer renewed by the revoked token, expires (as a ``Session(lease=)``'s do)."""
    team.make_token("kept_reserve")
    with team.tenant("kept_reserve") as c:
        made = c.post("/v1/pools", json={"name": "kr", "spec": {"memory_mb": 64},
                                         "min_ready": 1, "max_size": 2})
        assert made.status_code == 201, made.text
        deadline = time.monotonic() + 120
        while c.get("/v1/pools/kr").json()["ready"] < 1:
            assert time.monotonic() < deadline, "the pool never filled"
            time.sleep(0.1)
        lease = c.post("/v1/leases", json={"ttl": 600}).json()["id"]
        held = c.post("/v1/pools/kr/reserve", json={"count": 1, "lease": lease}).json()
        (sid,) = [s["id"] for s in held["sandboxes"]]
    revoke(team, "kept_reserve")
    with team.admin() as admin:
        assert admin.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert admin.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_revoking_ends_e2b_command_and_pty_streams(team, monkeypatch):
    """envd's streams opened with a tenant's access token, through E2B's own client: a
    background command's output and a PTY, both followed across the revoke, end at it
    (the processes are the kept sandbox's, the admin's, and run on)."""
    pytest.importorskip("e2b")
    from e2b import PtySize, Sandbox

    for name in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.setenv(name, team.url)
    token = team.make_token("e2b-streams")
    sb = Sandbox.create(api_key=token, timeout=600)
    handles = [sb.commands.run(TICK, background=True, timeout=0),
               sb.pty.create(PtySize(24, 80), timeout=0)]
    sb.pty.send_stdin(handles[1].pid, f"{TICK}\n".encode())
    followers = []
    for handle in handles:
        seen, ended = threading.Event(), threading.Event()

        def read(handle=handle, seen=seen, ended=ended) -> None:
            try:
                for out in handle:
                    if b"tick" in str(out).encode():
                        seen.set()
            except Exception:  # the stream was cut: it ended
                pass
            finally:
                seen.set()
                ended.set()

        threading.Thread(target=read, daemon=True).start()
        followers.append((seen, ended))
    for seen, ended in followers:
        assert seen.wait(END_S) and not ended.is_set(), "a stream never ticked"
    revoke(team, "e2b-streams")
    for what, (_, ended) in zip(("command output", "pty"), followers, strict=True):
        assert ended.wait(END_S), f"the e2b {what} stream outlived the revoke"
    with team.admin() as admin:
        assert admin.get(f"/v1/sandboxes/{sb.sandbox_id}").json()["state"] == "running"
        admin.delete(f"/v1/sandboxes/{sb.sandbox_id}")


def test_revoking_kills_the_command_of_an_exec_stream(team):
    """A revoked token's exec stream ends, and its command with it (as when its client
    hangs up): a streamed command does not run on in the kept sandbox."""
    token = team.make_token("exec-killed")
    with httpx.Client(base_url=team.url, timeout=None,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        sid = c.post("/v1/sandboxes", json={"memory_mb": 64, "timeout": 600}).json()["id"]
        stream = follow(lambda: c.stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                                         json={"cmd": f"echo up; {TICK}", "timeout": 600}))
        with team.admin() as admin:
            assert _running(admin, sid, "tick")  # (the check sees it)
            revoke(team, "exec-killed")
            assert stream.ended.wait(END_S), "the exec stream outlived the revoke"
            _poll(lambda: not _running(admin, sid, "tick"),
                  "the streamed command ran on after the revoke", END_S)
            admin.delete(f"/v1/sandboxes/{sid}")


def test_revoking_kills_the_command_of_a_plain_exec_and_frees_its_room(team):
    """A command the exec route started in its handler (its end awaited in a task of
    its own) dies with the revoked token's request, as a streamed one does: it does not
    run on in the kept sandbox, and the reply's output hold comes back."""
    token = team.make_token("plain-exec-killed")
    got: list[object] = []

    def run() -> None:
        with httpx.Client(base_url=team.url, timeout=None,
                          headers={"Authorization": f"Bearer {token}"}) as c:
            try:
                got.append(c.post(f"/v1/sandboxes/{sid}/exec",
                                  json={"cmd": TICK, "timeout": 600}).status_code)
            except httpx.HTTPError as exc:
                got.append(exc)  # the connection was cut: the request ended

    with httpx.Client(base_url=team.url, timeout=60,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        sid = c.post("/v1/sandboxes", json={"memory_mb": 64, "timeout": 600}).json()["id"]
    t = threading.Thread(target=run, daemon=True)
    t.start()
    with team.admin() as admin:
        _poll(lambda: _running(admin, sid, "tick"), "the command never started", END_S)
        revoke(team, "plain-exec-killed")
        t.join(END_S)
        assert not t.is_alive(), "the exec outlived the revoke"
        _poll(lambda: not _running(admin, sid, "tick"),
              "the exec's command ran on after the revoke", END_S)
        _poll(lambda: next(float(ln.split()[1]) for ln in admin.get("/metrics").text.splitlines()
                           if ln.startswith("corral_output_held_bytes ")) == 0,
              "the exec's output hold was never given back", END_S)
        admin.delete(f"/v1/sandboxes/{sid}")


def _running(admin: httpx.Client, sid: str, word: str) -> bool:
    """Whether a process of the sandbox has ``word`` in its command line."""
    cmd = ("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <$f; echo; done"
           f" | grep -c '[d]o echo {word}'")  # ([d]: not the grep's own)
    got = admin.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd}).json()["stdout"]
    return int(got) > 0


def test_revoking_ends_an_image_build_in_flight(team):
    """A build streams its progress to the token that started it; a client that hangs
    up stops it (test_quota_races). The revoke ended the stream but not the build: it
    ran on in its sandbox for the revoked token, and its places in the build gate (the
    host's build slots, the tenant's memory) were never given back."""
    team.make_token("builder", allow_images=True)
    nonce = os.urandom(4).hex()
    body = {"spec": {"base": "python", "memory_mb": 64,
                     "steps": [{"run": f"sleep 600; : {nonce}"}]}, "name": f"rb-{nonce}"}
    with team.tenant("builder") as b, b.stream("POST", "/v1/images/build", json=body,
                                               timeout=120) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        for line in lines:  # until the step runs
            if line.strip() and json.loads(line).get("type") == "step":
                break
        else:
            raise AssertionError("the build's step never started")
        with team.admin() as admin:
            assert admin.get("/v1/info").json().get("builds") == 1
        revoke(team, "builder")
        with contextlib.suppress(httpx.HTTPError):
            for _ in lines:  # the stream ends at the revoke
                pass
    with team.admin() as admin:
        def ended() -> bool:
            live = admin.get("/v1/sandboxes", params={"tenant": "builder"}).json()
            return (admin.get("/v1/info").json().get("builds", 0) == 0
                    and not any(s["state"] == "running" for s in live["sandboxes"]))
        _poll(ended, "the build ran on after the revoke", END_S)
