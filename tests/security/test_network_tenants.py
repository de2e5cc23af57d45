"""Egress policies through the daemon: tenants may not have the host's network nor a
policy naming private ranges; the SDK's network_events / update_network; the daemon's
TCP port is never reachable from a policy sandbox."""

from __future__ import annotations

import time

import pytest

import corral
from corral.errors import Forbidden, InvalidArgument, SandboxNotFound
from tests.security.net_helpers import no_host_proxy, server_ns  # noqa: F401  (a fixture)
from tests.security.tenants_helpers import no_traceback, team_daemon

FETCH = r"""
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    s.sendall(b"GET / HTTP/1.0\r\nHost: " + sys.argv[3].encode() + b"\r\n\r\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    print(data.split(b"\r\n\r\n", 1)[-1].decode())
except Exception as e:
    print(type(e).__name__)
"""


@pytest.fixture(scope="module")
def team():
    with server_ns(10, "GOOD") as good, pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_NETWORK_HOSTS", f"good.test={good}")
        with team_daemon("--allow-host-network") as t:
            yield t


def test_tenant_gets_no_host_network_nor_private_ranges(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        with pytest.raises(Forbidden):
            corral.Sandbox.create(network="host", client=alice)
        with pytest.raises(Forbidden):
            corral.Sandbox.create(network={"allow": ["10.0.0.0/8"]}, client=alice)
        with pytest.raises(InvalidArgument):
            corral.Sandbox.create(network={"allow": ["example.com:65536"]}, client=alice)
        sb = corral.Sandbox.create(network={"allow": ["good.test"]}, memory_mb=64, client=alice)
        try:
            with pytest.raises(Forbidden):
                sb.update_network(allow=["169.254.169.254/32"])
            r = sb.exec(["python3", "-c", FETCH, "good.test", "80", "good.test"], timeout=60)
            assert r.stdout.strip() == "GOOD GET / HTTP/1.0"
            # the daemon's TCP port, on the link's host end and on loopback's address
            r = sb.exec(["python3", "-c", FETCH, "127.0.0.1", str(team.port), "x"], timeout=60)
            assert r.stdout.strip() == "ConnectionRefusedError"  # its own loopback
            events = sb.network_events()
            assert any(e["name"] == "good.test" and e["verdict"] == "allowed" for e in events)
            with corral.Client(team.url, token=team.tokens["bob"]) as bob:
                with pytest.raises(SandboxNotFound):
                    corral.Sandbox.connect(sb.id, client=bob).network_events()
            sb.update_network(allow=["other.test"])
            assert sb.info.spec.network.allow == ["other.test"]
            r = sb.exec(["python3", "-c", FETCH, "good.test", "80", "good.test"], timeout=60)
            assert r.stdout.strip() == "gaierror"
            assert sb.network_events()[-1]["verdict"] == "refused"
        finally:
            sb.delete()
    team.cleanup()
    no_traceback(team)


def test_daemon_port_unreachable_from_a_policy_sandbox(team):
    with team.admin() as admin:
        reply = admin.post("/v1/sandboxes", json={
            "memory_mb": 64, "network": {"allow": ["*", "0.0.0.0/0", "127.0.0.0/8"]}})
        assert reply.status_code == 201, reply.text
        sid = reply.json()["id"]
        host_end = admin.get(f"/v1/sandboxes/{sid}/network/events")
        assert host_end.status_code == 200 and host_end.json()["events"] == []
        code = "print(open('/etc/resolv.conf').read().split()[1])"
        r = admin.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["python3", "-c", code]})
        gateway = r.json()["stdout"].strip()  # the link's host end
        for ip in (gateway, "127.0.0.1"):
            r = admin.post(f"/v1/sandboxes/{sid}/exec", json={
                "cmd": ["python3", "-c", FETCH, ip, str(team.port), "x"]})
            assert r.json()["stdout"].strip() in ("ConnectionResetError",
                                                  "ConnectionRefusedError"), r.json()
        events = admin.get(f"/v1/sandboxes/{sid}/network/events").json()["events"]
        assert [e["verdict"] for e in events] == ["refused"]
        assert "never reachable" in events[0]["reason"]
        none = admin.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        reply = admin.get(f"/v1/sandboxes/{none}/network/events")
        assert reply.status_code == 409 and "invalid_state" in reply.text
    team.cleanup()
    no_traceback(team)


