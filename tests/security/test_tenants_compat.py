"""Tenants through the compatibility front-ends, each with its real client package in
a subprocess: Tensorlake's bearer, E2B's X-API-KEY, cwsandbox's token and
SandboxFusion's path token each map onto the tenant the same way. Tenant bob, given
alice's sandbox id, meets exactly what an unknown id meets; the admin token still works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from tests.security.tenants_helpers import ADMIN_TOKEN, UNKNOWN, no_traceback, team_daemon
from tests.server.conftest import free_port


@pytest.fixture(scope="module")
def team():
    grpc_port = free_port()
    with team_daemon("--grpc", f"127.0.0.1:{grpc_port}") as t:
        t.grpc_url = f"http://127.0.0.1:{grpc_port}"
        yield t


@pytest.fixture
def clean(team):
    yield team
    team.cleanup()
    no_traceback(team)


def run(team, env: dict[str, str], body: str, prelude: str = "") -> dict:
    """A script of a client package, configured only by its environment variables."""
    script = Path(team.daemon.base) / "script.py"
    script.write_text("import json, sys\nout = {}\n" + textwrap.dedent(prelude)
                      + textwrap.dedent(body) + "\nprint(json.dumps(out), flush=True)\n"
                      "import os\nos._exit(0)\n")
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    proc = subprocess.run([sys.executable, str(script)], env=full, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


ERR = """
def err(f):
    try:
        f()
    except Exception as e:
        return [type(e).__name__, str(e).replace(TARGET, "ID")]
    return None
"""


def _owner(team, sid: str) -> str | None:
    with team.admin() as admin:
        return admin.get(f"/v1/sandboxes/{sid}").json()["spec"]["tenant"]


# -------------------------------------------------------------- Tensorlake


def test_tensorlake(clean):
    pytest.importorskip("tensorlake.sandbox")
    team = clean

    def tl(key: str, body: str) -> dict:
        prelude = "from tensorlake.sandbox import Sandbox, SandboxClient\n" + ERR
        return run(team, {"TENSORLAKE_API_URL": team.url, "TENSORLAKE_API_KEY": key},
                   body, prelude)

    made = tl(team.tokens["alice"], """
        TARGET = "-"
        sb = Sandbox.create(memory_mb=64, timeout_secs=600)
        sb.write_file("/workspace/secret", b"alice's")
        out["sid"] = sb.sandbox_id
    """)
    sid = made["sid"]
    assert _owner(team, sid) == "alice"
    attacks = """
        client = SandboxClient(_internal=True)
        out["listed"] = [s.sandbox_id for s in client.list()]
        for target in (SID, UNKNOWN):
            TARGET = target
            out[target] = [err(lambda: Sandbox.connect(target)), err(lambda: client.get(target)),
                           err(lambda: client.delete(target)),
                           err(lambda: client.snapshot(target))]
    """.replace("SID", repr(sid)).replace("UNKNOWN", repr(UNKNOWN))
    out = tl(team.tokens["bob"], attacks)
    assert sid not in out["listed"]
    assert out[sid] == out[UNKNOWN]
    assert all(e is not None and e[0] == "SandboxNotFoundError" for e in out[sid][:3]), out[sid]
    admin = tl(ADMIN_TOKEN, f"""
        TARGET = "-"
        sb = Sandbox.connect({sid!r})
        out["read"] = sb.read_file("/workspace/secret").value.decode()
        out["listed"] = [s.sandbox_id for s in SandboxClient(_internal=True).list()]
    """)
    assert admin["read"] == "alice's" and sid in admin["listed"]


# --------------------------------------------------------------------- E2B


def test_e2b(clean):
    pytest.importorskip("e2b")
    team = clean

    def e2b(key: str, body: str) -> dict:
        prelude = "from e2b import Sandbox\n" + ERR
        env = {"E2B_API_URL": team.url, "E2B_SANDBOX_URL": team.url, "E2B_API_KEY": key}
        return run(team, env, body, prelude)

    made = e2b(team.tokens["alice"], """
        TARGET = "-"
        sb = Sandbox.create(timeout=600)
        sb.files.write("/workspace/secret", "alice's")
        out["run"] = sb.commands.run("echo hi").stdout
        out["sid"] = sb.sandbox_id
    """)
    sid = made["sid"]
    assert made["run"] == "hi\n"
    assert _owner(team, sid) == "alice"
    out = e2b(team.tokens["bob"], """
        out["listed"] = [s.sandbox_id for s in Sandbox.list().next_items()]
        for target in (SID, UNKNOWN):
            TARGET = target
            out[target] = [err(lambda: Sandbox.connect(target)),
                           err(lambda: Sandbox.get_info(target)),
                           Sandbox.kill(target), err(lambda: Sandbox.set_timeout(target, 5))]
    """.replace("SID", repr(sid)).replace("UNKNOWN", repr(UNKNOWN)))
    assert sid not in out["listed"]
    assert out[sid] == out[UNKNOWN]
    assert out[sid][0] is not None and "NotFound" in out[sid][0][0], out[sid]
    assert out[sid][2] is False  # kill: as for an id that does not exist
    with team.tenant("alice") as a:
        assert a.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


def test_e2b_auto_paused_sandbox_is_out_of_another_tenants_reach(clean):
    """Alice's sandbox auto-paused (hibernated at its timeout): bob's connect (which
    resumes a paused sandbox), get_info, set_timeout and kill meet what an unknown id
    meets, and do not wake it; alice's connect does, with her file."""
    pytest.importorskip("e2b")
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    team = clean

    def e2b(key: str, body: str) -> dict:
        prelude = "import time\nfrom e2b import Sandbox\n" + ERR
        env = {"E2B_API_URL": team.url, "E2B_SANDBOX_URL": team.url, "E2B_API_KEY": key}
        return run(team, env, body, prelude)

    made = e2b(team.tokens["alice"], """
        sb = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"})
        sb.files.write("/workspace/secret", "alice's")
        sb.set_timeout(2)  # from now (2 s from the create could end before the write)
        out["sid"] = sb.sandbox_id
        for _ in range(1200):
            if Sandbox.get_info(sb.sandbox_id).state.value == "paused":
                break
            time.sleep(0.1)
    """)
    sid = made["sid"]
    with team.tenant("alice") as a:
        assert a.get(f"/v1/sandboxes/{sid}").json()["reason"] == "hibernated"
    out = e2b(team.tokens["bob"], """
        for target in (SID, UNKNOWN):
            TARGET = target
            out[target] = [err(lambda: Sandbox.connect(target, timeout=600)),
                           err(lambda: Sandbox.get_info(target)),
                           err(lambda: Sandbox.set_timeout(target, 600)), Sandbox.kill(target)]
    """.replace("SID", repr(sid)).replace("UNKNOWN", repr(UNKNOWN)))
    assert out[sid] == out[UNKNOWN]
    assert out[sid][0] is not None and "NotFound" in out[sid][0][0], out[sid]
    with team.tenant("alice") as a:
        row = a.get(f"/v1/sandboxes/{sid}").json()
        assert (row["state"], row["reason"]) == ("paused", "hibernated")  # not woken
    back = e2b(team.tokens["alice"], f"""
        sb = Sandbox.connect({sid!r}, timeout=60)
        out["read"] = sb.files.read("/workspace/secret")
        sb.kill()
    """)
    assert back["read"] == "alice's"


