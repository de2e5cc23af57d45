"""A daemon started by an unkind parent works, and clients reach it past any proxy.

The daemon here starts from :mod:`tests.security.hostile_parent` (signals ignored and
blocked, SIGINT and SIGTERM among them; umask 077; low soft limits; no terminal; stdin
closed; ``PYTHONWARNINGS=error``, no ``HOME``, odd locale, ``TMPDIR`` and time zone;
proxies in its environment), its output a pipe nobody reads until it has stopped. The
test's own process has ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` pointing at a
listener that records what it is sent: the SDK, over TCP and over the Unix socket,
must go straight to the daemon on loopback (a proxy would see the token), and so must a
daemon-to-daemon client (:func:`corral.cluster.proof.proven_client`: before, httpx
mounted the environment's proxy in front of its guarded transport, so the request and
its credential went to the proxy and no daemon proved anything).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from corral.cluster import proof
from tests.conftest import _base_dir, _wait_for_socket, requires_root
from tests.security.edge_daemon import AUTH, TOKEN
from tests.security.squatter import Squatter
from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@pytest.fixture
def proxy(monkeypatch):
    """Every proxy variable of this process names a recording listener; no NO_PROXY."""
    rec = Squatter(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
    for name in PROXY_VARS:
        monkeypatch.setenv(name, rec.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    yield rec
    rec.close()


def test_a_proven_daemon_client_never_goes_through_the_environments_proxy(proxy):
    # the address the directory pins (no daemon there: nothing proves itself)
    target = Squatter(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
    try:
        _, public = proof.make_key()
        pins = proof.Pins([(target.url, "n" * 56, public)])
        with proof.proven_client(pins, timeout=5) as http:
            with pytest.raises(httpx.ConnectError):
                http.get(target.url + "/v1/info", headers=AUTH)
        assert proxy.connections == 0 and not proxy.received
        assert target.connections == 1  # dialled directly, and asked for its proof first
        assert bytes(target.received).startswith(b"GET /v1/cluster/proof?nonce=")
    finally:
        target.close()


@requires_root
@pytest.mark.root
def test_a_daemon_from_an_unkind_parent_serves_and_stops_on_sigint(proxy):
    import corral

    base = _base_dir()
    port = free_port()
    sock = base / "corral.sock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.security.hostile_parent", "--",
         sys.executable, "-m", "corral.server", "--socket", str(sock), "--state-dir",
         str(base / "state"), "--tcp", f"127.0.0.1:{port}", "--token", TOKEN],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
    )
    try:
        _wait_for_socket(sock, proc)
        for url in (f"http://127.0.0.1:{port}", f"unix://{sock}"):
            with corral.Client(url, token=TOKEN) as client, \
                    corral.Sandbox.create(client=client) as sb:
                r = sb.exec("umask; echo $HOME; ulimit -c", timeout=60)
                assert (r.returncode, r.stdout) == (0, "0022\n/home/sandbox\n0\n"), r.stderr
        assert proxy.connections == 0 and not proxy.received
        # SIGINT came ignored and blocked: the daemon still stops, with its sandboxes
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        import shutil

        shutil.rmtree(base, ignore_errors=True)
