"""Client leases and retention: what a crashed trainer leaves behind is cleaned up.

- ``Session(lease=...)``: a real client process holds sandboxes while it runs; once it
  is SIGKILLed, the daemon stops them (reason ``lease expired``) about one lease later
  instead of at the end of their lifetime. Waits are bounded polls.
- ``--default-lease``: a session over TCP takes the daemon's lease by itself (not one
  on the Unix socket); a sandbox may carry only a live lease's tag.
- ``--retention``: an ended sandbox, and the files kept for it, are removed after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import corral
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(600)]

TOKEN = "lease-test-token"
LEASE_S = 4.0

CLIENT = """
import sys, time, corral
client = corral.Client(sys.argv[1])
session = corral.Session(lease=float(sys.argv[2]), client=client)
sandboxes = [session.create(memory_mb=64, timeout=3600) for _ in range(2)]
print(" ".join(sb.id for sb in sandboxes), session.lease_id, flush=True)
time.sleep(3600)
"""


def _poll(check, what: str, limit: float = 120.0):  # noqa: ANN001, ANN202 - a test helper
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {limit:g} s: {what}")


def test_the_sandboxes_of_a_killed_client_end_soon_after(make_daemon):
    d = make_daemon()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, d.url, str(LEASE_S)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        *ids, lease_id = proc.stdout.readline().split()
        assert len(ids) == 2 and lease_id.startswith("lease-")
        with corral.Client(d.url) as c:
            for sid in ids:
                sb = corral.Sandbox.connect(sid, client=c)
                assert f"lease={lease_id}" in sb.info.spec.tags
            # renewed while the client lives: still running a lease and more later
            time.sleep(LEASE_S + 1)
            assert all(corral.Sandbox.connect(s, client=c).state == corral.SandboxState.RUNNING
                       for s in ids)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            for sid in ids:
                info = _poll(lambda sid=sid: (i := corral.Sandbox.connect(sid, client=c).info)
                             .state.terminal and i, f"{sid} ends after its client died")
                assert info.state == corral.SandboxState.STOPPED
                assert (info.reason or "").startswith("lease expired"), info.reason
            with pytest.raises(corral.LeaseNotFound):  # the lease is gone with them
                c.request("POST", f"/v1/leases/{lease_id}/renew")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_closed_session_releases_its_lease(make_daemon):
    d = make_daemon()
    with corral.Client(d.url) as c:
        with corral.Session(lease=30, client=c) as session:
            sb = session.create(memory_mb=64)
            lease_id = session.lease_id
            assert lease_id and f"lease={lease_id}" in sb.info.spec.tags
            assert session.tag == f"session={session.id}"
        with pytest.raises(corral.LeaseNotFound):
            c.request("POST", f"/v1/leases/{lease_id}/renew")
        # a lease tag names a live lease of the caller's: no other may be put on
        with pytest.raises(corral.LeaseNotFound):
            corral.Sandbox.create(client=c, memory_mb=64, tags=[f"lease={lease_id}"])
    with pytest.raises(corral.InvalidArgument, match="lease"):
        corral.Session(lease=0.5)


def test_a_tcp_session_takes_the_daemons_default_lease(make_daemon):
    d = make_daemon("--tcp", "127.0.0.1:0", "--token", TOKEN, "--default-lease", "30")
    port = _tcp_port(d)
    with corral.Client(f"http://127.0.0.1:{port}", token=TOKEN) as c:
        assert c.info()["default_lease"] == 30
        with corral.Session(client=c) as session:
            sb = session.create(memory_mb=64)
            assert session.lease_id and f"lease={session.lease_id}" in sb.info.spec.tags
        with corral.Session(client=c, lease=0) as session:
            session.create(memory_mb=64)
            assert session.lease_id is None
    with corral.Client(d.url) as c, corral.Session(client=c) as session:
        session.create(memory_mb=64)
        assert session.lease_id is None  # on the Unix socket: none by default


def test_ended_sandboxes_and_their_kept_files_go_after_the_retention(make_daemon):
    d = make_daemon("--retention", "3")
    with corral.Client(d.url) as c:
        sb = corral.Sandbox.create(client=c, memory_mb=64)
        sb.files.write("/home/sandbox/big.bin", os.urandom(1 << 20))
        sb.stop()
        kept = d.state_dir / "stopped" / sb.id
        assert kept.exists()  # kept after the stop, readable
        assert len(sb.files.read("/home/sandbox/big.bin")) == 1 << 20

        def gone() -> bool:
            try:
                corral.Sandbox.connect(sb.id, client=c)
            except corral.SandboxNotFound:
                return True
            return False

        _poll(gone, "the ended sandbox is removed after --retention")
        _poll(lambda: not kept.exists(), "its kept files are removed with it")


def _tcp_port(d) -> int:  # noqa: ANN001 - the conftest's Daemon
    """The port a daemon started with --tcp HOST:0 listens on, from its log."""
    def found() -> int | None:
        for line in d.log.read_text().splitlines():
            if "http://127.0.0.1:" in line:
                return int(line.split("http://127.0.0.1:")[1].split()[0])
        return None
    return _poll(found, "the daemon logs its TCP address", limit=30)