def test_named_networks_are_their_tenants_own(team, capsys):
    """corral.Network: a tenant's named policy, used by object or by name; another
    tenant can neither see nor use it; a tenant's may name no private range; the CLI."""
    from corral.cli.main import main
    from corral.errors import InvalidState, NetworkNotFound

    with corral.Client(team.url, token=team.tokens["alice"]) as alice, \
            corral.Client(team.url, token=team.tokens["bob"]) as bob:
        web = corral.Network.create("web", allow=["good.test"], client=alice)
        assert web.policy is not None and web.policy.allow == ["good.test"]
        with pytest.raises(InvalidState):
            corral.Network.create("web", allow=["good.test"], client=alice)
        for bad in ("host", "none", "Web", "a/b", ".."):
            with pytest.raises(InvalidArgument):
                corral.Network.create(bad, allow=["good.test"], client=alice)
        with pytest.raises(Forbidden):
            corral.Network.create("lan", allow=["10.0.0.0/8"], client=alice)
        with pytest.raises(Forbidden):
            corral.Network.create("ula", allow=["fd00::/8"], client=alice)
        for network in (corral.Network("web"), "web"):
            sb = corral.Sandbox.create(network=network, memory_mb=64, client=alice)
            try:
                assert sb.info.spec.network.allow == ["good.test"]  # its own copy
                r = sb.exec(["python3", "-c", FETCH, "good.test", "80", "good.test"], timeout=60)
                assert r.stdout.strip() == "GOOD GET / HTTP/1.0"
            finally:
                sb.delete()
        assert [n.name for n in corral.Network.list(client=alice)] == ["web"]
        assert corral.Network.list(client=bob) == []
        with pytest.raises(NetworkNotFound):
            corral.Network.get("web", client=bob)
        with pytest.raises(NetworkNotFound):
            corral.Sandbox.create(network="web", memory_mb=64, client=bob)
        with pytest.raises(NetworkNotFound):
            corral.Network("web", client=bob).delete()
        with pytest.raises(NetworkNotFound):  # claiming alice's tenancy changes nothing
            bob.request("POST", "/v1/sandboxes", json={
                "network": "web", "tenant": "alice", "memory_mb": 64})
        web.delete()
        with pytest.raises(NetworkNotFound):
            corral.Sandbox.create(network=corral.Network("web"), memory_mb=64, client=alice)
    conn = ["--url", team.url, "--token", team.tokens["alice"]]
    assert main([*conn, "network", "create", "cli-net", "--allow", "good.test"]) == 0
    assert main([*conn, "network", "ls"]) == 0
    assert "cli-net\tallow=good.test" in capsys.readouterr().out
    assert main([*conn, "network", "rm", "cli-net"]) == 0
    team.cleanup()
    no_traceback(team)


def test_a_host_network_right_taken_back_ends_what_used_it(team):
    """A tenant given the host-network right made a named network naming a private
    range, a sandbox on it and one on the host's network. The admin takes the right
    back (``PATCH /v1/tokens/NAME {"allow_host_network": false}``, ``corral token
    update NAME --host-network deny``). Before, no update could take it back (a 400), and
    nothing checked a sandbox already using it: the named network kept working. Now the
    sandboxes using it stop at once, new ones on that network (or the host's) are
    refused, a fork is refused; the others run on, and the network itself stays."""
    team.make_token("dora", allow_host_network=True)
    with corral.Client(team.url, token=team.tokens["dora"]) as dora:
        lan = corral.Network.create("lan", allow=["10.99.0.0/16", "good.test"], client=dora)
        on_lan = corral.Sandbox.create(network=lan, memory_mb=64, client=dora)
        on_host = corral.Sandbox.create(network="host", memory_mb=64, client=dora)
        public = corral.Sandbox.create(network={"allow": ["good.test"]}, memory_mb=64,
                                       client=dora)
        pool = dora.request("POST", "/v1/pools", json={
            "name": "lanpool", "spec": {"network": "lan", "memory_mb": 64},
            "min_ready": 1, "max_size": 1}).json()
        assert _pool_until(dora, pool["name"], lambda p: p["ready"] == 1)["last_error"] is None
        with team.admin() as admin:
            reply = admin.patch("/v1/tokens/dora", json={"allow_host_network": False})
            assert reply.status_code == 200, reply.text
            assert reply.json()["allow_host_network"] is False
            bad = admin.patch("/v1/tokens/dora", json={"allow_host_network": "no"})
            assert bad.status_code == 400, bad.text
        assert corral.Sandbox.connect(on_lan.id, client=dora).info.state.value == "stopped"
        assert corral.Sandbox.connect(on_host.id, client=dora).info.state.value == "stopped"
        assert public.exec(["true"], timeout=30).returncode == 0  # it used no such right
        for network in ("lan", "host", {"allow": ["10.0.0.0/8"]}):
            with pytest.raises(Forbidden):
                corral.Sandbox.create(network=network, memory_mb=64, client=dora)
        with pytest.raises(Forbidden):
            corral.Network.create("lan2", allow=["10.0.0.0/8"], client=dora)
        assert corral.Network.get("lan", client=dora).policy.allow[0] == "10.99.0.0/16"
        # its refills act for dora as she is now: refused (before, they went on)
        refused = _pool_until(dora, "lanpool", lambda p: p["last_error"] is not None)
        assert "only the admin may allow" in refused["last_error"], refused
        assert refused["ready"] == 0
        public.update_network(allow=["good.test"])
        with pytest.raises(Forbidden):
            public.update_network(allow=["10.99.0.0/16"])
        for sb in (on_lan, on_host, public):
            sb.delete()
        dora.request("DELETE", "/v1/pools/lanpool")
    no_traceback(team)


