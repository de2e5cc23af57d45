"""Operations on every path: spawned processes in the sandbox's log and the exec
metrics, --max-lifetime on every create, a fork's own lifecycle event, and the
cwsandbox front-end's access log — on a real daemon (TCP, tenants, gRPC, JSON logs)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

import corral
from tests.security.tenants_helpers import ADMIN_TOKEN, grpc_team

MAX_LIFETIME = 600


@pytest.fixture(scope="module")
def team():
    with grpc_team("--log-format", "json", "--max-lifetime", str(MAX_LIFETIME)) as t:
        yield t


@pytest.fixture
def alice(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as c:
        yield c
    team.cleanup()


def _logs_until(sb: corral.Sandbox, done, limit: float = 30) -> list:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:  # the log is written every fraction of a second
        entries = sb.logs()
        if done(entries):
            return entries
        time.sleep(0.2)
    raise AssertionError(f"the log of {sb.id} never got there: {sb.logs()}")


def _outcomes(team) -> dict[str, float]:
    with team.admin() as admin:
        text = admin.get("/metrics").text
    return {m[1]: float(m[2]) for m in
            re.finditer(r'^corral_exec_results_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_spawned_processes_are_logged_and_counted(team, alice):
    sb = corral.Sandbox.create(memory_mb=64, client=alice)
    before = _outcomes(team)
    proc = sb.spawn(["sh", "-c", "echo out; echo err >&2; exit 4"])
    assert proc.wait().returncode == 4
    assert sb.spawn(["sleep", "30"], timeout=0.5).wait().timed_out
    lingering = sb.spawn(["sleep", "600"])  # still running when its sandbox stops
    commands = _logs_until(sb, lambda es: sum(e["kind"] == "command" for e in es) >= 2)
    first, second = [e for e in commands if e["kind"] == "command"]
    assert first["argv"] == ["sh", "-c", "echo out; echo err >&2; exit 4"]
    assert (first["outcome"], first["exit_code"]) == ("exit", 4)
    assert (first["stdout_tail"], first["stderr_tail"]) == ("out\n", "err\n")
    assert (second["argv"], second["outcome"]) == (["sleep", "30"], "timeout")
    after = _outcomes(team)
    assert after.get("nonzero", 0) - before.get("nonzero", 0) == 1, (before, after)
    assert after.get("timeout", 0) - before.get("timeout", 0) == 1, (before, after)
    sb.stop()
    entries = _logs_until(sb, lambda es: sum(e["kind"] == "command" for e in es) >= 3)
    last = [e for e in entries if e["kind"] == "command"][-1]
    # ended by its sandbox's stop: the signal that killed it, or "killed" if the agent
    # went first
    assert last["argv"] == ["sleep", "600"], last
    assert (last["outcome"] == "exit" and last["exit_code"] < 0) or (
        (last["outcome"], last["exit_code"]) == ("killed", None)), last
    assert lingering.id


def test_a_fork_logs_forked_from_its_source(team, alice):
    sb = corral.Sandbox.create(memory_mb=64, client=alice)
    (copy,) = sb.fork(1)
    entries = _logs_until(copy, lambda es: any(e.get("event") == "ready" for e in es))
    events = [e for e in entries if e["kind"] == "event"]
    assert [e["event"] for e in events[:2]] == ["forked", "ready"], events
    assert events[0]["source"] == sb.id and "snapshot" not in events[0]
    # A sandbox created from a named snapshot still says "restored".
    snap = sb.snapshot(name="gaps-snap")
    restored = corral.Sandbox.create(snapshot=snap.id, client=alice)
    entries = _logs_until(restored, lambda es: any(e.get("event") == "ready" for e in es))
    assert entries[0]["event"] == "restored" and entries[0]["snapshot"] == snap.id


def _refused(reply: httpx.Response) -> None:
    assert reply.status_code == 400, reply.text
    assert "--max-lifetime" in reply.text, reply.text


def test_max_lifetime_bounds_every_create(team, alice):
    over = MAX_LIFETIME + 1
    # native HTTP and the SDK
    with team.tenant("alice") as a:
        _refused(a.post("/v1/sandboxes", json={"memory_mb": 64, "timeout": over}))
    with pytest.raises(corral.InvalidArgument, match="--max-lifetime"):
        corral.Sandbox.create(memory_mb=64, timeout=over, client=alice)
    at_max = corral.Sandbox.create(memory_mb=64, timeout=MAX_LIFETIME, client=alice)
    assert at_max.info.spec.timeout == MAX_LIFETIME
    default = corral.Sandbox.create(memory_mb=64, client=alice)  # names none: lowered
    assert default.info.spec.timeout == MAX_LIFETIME
    (copy,) = default.fork(1)  # inherited: within the maximum too
    assert copy.info.spec.timeout == MAX_LIFETIME
    # E2B and Tensorlake (the same listener) and cwsandbox
    with httpx.Client(base_url=team.url, headers={"X-API-KEY": ADMIN_TOKEN}, timeout=120) as e2b:
        _refused(e2b.post("/v2/sandboxes", json={"templateID": "base", "timeout": over}))
    with team.tcp(ADMIN_TOKEN) as tl:
        _refused(tl.post("/sandboxes", json={"resources": {"memory_mb": 64},
                                             "timeout_secs": over}))
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("cwsandbox")
    from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc

    with grpc.insecure_channel(team.grpc) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.CreateSandbox(
                sandbox_pb2.CreateSandboxRequest(sandbox=sandbox_pb2.Sandbox(
                    spec=sandbox_pb2.SandboxSpec(max_lifetime_seconds=over))),
                metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),), timeout=120)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-lifetime" in caught.value.details()
    with team.admin() as admin:
        timeouts = [s["spec"]["timeout"] for s in admin.get("/v1/sandboxes").json()["sandboxes"]]
    assert max(timeouts) <= MAX_LIFETIME and len(timeouts) == 3, timeouts


def test_cwsandbox_calls_are_in_the_access_log(team):
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("cwsandbox")
    from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc

    since = team.daemon.log.stat().st_size
    with grpc.insecure_channel(team.grpc) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        stub.ListSandboxes(sandbox_pb2.ListSandboxesRequest(),
                           metadata=(("authorization", f"Bearer {team.tokens['bob']}"),))
        with pytest.raises(grpc.RpcError):
            stub.GetSandbox(sandbox_pb2.GetSandboxRequest(sandbox_id="sb-0123456789ab"),
                            metadata=(("authorization", f"Bearer {team.tokens['bob']}"),))
        with pytest.raises(grpc.RpcError):
            stub.ListSandboxes(sandbox_pb2.ListSandboxesRequest(),
                               metadata=(("authorization", "Bearer wrong"),))
    deadline = time.monotonic() + 60
    while True:
        with open(team.daemon.log, "rb") as f:
            f.seek(since)
            lines = [json.loads(x) for x in f.read().decode().splitlines() if x.startswith("{")]
        calls = [r for r in lines if r.get("logger") == "corral.access"
                 and str(r.get("route", "")).startswith("grpc:")]
        if len(calls) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    got = [(r["tenant"], r["method"], r["status"]) for r in calls]
    assert got == [("bob", "ListSandboxes", "OK"), ("bob", "GetSandbox", "NOT_FOUND"),
                   (None, "ListSandboxes", "UNAUTHENTICATED")], got
    assert all(isinstance(r["duration_ms"], float) and r["duration_ms"] >= 0 for r in calls)


def test_a_tenant_maximum_lifetime_below_the_daemons(team):
    """`corral token create --max-lifetime 120`: its creates (asked, default, via E2B)
    and its set_timeout stay within 120 s, named as its tenant's maximum; another
    tenant keeps the daemon's."""
    token = team.make_token("shortlived", max_lifetime=120)
    with corral.Client(team.url, token=token) as short:
        with pytest.raises(corral.InvalidArgument, match="token create --max-lifetime"):
            corral.Sandbox.create(memory_mb=64, timeout=121, client=short)
        sb = corral.Sandbox.create(memory_mb=64, client=short)  # the default: lowered
        assert sb.info.spec.timeout == 120
        with pytest.raises(corral.InvalidArgument, match="token create --max-lifetime"):
            sb.set_timeout(300)
        assert sb.set_timeout(60).spec.timeout <= 120
    with httpx.Client(base_url=team.url, headers={"X-API-KEY": token}, timeout=120) as e2b:
        reply = e2b.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
        assert reply.status_code == 400 and "--max-lifetime" in reply.text, reply.text
    with team.admin() as admin:
        listed = {t["name"]: t for t in admin.get("/v1/tokens").json()["tokens"]}
    assert listed["shortlived"]["max_lifetime"] == 120
    with corral.Client(team.url, token=team.tokens["bob"]) as bob:
        other = corral.Sandbox.create(memory_mb=64, timeout=MAX_LIFETIME, client=bob)
        assert other.info.spec.timeout == MAX_LIFETIME
    team.cleanup()
