"""``corral token create|ls|update|revoke`` on the test daemon's Unix socket (the admin)."""

from __future__ import annotations

import json
import re
import secrets

import corral


def test_token_create_ls_revoke(cli, daemon):
    name = f"cli-{secrets.token_hex(3)}"
    made = cli("token", "create", name, "--max-sandboxes", "2", "--max-memory-mb", "256",
               "--max-cpus", "1.5", "--max-lifetime", "900", "--allow-images", "--json").json()
    assert set(made) == {"name", "token"} and made["name"] == name
    assert re.fullmatch(r"crl_[A-Za-z0-9_-]{43}", made["token"])
    listed = {t["name"]: t for t in cli("token", "ls", "--json").json()}
    assert listed[name] | {"created_at": 0} == {
        "name": name, "max_sandboxes": 2, "max_memory_mb": 256, "max_cpus": 1.5,
        "allow_images": True, "created_at": 0, "max_lifetime": 900, "max_snapshot_mb": None,
        "max_builds": None, "allow_host_network": False, "max_gpus": None,
        "usage": {"sandboxes": 0, "memory_mb": 0, "cpus": 0.0, "gpus": 0, "builds": 0,
                  "snapshot_mb": 0, "kept_mb": 0}}
    table = cli("token", "ls")
    assert table.code == 0 and name in table.out and made["token"] not in table.out
    assert re.search(rf"{name}\s+0/2\s+0/256\s+0/1.5\s+0/0\s+0/-\s+0/-\s+yes", table.out), table.out
    up = cli("token", "update", name, "--max-snapshot-mb", "64", "--max-cpus", "none", "--json")
    assert up.code == 0, up.err
    assert (up.json()["max_snapshot_mb"], up.json()["max_cpus"]) == (64, None)
    assert up.json()["max_sandboxes"] == 2  # left out: unchanged
    for given, right in (("allow", True), ("deny", False)):
        up = cli("token", "update", name, "--host-network", given, "--json")
        assert up.code == 0 and up.json()["allow_host_network"] is right, up.err
    nobody = cli("token", "update", "no-such-tenant", "--max-builds", "2")
    assert nobody.code == 1 and "no tenant" in nobody.err
    plain = cli("token", "create", f"{name}-2")
    assert plain.code == 0 and re.fullmatch(r"crl_[A-Za-z0-9_-]{43}\n", plain.out)
    again = cli("token", "create", name)
    assert again.code == 1 and "already exists" in again.err
    bad = cli("token", "create", "Not A Name")
    assert bad.code == 1 and "invalid tenant name" in bad.err
    gone = cli("token", "revoke", name, f"{name}-2")
    assert gone.code == 0 and gone.out.split() == [name, f"{name}-2"]
    assert name not in {t["name"] for t in json.loads(cli("token", "ls", "--json").out)}
    missing = cli("token", "revoke", name)
    assert missing.code == 1 and "no tenant" in missing.err


def test_ls_shows_the_tenant_of_sandboxes(cli, client, tag):
    with corral.Sandbox.create(memory_mb=64, tags=[tag], client=client) as sb:
        listed = cli("ls", "--tag", tag, "--json").json()
        assert [s["spec"]["tenant"] for s in listed] == [None]  # the admin's
        assert sb.info.tenant is None


def test_token_create_grants_the_host_network_only_when_asked(cli, daemon):
    name = f"net-{secrets.token_hex(3)}"
    assert cli("token", "create", name, "--allow-host-network").code == 0
    assert cli("token", "create", f"{name}-no").code == 0
    listed = {t["name"]: t for t in cli("token", "ls", "--json").json()}
    assert listed[name]["allow_host_network"] is True
    assert listed[f"{name}-no"]["allow_host_network"] is False
    assert cli("token", "revoke", name, f"{name}-no").code == 0