def test_e2b_fork_and_snapshots_are_out_of_another_tenants_reach(clean):
    """Bob, given alice's checkpointable sandbox and her snapshot (id and name): his
    fork, create_snapshot, create from it and delete_snapshot meet what unknown ids
    meet, his list_snapshots shows none; nothing of alice's is forked, snapshotted or
    deleted."""
    pytest.importorskip("e2b")
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    team = clean

    def e2b(key: str, body: str) -> dict:
        prelude = "from e2b import Sandbox\n" + ERR
        env = {"E2B_API_URL": team.url, "E2B_SANDBOX_URL": team.url, "E2B_API_KEY": key}
        return run(team, env, body, prelude)

    made = e2b(team.tokens["alice"], """
        sb = Sandbox.create(metadata={"corral.checkpointable": "true"}, timeout=600)
        sb.files.write("/workspace/secret", "alice's")
        out["sid"], out["snap"] = sb.sandbox_id, sb.create_snapshot(name="alices").snapshot_id
    """)
    sid, snap = made["sid"], made["snap"]
    unknown_snap = "snap-0123456789ab"
    out = e2b(team.tokens["bob"], f"""
        for target, snap in (({sid!r}, {snap!r}), ({UNKNOWN!r}, {unknown_snap!r})):
            TARGET = target
            forked = err(lambda: Sandbox.fork(target, count=1))
            taken = err(lambda: Sandbox.create_snapshot(target))
            TARGET = snap
            out[target] = [forked, taken, err(lambda: Sandbox.create(snap)),
                           Sandbox.delete_snapshot(snap)]
        TARGET = "alices"
        out["by_name"] = err(lambda: Sandbox.create("alices"))
        out["listed"] = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    """)
    assert out[sid] == out[UNKNOWN], out
    assert "NotFound" in out[sid][0][0] and "NotFound" in out[sid][1][0], out
    assert out[sid][2] is not None and out[sid][3] is False, out
    assert out["by_name"] is not None and "404" in out["by_name"][1], out
    assert out["listed"] == [], out
    with team.tenant("alice") as a:
        assert [s["id"] for s in a.get("/v1/snapshots").json()["snapshots"]] == [snap]
        assert a.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        left = [s for s in a.get("/v1/sandboxes").json()["sandboxes"] if s["id"] != sid
                and s["state"] in ("pending", "running", "paused")]
        assert left == []  # bob's fork made no copy of alice's
        assert a.delete(f"/v1/snapshots/{snap}").status_code == 204


