"""A tenant's limits are limits, and what belongs to one never answers for another
(issue 23, attacks 3, 4 and 7, and the host-network right).

- Attack 3: repeated ``set_timeout`` / PATCH kept a sandbox alive forever past its
  tenant's ``--max-lifetime``; now the maximum bounds its total life from create.
- Attack 4: a tenant planted, through the native API, sandboxes carrying the tags the
  Tensorlake and E2B front-ends use for names and metadata, and the admin's
  Tensorlake ``connect(name)`` and E2B metadata search resolved to them. Now those
  tags are their front-end's alone, and such lookups never cross tenants.
- Attack 7: ``/v1/info`` showed every tenant the whole host's committed memory.
- ``network="host"`` was every TCP caller's once the daemon allowed it; now it is a
  right a tenant's token must be given.
"""

from __future__ import annotations

import httpx
import pytest

from tests.security.tenants_helpers import ADMIN_TOKEN, team_daemon
from tests.security.test_tenants_compat import ERR, run

LIFETIME = 60.0


@pytest.fixture(scope="module")
def team():
    with team_daemon("--allow-host-network") as t:
        t.make_token("brief", max_lifetime=LIFETIME)
        t.make_token("mallory")
        yield t


@pytest.fixture
def clean(team):
    yield team
    team.cleanup()


def _e2b(team, key: str, body: str) -> dict:
    env = {"E2B_API_URL": team.url, "E2B_SANDBOX_URL": team.url, "E2B_API_KEY": key}
    return run(team, env, body, "from e2b import Sandbox, SandboxQuery\n" + ERR)


def _tensorlake(team, key: str, body: str) -> dict:
    env = {"TENSORLAKE_API_URL": team.url, "TENSORLAKE_API_KEY": key}
    return run(team, env, body, "from tensorlake.sandbox import Sandbox, SandboxClient\n" + ERR)


# ------------------------------------------------------------------ attack 3


def test_patch_cannot_stretch_a_sandbox_past_its_tenants_lifetime(clean):
    with clean.tenant("brief") as c:
        sid = c.post("/v1/sandboxes", json={"memory_mb": 64, "timeout": LIFETIME}).json()["id"]
        assert c.patch(f"/v1/sandboxes/{sid}", json={"timeout": 5}).status_code == 200
        for _ in range(3):  # each within the maximum from now, beyond it from create
            refused = c.patch(f"/v1/sandboxes/{sid}", json={"timeout": LIFETIME})
            assert refused.status_code == 400, refused.text
            assert "from its create" in refused.json()["error"]["message"]
        spec = c.get(f"/v1/sandboxes/{sid}").json()["spec"]
        assert spec["timeout"] <= LIFETIME


def test_e2b_set_timeout_cannot_stretch_it_either(clean):
    pytest.importorskip("e2b")
    out = _e2b(clean, clean.tokens["brief"], f"""
        TARGET = "-"
        sb = Sandbox.create(timeout={int(LIFETIME)})
        out["sid"] = sb.sandbox_id
        out["short"] = err(lambda: sb.set_timeout(5))
        out["stretch"] = [err(lambda: sb.set_timeout({int(LIFETIME)})) for _ in range(3)]
    """)
    assert out["short"] is None
    assert all(e is not None for e in out["stretch"]), out
    with clean.admin() as admin:
        spec = admin.get(f"/v1/sandboxes/{out['sid']}").json()["spec"]
    assert spec["timeout"] <= LIFETIME


# ------------------------------------------------------------------ attack 4


@pytest.mark.parametrize("tags", [
    ["tensorlake", "tensorlake.ns=default", "tensorlake.name=vault"],
    ["e2b", "e2b.template=base"],
    ["sandboxfusion"],
])
def test_front_end_tags_cannot_be_planted_through_the_native_api(clean, tags):
    with clean.tenant("mallory") as m:
        made = m.post("/v1/sandboxes", json={"memory_mb": 64, "tags": tags})
        assert made.status_code == 400, made.text
        assert "reserved" in made.json()["error"]["message"]
        pool = m.post("/v1/pools", json={"name": "plant", "min_ready": 0, "max_size": 1,
                                         "spec": {"memory_mb": 64, "tags": tags}})
        assert pool.status_code == 400, pool.text
        mine = m.post("/v1/sandboxes", json={"memory_mb": 64, "tags": ["e2bx", "mine"]})
        assert mine.status_code == 201, mine.text  # only the front-ends' own roots


