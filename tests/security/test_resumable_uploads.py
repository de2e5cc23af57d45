"""Resumable uploads (server/upload_routes.py) through a real daemon over TCP.

A connection killed mid-body leaves the upload at the bytes that arrived and the rest
resumes from there; the SDK's ``files.upload(..., resumable=True)`` sends parts; an
upload id is its tenant's and its sandbox's only (another tenant's id is unknown); an
upload that lies about its size, or resumes from the wrong offset, is refused typed;
open uploads stage no more than their sandbox's disk_mb, nor eat the host's disk reserve,
and go with their sandbox.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import time

import pytest

import corral
from corral.errors import FileTooLarge, InvalidArgument, InvalidState, UploadNotFound
from tests.security.tenants_helpers import no_traceback, read_by_peer, team_daemon

SIZE = 3 << 20


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def _cut_patch(team, token: str, url: str, offset: int, data: bytes, declared: int) -> None:
    """A PATCH that declares ``declared`` bytes, sends ``data`` and dies (a reset)."""
    s = socket.create_connection(("127.0.0.1", team.port))
    s.sendall((f"PATCH {url} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
               f"Upload-Offset: {offset}\r\nContent-Length: {declared}\r\n\r\n").encode() + data)
    read_by_peer(s)  # the daemon read what came
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_killed_connection_resumes_from_its_offset(team, tmp_path, monkeypatch):
    blob = os.urandom(SIZE)
    token = team.tokens["alice"]
    with corral.Client(team.url, token=token) as alice, team.tenant("alice") as http:
        sb = corral.Sandbox.create(memory_mb=64, client=alice)
        base = f"/v1/sandboxes/{sb.id}/uploads"
        up = http.post(base, json={"path": "big.bin", "size": SIZE}).json()
        url = f"{base}/{up['upload_id']}"
        _cut_patch(team, token, url, 0, blob[:(1 << 20) + 1234], SIZE)
        for _ in range(1200):  # the daemon notices the reset
            state = http.get(url).json()
            if state["offset"] == (1 << 20) + 1234:
                break
            time.sleep(0.05)
        assert state["offset"] == (1 << 20) + 1234 and not state["done"]
        assert not sb.files.exists("big.bin")  # nothing half-written at its path
        wrong = http.patch(url, content=b"x", headers={"Upload-Offset": "0"})
        assert wrong.status_code == 409 and wrong.json()["error"]["details"]["offset"] == state["offset"]
        n = state["offset"]
        done = http.patch(url, content=blob[n:], headers={"Upload-Offset": str(n)}).json()
        assert done["done"] and done["offset"] == SIZE
        assert hashlib.sha256(sb.files.read("big.bin")).digest() == hashlib.sha256(blob).digest()

        # the SDK: in parts, each a request
        import corral.client._sync._files as files

        monkeypatch.setattr(files, "UPLOAD_PART", 1 << 20)
        local = tmp_path / "model.ckpt"
        local.write_bytes(blob)
        seen: list[tuple[int, int]] = []
        sb.files.upload(local, "ckpt/model.ckpt", resumable=True,
                        progress=lambda n, total: seen.append((n, total)))
        assert sb.files.read("ckpt/model.ckpt") == blob
        assert seen == [(n << 20, SIZE) for n in range(1, 4)]  # as each part is taken
        sb.delete()
    team.cleanup()
    no_traceback(team)


def test_upload_ids_are_their_tenants_and_sizes_are_kept(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as alice, \
            corral.Client(team.url, token=team.tokens["bob"]) as bob:
        sb = corral.Sandbox.create(memory_mb=64, disk_mb=64, client=alice)
        mine = corral.Sandbox.create(memory_mb=64, client=bob)
        base = f"/v1/sandboxes/{sb.id}/uploads"
        uid = alice.request("POST", base, json={"path": "f", "size": 10}).json()["upload_id"]
        # bob, with alice's id: under his own sandbox it is unknown, like a made-up one
        for theirs in (uid, "up-" + "0" * 32):
            for method, kw in (("GET", {}), ("DELETE", {}),
                               ("PATCH", {"content": b"x", "headers": {"Upload-Offset": "0"}})):
                with pytest.raises(UploadNotFound):
                    bob.request(method, f"/v1/sandboxes/{mine.id}/uploads/{theirs}", **kw)
        with pytest.raises(corral.SandboxNotFound):  # and alice's sandbox is not his
            bob.request("GET", f"{base}/{uid}")
        # more bytes than declared: refused, the upload stays where it was
        with pytest.raises(InvalidArgument):
            alice.request("PATCH", f"{base}/{uid}", content=b"x" * 11,
                          headers={"Upload-Offset": "0"})
        assert alice.request("GET", f"{base}/{uid}").json()["offset"] <= 10
        with pytest.raises(InvalidState):
            alice.request("PATCH", f"{base}/{uid}", content=b"x", headers={"Upload-Offset": "5"})
        with pytest.raises(FileTooLarge):  # past the sandbox's disk_mb
            alice.request("POST", base, json={"path": "f", "size": 65 << 20})
        with pytest.raises(InvalidArgument):
            alice.request("POST", base, json={"path": "f", "size": -1})
        with pytest.raises(InvalidArgument):  # PathOutsideSandbox: before any byte is sent
            alice.request("POST", base, json={"path": "../../../etc/x", "size": 1})
        alice.request("DELETE", f"{base}/{uid}")
        with pytest.raises(UploadNotFound):
            alice.request("GET", f"{base}/{uid}")
        sb.delete()
        mine.delete()
    team.cleanup()
    no_traceback(team)


def test_open_uploads_cannot_stage_more_than_the_sandbox_or_the_host_holds(team):
    """Sixteen uploads each as large as the sandbox's disk staged 16x its disk_mb on the
    host, and nothing kept the host's disk reserve: the sizes of a sandbox's open uploads
    add up to its disk_mb at most, and all open uploads fit above the reserve."""
    from corral.errors import StorageFull

    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        sb = corral.Sandbox.create(memory_mb=64, disk_mb=64, client=alice)
        base = f"/v1/sandboxes/{sb.id}/uploads"
        alice.request("POST", base, json={"path": "a", "size": 40 << 20})
        with pytest.raises(FileTooLarge, match="open uploads already declare"):
            alice.request("POST", base, json={"path": "b", "size": 40 << 20})
        up = alice.request("POST", base, json={"path": "b", "size": 24 << 20}).json()
        alice.request("PATCH", f"{base}/{up['upload_id']}", content=b"x" * (1 << 20),
                      headers={"Upload-Offset": "0"})  # a part staged on the host
        staged = team.daemon.state_dir / "uploads" / f"{up['upload_id']}.part"
        assert staged.stat().st_size == 1 << 20
        sb.delete()  # its uploads go with it (a revoked tenant never sweeps its own)
        for _ in range(1200):
            if not staged.exists():
                break
            time.sleep(0.05)
        assert not staged.exists()
        huge = corral.Sandbox.create(memory_mb=64, disk_mb=1 << 22, client=alice)
        with pytest.raises(StorageFull):  # 4 TiB: more than this host's disk keeps free
            alice.request("POST", f"/v1/sandboxes/{huge.id}/uploads",
                          json={"path": "x", "size": (1 << 42) - 1})
        huge.delete()
    no_traceback(team)


def test_an_upload_abandoned_while_its_bytes_come_is_not_found_not_a_traceback(team):
    token = team.tokens["alice"]
    with corral.Client(team.url, token=token) as alice:
        sb = corral.Sandbox.create(memory_mb=64, client=alice)
        base = f"/v1/sandboxes/{sb.id}/uploads"
        uid = alice.request("POST", base, json={"path": "f", "size": 8}).json()["upload_id"]
        s = socket.create_connection(("127.0.0.1", team.port))
        s.sendall((f"PATCH {base}/{uid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}"
                   "\r\nUpload-Offset: 0\r\nContent-Length: 8\r\nConnection: close\r\n\r\n"
                   "1234").encode())
        for _ in range(1200):  # the first bytes arrived
            if alice.request("GET", f"{base}/{uid}").json()["offset"] == 4:
                break
            time.sleep(0.05)
        alice.request("DELETE", f"{base}/{uid}")
        s.sendall(b"5678")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        s.close()
        assert reply.startswith(b"HTTP/1.1 404") and b"upload_not_found" in reply, reply[:300]
        assert not sb.files.exists("f")
        sb.delete()
    no_traceback(team)


def test_a_number_in_unicode_digits_is_a_typed_400_not_a_traceback(team):
    """A hostile TCP client: ``"²".isdigit()`` is true but ``int("²")`` fails, so an
    ``Upload-Offset``, a ``limit`` or a ``max_mb`` of superscript digits passed the check
    and raised ValueError: a 500 and a traceback. Such numbers are 400 ``invalid_argument``."""
    import httpx

    auth = {"Authorization": f"Bearer {team.tokens['alice']}"}
    with corral.Client(team.url, token=team.tokens["alice"]) as alice, \
            httpx.Client(base_url=team.url, headers=auth, timeout=60) as http:
        sb = corral.Sandbox.create(memory_mb=64, client=alice)
        base = f"/v1/sandboxes/{sb.id}"
        uid = http.post(f"{base}/uploads", json={"path": "f", "size": 4}).json()["upload_id"]
        replies = [
            http.patch(f"{base}/uploads/{uid}", content=b"abcd",
                       headers={"Upload-Offset": "\u00b2".encode("latin-1")}),
            http.get(f"{base}/logs", params={"limit": "\u00b2"}),
            http.post("/v1/volumes", params={"name": "v", "max_mb": "\u00b3"}, content=b""),
        ]
        assert [r.status_code for r in replies] == [400] * 3, [r.text for r in replies]
        sb.delete()
    no_traceback(team)


def test_a_volume_upload_cut_off_resumes_at_its_offset_and_lands_whole(team, tmp_path,
                                                                        monkeypatch):
    """The same uploads into a volume (server/volume_uploads.py): resumed at the offset
    that arrived, put in place whole, never while a sandbox mounts the volume ro or cow,
    never through a symlink planted in it, another tenant's upload id unknown."""
    token = team.tokens["alice"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "README").write_text("checkpoints\n")
    data = team.daemon.state_dir / "volumes" / "alice" / "ckpts" / "data"
    blob = os.urandom(SIZE)
    with corral.Client(team.url, token=token) as alice, team.tenant("alice") as http, \
            team.tenant("bob") as bob:
        vol = corral.Volume.create("ckpts", tmp_path / "src", client=alice)
        base = "/v1/volumes/ckpts/uploads"
        up = http.post(base, json={"path": "models/ckpt.bin", "size": SIZE}).json()
        assert up["volume"] == "ckpts" and up["offset"] == 0
        url = f"{base}/{up['upload_id']}"
        sent = (1 << 20) + 99
        _cut_patch(team, token, url, 0, blob[:sent], SIZE)
        for _ in range(400):  # the daemon reads what came, then sees the reset
            state = http.get(url).json()
            if state["offset"] == sent:
                break
            time.sleep(0.05)
        assert state["offset"] <= sent and not state["done"]  # all, unless a loaded host
        assert not (data / "models").exists()  # nothing at its path yet
        assert bob.get(url).status_code == 404  # alice's volume, alice's upload
        wrong = http.patch(url, content=b"x", headers={"Upload-Offset": str(state["offset"] + 1)})
        assert wrong.status_code == 409 and wrong.json()["error"]["details"]["offset"] == state["offset"]
        # a reader mounts it: the last byte waits (its files must not change under it)
        sb = corral.Sandbox.create(memory_mb=64, volumes={"/data": "ckpts:ro"}, client=alice)
        n = state["offset"]
        r = http.patch(url, content=blob[n:], headers={"Upload-Offset": str(n)})
        assert r.status_code == 409 and r.json()["error"]["details"]["cause"] == "mounted"
        assert http.get(url).json() == {**state, "offset": SIZE}
        sb.delete()
        done = http.patch(url, content=b"", headers={"Upload-Offset": str(SIZE)}).json()
        assert done["done"] and done["offset"] == SIZE
        sb = corral.Sandbox.create(memory_mb=64, volumes={"/data": "ckpts:ro"}, client=alice)
        got = sb.exec(["sha256sum", "/data/models/ckpt.bin"], timeout=30).stdout.split()[0]
        assert got == hashlib.sha256(blob).hexdigest()
        sb.delete()
        assert corral.Volume.get("ckpts", client=alice).info.files == 3  # README, models, its file
        # the SDK, in parts; then a symlink an rw writer could plant is not followed
        import corral.client._sync._files as files

        monkeypatch.setattr(files, "UPLOAD_PART", 1 << 20)
        (tmp_path / "b.bin").write_bytes(blob)
        seen: list[tuple[int, int]] = []
        vol.upload(tmp_path / "b.bin", "/more/b.bin",
                   progress=lambda n, total: seen.append((n, total)))
        assert seen == [(n << 20, SIZE) for n in range(1, 4)]
        assert (data / "more" / "b.bin").read_bytes() == blob
        os.symlink("/etc", data / "evil")
        with pytest.raises(InvalidArgument, match="not followed"):
            vol.upload(tmp_path / "src" / "README", "evil/corral-planted")
        assert not os.path.exists("/etc/corral-planted")
        for bad in ("../x", "a/../../x", "/", ".", "a/./b"):
            r = http.post(base, json={"path": bad, "size": 1})
            assert r.status_code == 400, (bad, r.text)
        vol.delete()
    team.cleanup()
    no_traceback(team)


