"""A tenant's image build must not hand it the host's network.

``network="host"`` over TCP needs a daemon started with ``--allow-host-network``
(README: with Ray's GCS open, a host-network sandbox could reach it). An image
build's ``run`` steps ran with the host's network for every caller, so a tenant
with image rights got, through a build, what its sandboxes are refused: the host's
loopback services (here a listener of the test, standing for the GCS). Real daemon,
real builds, a real socket in the host's network namespace."""

from __future__ import annotations

import json
import os
import socket
import threading

from tests.security.tenants_helpers import team_daemon


def _listener() -> tuple[socket.socket, list[bytes]]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(60)
    got: list[bytes] = []

    def accept():
        try:
            conn, _ = srv.accept()
            with conn:
                got.append(conn.recv(64))
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    return srv, got


def _build(client, port: int) -> list[dict]:
    nonce = os.urandom(4).hex()
    probe = (f"python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', {port}), 5);"
             f" s.sendall(b'reached-host')\" || true; : {nonce}")
    body = {"spec": {"base": "python", "memory_mb": 256, "steps": [{"run": probe}]},
            "name": f"net-{nonce}"}
    with client.stream("POST", "/v1/images/build", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x) for x in r.iter_lines() if x.strip()]


def test_a_tenants_build_steps_do_not_reach_the_hosts_loopback():
    with team_daemon() as team:  # no --allow-host-network
        team.make_token("imager", allow_images=True)
        srv, got = _listener()
        try:
            with team.tenant("imager") as t:
                events = _build(t, srv.getsockname()[1])
            assert events[-1]["type"] == "image", events[-1]  # the build itself works
            assert got == [], "a tenant's build step reached the host's loopback"
        finally:
            srv.close()


def test_the_admins_build_steps_keep_the_hosts_network():
    with team_daemon() as team:
        srv, got = _listener()
        try:
            with team.admin() as a:
                events = _build(a, srv.getsockname()[1])
            assert events[-1]["type"] == "image", events[-1]
            for _ in range(100):  # bounded: the accept thread records it
                if got:
                    break
                threading.Event().wait(0.05)
            assert got == [b"reached-host"]
        finally:
            srv.close()
