"""Tensorlake namespaces are a boundary: ``bob`` cannot see or touch ``alice``'s objects.

Before, namespaces were only labels: through ``/v1/namespaces/bob/...`` bob could get,
suspend, snapshot, copy and delete alice's sandbox, read her snapshots and pools, start
sandboxes from them, and run commands and read files in her sandbox through the
in-sandbox API. Now an object of another namespace answers exactly like an id that
never existed (404, the same body but for the id asked about), lists show the
namespace's own objects, and the flat paths are the ``default`` namespace.

The first test drives Tensorlake's own client (two namespaces, as its ``namespace=``
argument sends them); the second sends raw HTTP for what the client never sends by
itself (another namespace's sandbox id in the in-sandbox API, flat paths).
"""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.conftest import ROOT_REASON, have_root_runtime
from tests.server.test_compat_tensorlake import TOKEN, _start, checked, run_script, serving

pytest.importorskip("tensorlake.sandbox", reason="the compat extra (tensorlake) is not installed")

UNKNOWN_SANDBOX = "sb-000000000000"


@pytest.fixture(scope="module")
def tl():
    with serving() as d:
        yield d


@pytest.fixture
def tl_ok(tl):
    """The daemon, checked afterwards: no traceback logged, no sandbox left behind."""
    with checked(tl) as d:
        yield d


def test_bob_cannot_reach_alices_objects_with_the_client(tl_ok):
    out = run_script(
        tl_ok,
        """
        import os
        URL = os.environ["TENSORLAKE_API_URL"]
        A = SandboxClient(_internal=True, namespace="alice")
        B = SandboxClient(_internal=True, namespace="bob")
        sb = Sandbox.create(memory_mb=64, name="agent", namespace="alice")
        sid = sb.sandbox_id
        sb.write_file("/workspace/secret.txt", b"alice's")
        proc = sb.start_process("sleep", ["300"])
        snap = sb.checkpoint().snapshot_id
        pool = A.create_pool(image="python", memory_mb=64, warm_containers=0,
                             max_containers=1).pool_id

        calls = {
            "get": lambda: B.get(sid),
            "get_by_name": lambda: B.get("agent"),
            "connect": lambda: Sandbox.connect(sid, namespace="bob"),
            "suspend": lambda: B.suspend(sid),
            "resume": lambda: B.resume(sid),
            "snapshot": lambda: B.snapshot(sid),
            "sandbox_snapshots": lambda: list(B.list_sandbox_snapshots(sid)),
            "copy": lambda: B.copy(sid, times=1),
            "get_snapshot": lambda: B.get_snapshot(snap),
            "from_snapshot": lambda: Sandbox.create(snapshot_id=snap, namespace="bob"),
            "delete_snapshot": lambda: B.delete_snapshot(snap),
            "get_pool": lambda: B.get_pool(pool),
            "claim": lambda: B.claim(pool),
            "delete_pool": lambda: B.delete_pool(pool),
            "delete": lambda: B.delete(sid),
        }
        out["bob"] = {k: err(f) for k, f in calls.items()}
        out["bob_lists"] = [[s.sandbox_id for s in B.list()],
                            [s.snapshot_id for s in B.list_snapshots()],
                            [p.pool_id for p in B.list_pools()]]
        # The in-sandbox API, through a handle bob makes without a lookup.
        for where, proxy in (("bob", URL + "/v1/namespaces/bob"), ("flat", URL)):
            h = Sandbox.connect(sid, proxy_url=proxy, namespace="bob")
            out["proxy_" + where] = {
                "read": err(lambda: h.read_file("/workspace/secret.txt")),
                "write": err(lambda: h.write_file("/workspace/secret.txt", b"bob's")),
                "ls": err(lambda: h.list_directory("/workspace")),
                "delete_file": err(lambda: h.delete_file("/workspace/secret.txt")),
                "run": err(lambda: h.run("cat", ["/workspace/secret.txt"])),
                "start": err(lambda: h.start_process("sleep", ["1"])),
                "processes": err(lambda: h.list_processes()),
                "process": err(lambda: h.get_process(proc.pid)),
                "stdout": err(lambda: h.get_stdout(proc.pid)),
                "kill": err(lambda: h.send_signal(proc.pid, 15)),
            }

        # bob may use the same name in his namespace: another sandbox
        mine = Sandbox.create(memory_mb=64, name="agent", namespace="bob")
        out["namesake"] = [mine.sandbox_id != sid, B.get("agent").sandbox_id == mine.sandbox_id,
                           A.get("agent").sandbox_id == sid,
                           [s.sandbox_id for s in B.list()] == [mine.sandbox_id]]
        out["bob_runs_his_own"] = mine.run("echo", ["mine"]).stdout

        # alice's objects are untouched and still hers
        out["alice"] = [A.get(sid).status.value, A.get(sid).namespace,
                        sb.read_file("/workspace/secret.txt").value.decode(),
                        sb.get_process(proc.pid).status.value,
                        [s.snapshot_id for s in A.list_snapshots()] == [snap],
                        [p.pool_id for p in A.list_pools()] == [pool],
                        [s.sandbox_id for s in A.list()] == [sid]]
        D = SandboxClient(_internal=True)  # the default namespace
        out["default"] = [err(lambda: D.get(sid)), [s.sandbox_id for s in D.list()]]

        mine.terminate()
        A.delete_pool(pool)
        A.delete_snapshot(snap)
        A.delete(sid)
        """,
    )
    bob = out["bob"]
    for key in ("get", "get_by_name", "connect", "suspend", "resume", "snapshot", "delete"):
        assert bob[key]["type"] == "SandboxNotFoundError", (key, bob[key])
    for key in ("sandbox_snapshots", "copy", "get_snapshot", "from_snapshot", "delete_snapshot",
                "claim"):
        assert bob[key]["status"] == 404 or bob[key]["type"].endswith("NotFoundError"), (
            key, bob[key])
    for key in ("get_pool", "delete_pool"):
        assert bob[key]["type"] == "PoolNotFoundError", (key, bob[key])
    assert out["bob_lists"] == [[], [], []]
    for where in ("proxy_bob", "proxy_flat"):
        for key, got in out[where].items():
            assert got is not None and got["status"] == 404, (where, key, got)
            assert "alice" not in got["msg"], (where, key, got)
    assert out["namesake"] == [True, True, True, True]
    assert out["bob_runs_his_own"] == "mine"
    assert out["alice"] == ["running", "alice", "alice's", "running", True, True, True]
    assert out["default"][0]["type"] == "SandboxNotFoundError"
    assert out["default"][1] == []