def test_a_tensorlake_name_never_resolves_to_another_tenants_sandbox(clean):
    pytest.importorskip("tensorlake.sandbox")
    planted = _tensorlake(clean, clean.tokens["mallory"], """
        TARGET = "-"
        sb = Sandbox.create(memory_mb=64, name="vault", timeout_secs=600)
        out["sid"] = sb.sandbox_id
    """)
    admin = _tensorlake(clean, ADMIN_TOKEN, """
        TARGET = "vault"
        out["connect"] = err(lambda: Sandbox.connect("vault"))
        own = Sandbox.create(memory_mb=64, name="vault", timeout_secs=600)  # not taken
        own.write_file("/workspace/secret", b"the admin's")
        out["own"] = own.sandbox_id
        out["again"] = Sandbox.connect("vault").sandbox_id
    """)
    assert admin["connect"] is not None and "NotFound" in admin["connect"][0], admin
    assert admin["again"] == admin["own"] != planted["sid"]


def test_an_e2b_metadata_search_never_finds_another_tenants_sandbox(clean):
    pytest.importorskip("e2b")
    planted = _e2b(clean, clean.tokens["mallory"], """
        sb = Sandbox.create(metadata={"purpose": "secrets"}, timeout=600)
        out["sid"] = sb.sandbox_id
    """)
    admin = _e2b(clean, ADMIN_TOKEN, """
        q = SandboxQuery(metadata={"purpose": "secrets"})
        out["found"] = [s.sandbox_id for s in Sandbox.list(query=q).next_items()]
    """)
    assert planted["sid"] not in admin["found"]
    mine = _e2b(clean, clean.tokens["mallory"], """
        q = SandboxQuery(metadata={"purpose": "secrets"})
        out["found"] = [s.sandbox_id for s in Sandbox.list(query=q).next_items()]
    """)
    assert mine["found"] == [planted["sid"]]


# ------------------------------------------------------------------ attack 7


def test_info_shows_a_tenant_only_its_own_activity(clean):
    with clean.tenant("mallory") as m, clean.tcp(ADMIN_TOKEN) as admin:
        quiet = m.get("/v1/info").json()
        assert quiet["committed_memory_mb"] == 0 and quiet["starting"] == 0
        with clean.tenant("alice") as a:
            assert a.post("/v1/sandboxes", json={"memory_mb": 96}).status_code == 201
            assert a.get("/v1/info").json()["committed_memory_mb"] == 96
        seen = m.get("/v1/info").json()
        assert seen["committed_memory_mb"] == 0, seen  # alice's create is not mallory's news
        assert sum(seen["counts"].values()) == 0
        assert admin.get("/v1/info").json()["committed_memory_mb"] >= 96


# ------------------------------------------------------------- host network


def test_host_network_is_a_right_of_the_tenants_token(clean):
    with clean.tenant("mallory") as m:
        refused = m.post("/v1/sandboxes", json={"memory_mb": 64, "network": "host"})
        assert refused.status_code == 403, refused.text
        assert "--allow-host-network" in refused.json()["error"]["message"]
    granted = clean.make_token("netright", allow_host_network=True)
    with httpx.Client(base_url=clean.url, timeout=120,
                      headers={"Authorization": f"Bearer {granted}"}) as g:
        plan = g.post("/v1/sandboxes", json={"memory_mb": 64, "network": "host"})
        assert plan.status_code != 403, plan.text
    with clean.admin() as admin:
        listed = {t["name"]: t for t in admin.get("/v1/tokens").json()["tokens"]}
    assert listed["netright"]["allow_host_network"] is True
    assert listed["mallory"]["allow_host_network"] is False


def test_a_tenant_cannot_hold_the_hosts_gpus(clean):
    """One tenant's ``gpus="all"`` would hold every GPU of the host: GPUs are given per
    token (``max_gpus``, none without it), refused before any GPU is looked at."""
    with clean.tenant("mallory") as c:
        for gpus in (1, "all"):
            refused = c.post("/v1/sandboxes", json={"memory_mb": 64, "gpus": gpus})
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "quota_exceeded" and error["details"]["quota"] == "max_gpus"
            assert error["details"]["limit"] == 0
