"""Real container registries for the pull tests: Debian's ``docker-registry``
(distribution 2.8) started on 127.0.0.1 on a free port, with or without basic auth,
images pushed into it by Debian's ``skopeo``; and a TCP proxy in front of it that can
cut a blob download half-way and counts the requests it forwards.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REGISTRY_BIN = "docker-registry"
SKOPEO_BIN = "skopeo"
requires_registry = pytest.mark.skipif(
    shutil.which(REGISTRY_BIN) is None or shutil.which(SKOPEO_BIN) is None,
    reason="needs Debian's docker-registry and skopeo (scripts/install.sh installs them)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Registry:
    """A running registry: ``host`` is ``127.0.0.1:PORT``; ``storage`` its blob store."""

    host: str
    storage: Path
    proc: subprocess.Popen
    creds: tuple[str, str] | None = None
    log: Path | None = None

    def push(self, layout: Path, repo: str, *, all_platforms: bool = False,
             digest_file: Path | None = None) -> str:
        """Copy the OCI layout into ``repo`` (``name:tag``) with skopeo; the ref."""
        ref = f"{self.host}/{repo}"
        argv = [SKOPEO_BIN, "copy", "--quiet", "--dest-tls-verify=false"]
        if self.creds:
            argv += ["--dest-creds", ":".join(self.creds)]
        if all_platforms:
            argv += ["--all"]
        if digest_file is not None:
            argv += ["--digestfile", str(digest_file)]
        done = subprocess.run([*argv, f"oci:{layout}", f"docker://{ref}"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"skopeo copy failed: {done.stderr}")
        return ref

    def blob_path(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def run_registry(tmp: Path, *, creds: tuple[str, str] | None = None,
                 token: TokenService | None = None) -> Iterator[Registry]:
    """A registry on 127.0.0.1 for the length of the block: open, with basic auth
    (``creds``), or with token auth (``token``, started, and its ``creds``)."""
    with warnings.catch_warnings():  # deprecated, still there: bcrypt via libxcrypt
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt as _crypt

    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    storage = tmp / "storage"
    storage.mkdir()
    auth = ""
    if creds is not None:
        hashed = _crypt.crypt(creds[1], _crypt.mksalt(_crypt.METHOD_BLOWFISH))
        (tmp / "htpasswd").write_text(f"{creds[0]}:{hashed}\n")
        auth = f"auth:\n  htpasswd:\n    realm: corral-test\n    path: {tmp / 'htpasswd'}\n"
    elif token is not None:
        auth, creds = token.auth_config(), token.creds
    config = tmp / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{auth}")
    log = tmp / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=out,
                                stderr=subprocess.STDOUT)
    reg = Registry(f"127.0.0.1:{port}", storage, proc, creds, log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{reg.host}/v2/", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break  # 401: up, and wants credentials
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no registry: {log.read_text()}") from None
                time.sleep(0.05)
        yield reg
    finally:
        reg.stop()


def write_auth_file(path: Path, host: str, creds: tuple[str, str]) -> Path:
    import base64

    token = base64.b64encode(":".join(creds).encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": token}}}))
    os.chmod(path, 0o600)
    return path


@dataclass
class Proxy:
    """Forwards 127.0.0.1:port to the registry; ``cut_after`` bytes of the first blob
    response it relays, it drops that connection (once). ``requests`` are the request
    lines it saw (with the ``Range`` header appended when present)."""

    target: str
    cut_after: int | None = None
    requests: list[str] = field(default_factory=list)
    host: str = ""
    _sock: socket.socket | None = None

    def start(self) -> Proxy:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.host = f"127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        host, port = self.target.split(":")
        upstream = socket.create_connection((host, int(port)))
        cutting = {"on": False, "sent": 0}

        def down() -> None:
            try:
                while data := upstream.recv(65536):
                    if cutting["on"]:
                        room = self.cut_after - cutting["sent"]  # type: ignore[operator]
                        if len(data) >= room:
                            client.sendall(data[:max(room, 0)])
                            self.cut_after = None
                            client.shutdown(socket.SHUT_RDWR)
                            client.close()
                            upstream.close()
                            return
                        cutting["sent"] += len(data)
                    client.sendall(data)
            except OSError:
                pass
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)

        threading.Thread(target=down, daemon=True).start()
        try:
            while data := client.recv(65536):
                head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
                if head[:4] in ("GET ", "HEAD", "POST", "PUT ", "PATC"):
                    line = head.split("\r\n", 1)[0]
                    rng = [h for h in head.split("\r\n") if h.lower().startswith("range:")]
                    self.requests.append(line + (" " + rng[0] if rng else ""))
                    if self.cut_after is not None and "/blobs/" in line and not rng:
                        cutting["on"] = True
                upstream.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)


def rootfs_layer(rootfs: Path) -> bytes:
    """A plain tar layer of a corral image's root filesystem (the sandbox user's files
    as uid 1000, as an image made elsewhere has them)."""
    from corral.runtime.uids import CANONICAL_UID

    def owner(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if not (info.isfile() or info.isdir() or info.issym() or info.islnk()):
            return None
        if info.uid == CANONICAL_UID:
            info.uid = info.gid = 1000
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(rootfs.iterdir()):
            tar.add(entry, arcname=entry.name, filter=owner)
    return buf.getvalue()


@dataclass
class TokenService:
    """A registry token service (the Docker v2 token protocol): checks basic auth and
    signs ES256 JWTs with a self-signed key the registry trusts (``cert``)."""

    creds: tuple[str, str]
    cert: Path
    realm: str = ""
    issued: list[str] = field(default_factory=list)  # the scopes it granted
    service: str = "corral-test"
    issuer: str = "corral-test-issuer"

    def start(self) -> TokenService:
        import base64
        import datetime
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlsplit

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral-test-token")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        der = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        service = self

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        def jwt(sub: str, scopes: list[str]) -> str:
            access = []
            for scope in scopes:
                kind, _, rest = scope.partition(":")
                repo, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": repo, "actions": actions.split(",")})
            t = int(time.time())
            head = b64(json.dumps({"typ": "JWT", "alg": "ES256", "x5c": [der]}).encode())
            body = b64(json.dumps({"iss": service.issuer, "sub": sub, "aud": service.service,
                                   "exp": t + 600, "nbf": t - 60, "iat": t,
                                   "jti": secrets.token_hex(8), "access": access}).encode())
            r, s = decode_dss_signature(key.sign(f"{head}.{body}".encode(),
                                                 ec.ECDSA(hashes.SHA256())))
            return f"{head}.{body}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                query = parse_qs(urlsplit(self.path).query)
                auth = self.headers.get("Authorization", "")
                want = "Basic " + base64.b64encode(":".join(service.creds).encode()).decode()
                if auth != want:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                scopes = query.get("scope", [])
                service.issued += scopes
                body = json.dumps({"token": jwt(service.creds[0], scopes)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self._server.server_address[1]}/token"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def auth_config(self) -> str:
        return (f"auth:\n  token:\n    realm: {self.realm}\n    service: {self.service}\n"
                f"    issuer: {self.issuer}\n    rootcertbundle: {self.cert}\n")
