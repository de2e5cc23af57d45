"""``corral pool ls|create|rm`` and the pools in ``corral info``, on a real daemon."""

from __future__ import annotations

import secrets
import time

import corral
from tests.conftest import requires_root

pytestmark = requires_root

POLLS = 600  # x 0.05 s


def test_pool_create_ls_info_rm(cli, client, tag):
    name = f"cli-{secrets.token_hex(3)}"
    try:
        made = cli("pool", "create", name, "--memory-mb", "64", "--min-ready", "1",
                   "--max-size", "3", "--tag", tag)
        assert made.code == 0, made.err
        assert made.out == f"{name}\n"

        for _ in range(POLLS):
            pools = {p["name"]: p for p in cli("pool", "ls", "--json").json()}
            if pools[name]["ready"] == 1:
                break
            time.sleep(0.05)
        assert pools[name]["ready"] == 1 and pools[name]["max_size"] == 3
        assert pools[name]["spec"]["tags"] == [tag, f"pool={name}"]
        assert name in cli("pool", "ls", "-q").out.split()

        row = next(line for line in cli("pool", "ls").out.splitlines() if line.startswith(name))
        assert row.split()[1:9] == ["python", "64", "1", "0", "0", "0", "1", "3"]
        info = cli("info")
        assert info.code == 0 and "WAIT P50 MS" in info.out
        assert any(line.startswith(name) for line in info.out.splitlines())
        assert name in [p["name"] for p in cli("info", "--json").json()["pools"]]

        again = cli("pool", "create", name)
        assert again.code == 1 and "already exists" in again.err
        assert cli("pool", "create", "--min-ready", "5", "--max-size", "2").code == 1
    finally:
        gone = cli("pool", "rm", name)
    assert gone.code == 0 and gone.out == f"{name}\n"
    assert name not in cli("pool", "ls", "-q").out.split()
    assert corral.Sandbox.list(tags=[f"pool={name}"], client=client) == []


def test_pool_errors_are_messages(cli_process):
    r = cli_process("pool", "create", "bad name")
    assert r.code == 1 and r.err.startswith("corral: invalid pool: name: ")
    r = cli_process("pool", "create", "x", "--image", "no-such-image", "--min-ready", "0")
    assert r.code == 1 and "no-such-image" in r.err and "Traceback" not in r.err
    assert cli_process("pool", "ls").code == 0
