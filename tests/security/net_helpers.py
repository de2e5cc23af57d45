"""Test servers for the egress-policy tests, each in a network namespace the test makes.

:func:`server_ns` makes ``ctest-<hex>`` linked to the host by a veth pair whose ends
have addresses of TEST-NET-2 (198.51.100.0/24, documentation addresses: no packet to
them leaves this host, the connected route sends them down the veth), and runs in it a
server that answers every HTTP request with its own ``marker``, echoes raw TCP on
port 7000 and UDP on port 7002 (logging each datagram to ``$UDP_LOG`` when set) and
sends 100 MB of zeros to whoever connects to port 7001, on IPv4 and on IPv6
(2001:db8:c0::<octet in hex>, a documentation prefix: no packet to it leaves this host). The proxy reaches it as it would reach a public server.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

SERVER = r"""
import os, socket, sys, threading
marker = sys.argv[1].encode()
def http(c):
    try:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                return
            data += chunk
        body = marker + b" " + data.split(b"\r\n")[0]
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    finally:
        c.close()
def echo(c):
    try:
        while data := c.recv(4096):
            c.sendall(data)
    finally:
        c.close()
def blob(c):
    try:
        zeros = bytes(1 << 20)
        for _ in range(100):
            c.sendall(zeros)
    finally:
        c.close()
ANY = "::"
def dual(kind):
    global ANY
    try:
        s = socket.socket(socket.AF_INET6, kind)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    except OSError:  # a host without IPv6
        s, ANY = socket.socket(socket.AF_INET, kind), "0.0.0.0"
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s
def udp_echo():
    s = dual(socket.SOCK_DGRAM); s.bind((ANY, 7002))
    while True:
        data, addr = s.recvfrom(65535)
        if os.environ.get("UDP_LOG"):
            with open(os.environ["UDP_LOG"], "ab") as f:
                f.write(data + b"\n")
        s.sendto(marker + b" " + data, addr)
def serve(port, fn):
    s = dual(socket.SOCK_STREAM)
    s.bind((ANY, port)); s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=fn, args=(c,), daemon=True).start()
def tls(c):
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[2], sys.argv[3])
    try:
        http(ctx.wrap_socket(c, server_side=True))
    except (OSError, ssl.SSLError):
        c.close()
if len(sys.argv) > 3:
    threading.Thread(target=serve, args=(443, tls), daemon=True).start()
threading.Thread(target=serve, args=(7000, echo), daemon=True).start()
threading.Thread(target=serve, args=(7001, blob), daemon=True).start()
threading.Thread(target=udp_echo, daemon=True).start()
print("ready", flush=True)
serve(80, http)
"""


HTTP_DIR = r"""
import functools, http.server, sys
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])
server = http.server.ThreadingHTTPServer(("0.0.0.0", 80), handler)
print("ready", flush=True)
server.serve_forever()
"""


def self_signed(directory: str, name: str) -> tuple[str, str]:
    """A self-signed certificate for ``name`` and its key, as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = f"{directory}/cert.pem", f"{directory}/key.pem"
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


async def run_probes(engine, sid: str, program: str, probes: dict[str, str]) -> dict:
    """Run ``program`` (it evals each probe's expression, prints a JSON object) in the
    sandbox; what it printed."""
    import json

    r = await engine.exec(sid, ["python3", "-c", program, json.dumps(probes)], timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy",
              "all_proxy", "NO_PROXY", "no_proxy")


@pytest.fixture(scope="module", autouse=True)
def no_host_proxy() -> Iterator[None]:
    """The daemons and engines of a module dial test servers directly, even on a
    machine whose environment names an HTTP proxy (import it into a test module)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in PROXY_VARS:
            mp.delenv(var, raising=False)
        yield


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(argv, check=True, capture_output=True)


def ipv6_on() -> bool:
    from corral.runtime.net.netns import ipv6_on as on

    return on()


V6_PREFIX = "2001:db8:c0::"  # server_ns's IPv6 addresses: V6_PREFIX + octet


def v6(ip: str) -> str:
    """The IPv6 address of the server at the IPv4 address ``ip`` (server_ns's)."""
    return f"{V6_PREFIX}{int(ip.rsplit('.', 1)[1]):x}"


@contextlib.contextmanager
def server_ns(octet: int, marker: str, *, serve_dir: str | None = None,
              tls: tuple[str, str] | None = None, udp_log: str | None = None) -> Iterator[str]:
    """A server answering with ``marker`` at 198.51.100.<octet> (octet % 4 == 2); with
    ``tls`` (certificate and key files) the same over TLS on port 443; with
    ``serve_dir``, ``python3 -m http.server 80`` of that directory instead."""
    assert octet % 4 == 2
    ns, host_if = f"ctest-{secrets.token_hex(3)}", f"ct{secrets.token_hex(4)}"
    server_ip, host_ip = f"198.51.100.{octet}", f"198.51.100.{octet - 1}"
    _ip("netns", "add", ns)
    proc = None
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("addr", "add", f"{server_ip}/30", "dev", "eth0", ns=ns)
        if ipv6_on():
            _ip("addr", "add", f"{V6_PREFIX}{octet - 1:x}/126", "dev", host_if, "nodad")
            _ip("addr", "add", f"{v6(server_ip)}/126", "dev", "eth0", "nodad", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        if serve_dir is not None:
            argv = [HTTP_DIR, serve_dir]
        else:
            argv = [SERVER, marker, *(tls or ())]
        env = {**os.environ, **({"UDP_LOG": udp_log} if udp_log else {})}
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", *argv],
                                stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(0.05)
        yield server_ip
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


CONNECT_PROXY = r"""
import socket, sys, threading
names = dict(p.split("=") for p in sys.argv[2].split(","))
log = sys.argv[1]
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
        b.shutdown(socket.SHUT_WR)  # a FIN now (close() waits for the other thread's recv)
    except OSError:
        pass
def client(c):
    head = b""
    while b"\r\n\r\n" not in head and (chunk := c.recv(4096)):
        head += chunk
    line = head.split(b"\r\n")[0].decode()
    with open(log, "a") as f:
        f.write(line + "\n")
    host, port = line.split()[1].rsplit(":", 1)
    up = socket.create_connection((names.get(host, host), int(port)))
    c.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
    threading.Thread(target=pipe, args=(c, up), daemon=True).start()
    pipe(up, c)
s = socket.socket()
s.bind(("127.0.0.1", 0)); s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=client, args=(c,), daemon=True).start()
"""


@contextlib.contextmanager
def connect_proxy(log: str, names: str) -> Iterator[int]:
    """An HTTP CONNECT proxy on 127.0.0.1 (its port) that logs each request line and
    dials ``names`` (``name=ip,...``) at those addresses."""
    proc = subprocess.Popen([sys.executable, "-c", CONNECT_PROXY, log, names],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