def _same_but_for(reply: httpx.Response, asked: str, unknown: httpx.Response, other: str) -> None:
    """``reply`` (about an object of another namespace) is ``unknown``'s reply (about an
    id that never existed) with the other id in it: status, headers' type, body."""
    assert reply.status_code == unknown.status_code == 404, (reply.text, unknown.text)
    assert reply.headers["content-type"] == unknown.headers["content-type"]
    assert reply.text.replace(asked, "<id>") == unknown.text.replace(other, "<id>")


def _in_sandbox(c: httpx.Client, method: str, path: str, ref: str, by_host: bool,
                kw: dict) -> httpx.Response:
    """An in-sandbox call naming its sandbox as the client does: by Host or by header."""
    header = {"Host": f"{ref}.local"} if by_host else {"X-Tensorlake-Sandbox-Id": ref}
    return c.request(method, path, headers=header, **kw)


def test_another_namespaces_object_answers_like_an_unknown_id(tl_ok):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=tl_ok.api_url, headers=auth, timeout=120) as c:
        made = c.post("/v1/namespaces/alice/sandboxes", json={"resources": {"memory_mb": 64}})
        assert made.status_code == 200, made.text
        sid = made.json()["sandbox_id"]
        # alice's in-sandbox calls go under her namespace (the client keeps the path)
        assert made.json()["sandbox_url"].endswith("/v1/namespaces/alice")
        flat = c.post("/sandboxes", json={"resources": {"memory_mb": 64}})
        flat_sid = flat.json()["sandbox_id"]
        assert not flat.json()["sandbox_url"].endswith("/default")
        try:
            ran = c.post("/v1/namespaces/alice/api/v1/processes", headers={"Host": f"{sid}.local"},
                         json={"command": "sleep", "args": ["300"]})
            assert ran.status_code == 200, ran.text
            pid = ran.json()["pid"]
            snap = c.post(f"/v1/namespaces/alice/sandboxes/{sid}/snapshot", json={})
            snap_id = snap.json()["snapshot_id"]
            pool = c.post("/v1/namespaces/alice/sandbox-pools", json={"resources": {"memory_mb": 64}})
            pool_id = pool.json()["pool_id"]

            def both(method: str, path: str, ref: str, unknown: str, **kw) -> None:
                for prefix in ("/v1/namespaces/bob", ""):  # bob's, and the default namespace
                    theirs = c.request(method, prefix + path.format(ref), **kw)
                    nobody = c.request(method, prefix + path.format(unknown), **kw)
                    _same_but_for(theirs, ref, nobody, unknown)

            for method, path in (
                ("GET", "/sandboxes/{}"), ("DELETE", "/sandboxes/{}"),
                ("POST", "/sandboxes/{}/suspend"), ("POST", "/sandboxes/{}/resume"),
                ("POST", "/sandboxes/{}/snapshot"), ("GET", "/sandboxes/{}/snapshots"),
                ("POST", "/sandboxes/{}/copy"),
            ):
                both(method, path, sid, UNKNOWN_SANDBOX, json={})
            for method, path in (("GET", "/snapshots/{}"), ("DELETE", "/snapshots/{}")):
                both(method, path, snap_id, "snap-000000000000")
            for method, path in (("GET", "/sandbox-pools/{}"), ("DELETE", "/sandbox-pools/{}"),
                                 ("POST", "/sandbox-pools/{}/sandboxes")):
                both(method, path, pool_id, "pool-00000000", json={})
            for prefix in ("/v1/namespaces/bob", ""):
                theirs = c.post(prefix + "/sandboxes", json={"snapshot_id": snap_id})
                nobody = c.post(prefix + "/sandboxes", json={"snapshot_id": "snap-000000000000"})
                _same_but_for(theirs, snap_id, nobody, "snap-000000000000")

            # The in-sandbox API: by Host and by header, namespaced and flat.
            for method, path, kw in (
                ("GET", "/api/v1/files", {"params": {"path": "/etc/hostname"}}),
                ("PUT", "/api/v1/files", {"params": {"path": "/tmp/x"}, "content": b"x"}),
                ("DELETE", "/api/v1/files", {"params": {"path": "/tmp/x"}}),
                ("GET", "/api/v1/files/list", {"params": {"path": "/"}}),
                ("POST", "/api/v1/processes/run", {"json": {"command": "true"}}),
                ("POST", "/api/v1/processes", {"json": {"command": "true"}}),
                ("GET", "/api/v1/processes", {}),
                ("GET", f"/api/v1/processes/{pid}", {}),
                ("DELETE", f"/api/v1/processes/{pid}", {}),
                ("POST", f"/api/v1/processes/{pid}/signal", {"json": {"signal": 15}}),
                ("GET", f"/api/v1/processes/{pid}/output", {}),
                ("GET", f"/api/v1/processes/{pid}/stdout/follow", {}),
                ("GET", "/api/v1/health", {}),
                ("GET", "/api/v1/info", {}),
            ):
                for prefix in ("/v1/namespaces/bob", ""):
                    for by_host in (True, False):
                        theirs = _in_sandbox(c, method, prefix + path, sid, by_host, kw)
                        nobody = _in_sandbox(c, method, prefix + path, UNKNOWN_SANDBOX, by_host, kw)
                        _same_but_for(theirs, sid, nobody, UNKNOWN_SANDBOX)

            # Lists: nothing of alice's anywhere else; the default namespace has its own.
            for prefix, mine in (("/v1/namespaces/bob", set()), ("", {flat_sid})):
                listed = c.get(prefix + "/sandboxes").json()["sandboxes"]
                assert {s["id"] for s in listed} == mine
                assert c.get(prefix + "/snapshots").json()["snapshots"] == []
                assert c.get(prefix + "/sandbox-pools").json()["pools"] == []
            # alice still has all of it, and her process still runs
            assert {s["id"] for s in c.get("/v1/namespaces/alice/sandboxes").json()["sandboxes"]} == {sid}
            got = c.get(f"/v1/namespaces/alice/api/v1/processes/{pid}",
                        headers={"Host": f"{sid}.local"})
            assert got.json()["status"] == "running"
            assert c.get(f"/v1/namespaces/alice/snapshots/{snap_id}").status_code == 200
            assert c.get(f"/v1/namespaces/alice/sandbox-pools/{pool_id}").status_code == 200
            assert c.delete(f"/v1/namespaces/alice/sandbox-pools/{pool_id}").status_code == 200
            assert c.delete(f"/v1/namespaces/alice/snapshots/{snap_id}").status_code == 200
        finally:
            assert c.delete(f"/v1/namespaces/alice/sandboxes/{sid}").status_code == 200
            assert c.delete(f"/sandboxes/{flat_sid}").status_code == 200