def _pool_until(client, name: str, done) -> dict:
    """The pool's info once ``done`` says so (polled: a pool fills in the background)."""
    for _ in range(600):
        info = client.request("GET", f"/v1/pools/{name}").json()
        if done(info):
            return info
        time.sleep(0.1)
    raise AssertionError(f"pool {name} never got there: {info}")


def test_a_create_queued_while_the_right_is_taken_back_does_not_get_it(team):
    """Race (red team 10): a tenant at its max_sandboxes asks for a host-network sandbox
    with ``?wait=``: it passed the right's check and waits in admission. The admin takes
    the right back, which stops the sandbox it had and so frees its place: the queued
    create must not then start on the host's network (its check was of the right as it
    was); it is refused, and nothing of it runs."""
    import threading

    token = team.make_token("erin", allow_host_network=True, max_sandboxes=1)
    with team.tcp(token) as erin:
        first = erin.post("/v1/sandboxes", json={"network": "host", "memory_mb": 64})
        assert first.status_code == 201, first.text
        replies = []
        queued = threading.Thread(target=lambda: replies.append(erin.post(
            "/v1/sandboxes?wait=60", json={"network": "host", "memory_mb": 64})))
        queued.start()
        try:
            with team.admin() as admin:
                time.sleep(1.0)  # it waits for erin's quota (nothing shows that wait)
                assert queued.is_alive() and not replies
                reply = admin.patch("/v1/tokens/erin", json={"allow_host_network": False})
                assert reply.status_code == 200, reply.text
        finally:
            queued.join(90)
        (second,) = replies
        assert second.status_code == 403, second.text
        with team.admin() as admin:
            listed = admin.get("/v1/sandboxes").json()["sandboxes"]
        running = [s for s in listed if s.get("tenant") == "erin"
                   and s["state"] in ("pending", "running", "paused")]
        assert running == [], running
        erin.delete(f"/v1/sandboxes/{first.json()['id']}")
    no_traceback(team)




def test_a_snapshot_of_a_host_sandbox_restores_to_nothing_once_the_right_is_gone(team):
    """(red team 10) A tenant with the right snapshots its host-network sandbox (a live
    checkpoint of one is refused typed: its resolv.conf mount, so none hibernates); the
    right is taken back: a create from the snapshot, with or without the network named
    again, does not get the host's network."""
    token = team.make_token("fay", allow_host_network=True)
    with team.tcp(token) as fay:
        made = fay.post("/v1/sandboxes", json={"network": "host", "memory_mb": 64,
                                               "checkpointable": True})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        live = fay.post(f"/v1/sandboxes/{sid}/checkpoint", json={})
        assert live.status_code == 501 and live.json()["error"]["code"] == "unsupported"
        taken = fay.post(f"/v1/sandboxes/{sid}/snapshot", json={})
        assert taken.status_code in (200, 201), taken.text
        snap = taken.json()["id"]
        with team.admin() as admin:
            reply = admin.patch("/v1/tokens/fay", json={"allow_host_network": False})
            assert reply.status_code == 200, reply.text
        assert fay.get(f"/v1/sandboxes/{sid}").json()["state"] == "stopped"
        for spec in ({"snapshot": snap}, {"snapshot": snap, "network": "host"}):
            again = fay.post("/v1/sandboxes", json={**spec, "memory_mb": 64})
            assert again.status_code == 403 or (
                again.status_code == 201 and again.json()["spec"]["network"] != "host"), again.text
            if again.status_code == 201:
                fay.delete(f"/v1/sandboxes/{again.json()['id']}")
        fay.delete(f"/v1/sandboxes/{sid}")
        fay.delete(f"/v1/snapshots/{snap}")
    no_traceback(team)