def test_a_volume_upload_is_taken_back_by_the_next_daemon_at_its_offset(tmp_path):
    """A restarted daemon reads each upload's record again (tests/server/test_live_restore.py
    shows it end to end for a sandbox's): a volume's comes back as a volume's, at the
    bytes staged."""
    from corral.server.upload_routes import VOLUME_KEY, Uploads

    up = Uploads(tmp_path).add("alice", VOLUME_KEY + "ckpts", "m/c.bin", 100, 0o644, 1 << 62)
    up.part.write_bytes(b"x" * 42)
    again = Uploads(tmp_path).get("alice", VOLUME_KEY + "ckpts", up.id)
    assert (again.offset, again.volume, again.path, again.done) == (42, "ckpts", "m/c.bin", False)
    assert again.state()["volume"] == "ckpts" and "sandbox_id" not in again.state()
    with pytest.raises(UploadNotFound):  # another tenant's, or with another volume: unknown
        Uploads(tmp_path).get("bob", VOLUME_KEY + "ckpts", up.id)
    with pytest.raises(UploadNotFound):
        Uploads(tmp_path).get("alice", VOLUME_KEY + "other", up.id)
    # the next daemon keeps it while its volume is there (it is no sandbox's), not after
    reg = Uploads(tmp_path)
    reg.keep_only(set(), lambda u: u.volume == "ckpts")
    assert reg.get("alice", VOLUME_KEY + "ckpts", up.id).offset == 42
    reg.keep_only(set(), lambda u: False)
    with pytest.raises(UploadNotFound):
        reg.get("alice", VOLUME_KEY + "ckpts", up.id)
    assert not up.part.exists()