def test_a_native_sandbox_is_in_no_namespace(tl_ok):
    """A sandbox made through corral's own API has no namespace tag: the front-end does
    not see it, under any namespace (before: reachable from every one)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=tl_ok.api_url, headers=auth, timeout=120) as c:
        made = c.post("/v1/sandboxes", json={"memory_mb": 64})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        try:
            for prefix in ("/v1/namespaces/default", ""):
                assert c.get(f"{prefix}/sandboxes/{sid}").status_code == 404
                run = c.post(prefix + "/api/v1/processes/run", headers={"Host": f"{sid}.local"},
                             json={"command": "true"})
                assert run.status_code == 404
                assert sid not in {s["id"] for s in c.get(prefix + "/sandboxes").json()["sandboxes"]}
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def test_the_cwsandbox_front_end_cannot_reach_a_namespace(monkeypatch):
    """cwsandbox has no namespaces (its scope is the API key: the daemon's one token),
    so a Tensorlake namespace's sandbox is out of its reach: unknown to Get, Delete,
    Exec, StreamExec, ReadFile and WriteFile, left out of List, and a create may not set
    the namespace and name tags (before: all of it reached, and a create could plant a
    sandbox in alice's namespace under the name her ``connect("agent")`` resolves)."""
    cwsandbox = pytest.importorskip("cwsandbox")
    import grpc
    from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc
    from cwsandbox.exceptions import SandboxNotFoundError, SandboxValidationError

    from tests.server.conftest import free_port

    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    port = free_port()
    d = _start("--grpc", f"127.0.0.1:{port}")
    monkeypatch.setenv("CWSANDBOX_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("CWSANDBOX_API_KEY", TOKEN)
    monkeypatch.setenv("CWSANDBOX_DISABLE_SIGNAL_HANDLERS", "1")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=d.api_url, headers=auth, timeout=120) as c:
            made = c.post("/v1/namespaces/alice/sandboxes",
                          json={"resources": {"memory_mb": 64}, "name": "agent"})
            sid = made.json()["sandbox_id"]
            c.post("/v1/namespaces/alice/sandboxes/agent/suspend")  # not running now
            with pytest.raises(SandboxNotFoundError):
                cwsandbox.Sandbox.from_id(sid).result()
            with pytest.raises(SandboxNotFoundError):
                cwsandbox.Sandbox.delete(sid).result()
            assert sid not in {s.sandbox_id for s in cwsandbox.Sandbox.list().result()}
            with pytest.raises(SandboxValidationError):
                cwsandbox.Sandbox.run(tags=["tensorlake.ns=alice", "tensorlake.name=agent"],
                                      resources={"cpu": "500m", "memory": "64Mi"})
            listed = c.get("/v1/namespaces/alice/sandboxes").json()["sandboxes"]
            assert [s["id"] for s in listed] == [sid]

            meta = (("authorization", f"Bearer {TOKEN}"),)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = sandbox_pb2_grpc.SandboxServiceStub(channel)

                def status(call, ref: str) -> tuple:
                    try:
                        call(ref)
                    except grpc.RpcError as exc:
                        return exc.code(), exc.details().replace(ref, "<id>")
                    return "answered", ref

                calls = {
                    "exec": lambda ref: stub.Exec(sandbox_pb2.ExecRequest(
                        sandbox_id=ref, command=["true"]), metadata=meta),
                    "read": lambda ref: stub.ReadFile(sandbox_pb2.ReadFileRequest(
                        sandbox_id=ref, path="/etc/hostname"), metadata=meta),
                    "write": lambda ref: stub.WriteFile(sandbox_pb2.WriteFileRequest(
                        sandbox_id=ref, path="/tmp/x", content=b"x"), metadata=meta),
                    "stream": lambda ref: list(stub.StreamExec(iter([sandbox_pb2.ExecStreamRequest(
                        init=sandbox_pb2.ExecStreamInit(sandbox_id=ref, command=["true"]))]),
                        metadata=meta)),
                }
                for name, call in calls.items():
                    theirs, nobody = status(call, sid), status(call, UNKNOWN_SANDBOX)
                    assert theirs == nobody, (name, theirs, nobody)
                    assert theirs[0] == grpc.StatusCode.NOT_FOUND, (name, theirs)
            assert c.delete(f"/v1/namespaces/alice/sandboxes/{sid}").status_code == 200
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)