# --------------------------------------------------------------- cwsandbox


def test_cwsandbox(clean):
    pytest.importorskip("cwsandbox")
    team = clean

    def cw(key: str, body: str) -> dict:
        prelude = "from cwsandbox import Sandbox\n" + ERR
        env = {"CWSANDBOX_BASE_URL": team.grpc_url, "CWSANDBOX_API_KEY": key,
               "CWSANDBOX_DISABLE_SIGNAL_HANDLERS": "1"}
        return run(team, env, body, prelude)

    made = cw(team.tokens["alice"], """
        TARGET = "-"
        sb = Sandbox.run(resources={"cpu": "500m", "memory": "64Mi"})
        sb.wait()
        out["sid"] = sb.sandbox_id
    """)
    sid = made["sid"]
    assert _owner(team, sid) == "alice"
    out = cw(team.tokens["bob"], """
        out["listed"] = [s.sandbox_id for s in Sandbox.list().result()]
        for target in (SID, UNKNOWN):
            TARGET = target
            out[target] = [err(lambda: Sandbox.from_id(target).result()),
                           err(lambda: Sandbox.delete(target).result())]
    """.replace("SID", repr(sid)).replace("UNKNOWN", repr(UNKNOWN)))
    assert sid not in out["listed"]
    assert out[sid] == out[UNKNOWN]
    assert all(e is not None and "NotFound" in e[0] for e in out[sid]), out[sid]
    with team.tenant("alice") as a:
        assert a.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    gone = cw(team.tokens["alice"], f"""
        TARGET = "-"
        Sandbox.delete({sid!r}).result()
        out["after"] = err(lambda: Sandbox.from_id({sid!r}).result())  # its final state
    """)
    assert gone["after"] is None
    # a deleted sandbox's last record is alice's alone
    out = cw(team.tokens["bob"], """
        for target in (SID, UNKNOWN):
            TARGET = target
            out[target] = [err(lambda: Sandbox.from_id(target).result()),
                           err(lambda: Sandbox.delete(target).result())]
        out["listed"] = [s.sandbox_id for s in Sandbox.list(show_terminated=True).result()]
    """.replace("SID", repr(sid)).replace("UNKNOWN", repr(UNKNOWN)))
    assert out[sid] == out[UNKNOWN] and sid not in out["listed"]
    wrong = cw("not-a-token", """
        TARGET = "-"
        out["e"] = err(lambda: Sandbox.list().result())
    """)
    assert "Authentication" in wrong["e"][0]


# ---------------------------------------------------------- SandboxFusion


def test_sandboxfusion_tenant_path_token(clean):
    team = clean
    body = {"code": "print(6*7)", "language": "python"}

    def fusion(token: str) -> httpx.Response:
        return httpx.post(f"{team.url}/sandboxfusion/{token}/run_code", json=body, timeout=120)

    for token in (team.tokens["alice"], ADMIN_TOKEN):
        reply = fusion(token)
        assert reply.status_code == 200, reply.text
        assert reply.json()["run_result"]["stdout"] == "42\n"
    with team.admin() as admin:  # alice's warm pool is hers, apart from the admin's
        pools = {p["name"]: p["spec"]["tenant"] for p in admin.get("/v1/pools").json()["pools"]}
    assert set(pools.values()) == {"alice", None}
    with team.tenant("bob") as b:
        assert b.get("/v1/pools").json()["pools"] == []
    with team.tenant("alice") as a:
        assert [p["spec"]["tenant"] for p in a.get("/v1/pools").json()["pools"]] == ["alice"]
    assert fusion("crl_" + "x" * 43).status_code == 401
    fleeting = team.make_token("fleeting")
    assert fusion(fleeting).status_code == 200
    with team.admin() as admin:
        assert admin.delete("/v1/tokens/fleeting").status_code == 204
    assert fusion(fleeting).status_code == 401  # revoked: refused at once