def test_volume_uploads_opened_at_once_cannot_pass_the_quota_together(team):
    """Each upload into an uncapped volume was weighed against the tenant's quota when
    opened, alone: four of 5 MiB opened at once, then sent, made a tenant of 8 MiB hold
    20 MiB. Now each is weighed again as it lands; past the quota it is refused typed."""
    import io
    import tarfile

    from corral.errors import QuotaExceeded

    team.make_token("dora", max_snapshot_mb=8)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("README")
        info.size = 3
        t.addfile(info, io.BytesIO(b"hi\n"))
    with team.tenant("dora") as http:
        assert http.post("/v1/volumes?name=v", content=buf.getvalue()).status_code == 201
        ids = []
        for i in range(4):
            r = http.post("/v1/volumes/v/uploads", json={"path": f"f{i}", "size": 5 << 20})
            assert r.status_code == 201, r.text  # each fits alone
            ids.append(r.json()["upload_id"])
        codes = []
        for uid in ids:
            r = http.patch(f"/v1/volumes/v/uploads/{uid}", content=os.urandom(5 << 20),
                           headers={"Upload-Offset": "0"})
            codes.append(r.status_code if r.status_code < 400 else r.json()["error"]["code"])
        assert codes == [200] + [QuotaExceeded.code] * 3, codes
        held = http.get("/v1/volumes").json()["volumes"][0]["size_bytes"]
        assert held <= 8 << 20, f"dora holds {held} bytes over her 8 MiB"
        for uid in ids[1:]:
            http.delete(f"/v1/volumes/v/uploads/{uid}")
        http.delete("/v1/volumes/v")
    no_traceback(team)
