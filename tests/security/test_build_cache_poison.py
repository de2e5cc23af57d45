"""The build cache is host-wide: a step's layer is reused by every later build whose
chain of steps is the same. A tenant's build step runs in a sandbox of its own, which
it may exec in while the step runs: what it plants there is committed with the step.
So a tenant must not fill a cache entry another owner (the admin's grading image,
another tenant) is served from. Real daemon, real builds."""

from __future__ import annotations

import json
import os
import threading

from tests.security.tenants_helpers import no_traceback, team_daemon


def _build(client, body) -> list[dict]:
    with client.stream("POST", "/v1/images/build", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x) for x in r.iter_lines() if x.strip()]


def test_a_tenant_cannot_plant_a_layer_in_another_owners_build():
    with team_daemon() as team:
        team.make_token("poisoner", allow_images=True)
        team.make_token("victim", allow_images=True)
        step = {"run": f"sleep 3; echo fine > /workspace/ok; : {os.urandom(4).hex()}"}
        spec = {"base": "python", "memory_mb": 256, "steps": [step]}
        with team.tenant("poisoner") as p:
            done: list = []
            runner = threading.Thread(
                target=lambda: done.append(_build(p, {"spec": spec, "name": "p-img"})))
            runner.start()
            try:
                planted = False
                for _ in range(200):  # bounded: while its step sleeps, plant a file
                    for sb in p.get("/v1/sandboxes").json()["sandboxes"]:
                        if sb["state"] != "running":
                            continue
                        r = p.post(f"/v1/sandboxes/{sb['id']}/exec", json={
                            "cmd": ["sh", "-c", "echo planted > /workspace/trojan"]})
                        planted |= r.status_code == 200 and r.json().get("returncode") == 0
                    if planted:
                        break
                    threading.Event().wait(0.05)
            finally:
                runner.join(300)
            assert done and done[0][-1]["type"] == "image", done
            assert planted  # its own image has it: its sandbox, its files
        for owner in ("admin", "victim"):  # the same spec, built by another owner
            with (team.admin() if owner == "admin" else team.tenant("victim")) as c:
                events = _build(c, {"spec": spec, "name": f"{owner}-img"})
                assert events[-1]["type"] == "image", events[-1]
                made = c.post("/v1/sandboxes", json={"image": f"{owner}-img"})
                assert made.status_code == 201, made.text
                sid = made.json()["id"]
                ls = c.post(f"/v1/sandboxes/{sid}/exec",
                            json={"cmd": ["ls", "/workspace"]}).json()
                c.delete(f"/v1/sandboxes/{sid}")
            assert "ok" in ls["stdout"], ls
            assert "trojan" not in ls["stdout"], (owner, planted, ls)
        no_traceback(team)
