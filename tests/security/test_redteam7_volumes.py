"""Red-team of volumes and live snapshots that travel (issues 27 and 29), through a real
daemon over TCP: a hostile tenant with a valid key.

- volume creates sent at once, each within the tenant's quota alone, cannot together
  hold more than the quota (each was weighed before the others were published);
- a name with a final newline is refused (``re.match`` with ``$``);
- an upload whose path is 1200 directories deep: the directories count against the
  quota, and the volume can still be snapshotted and removed, leaving nothing behind
  (os.walk and shutil.rmtree recursed past Python's limit: a 500, a half-made copy and
  a removed volume whose files stayed on disk);
- an archive whose tree 1050 directories deep is replaced by a file is made (or refused
  typed), not a 500 (the extractor's shutil.rmtree recursed past Python's limit).
"""

from __future__ import annotations

import io
import tarfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from corral.errors import QuotaExceeded
from tests.security.tenants_helpers import no_traceback, team_daemon


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _dirs_tar(dirs: list[str], then_file: str | None = None) -> bytes:
    """A tar (PAX: long names) of the directories ``dirs``, then a file ``then_file``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name in dirs:
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            t.addfile(info)
        if then_file is not None:
            info = tarfile.TarInfo(then_file)
            info.size = 2
            t.addfile(info, io.BytesIO(b"x\n"))
    return buf.getvalue()


def test_volume_creates_sent_at_once_cannot_pass_the_quota_together(team):
    """erin may hold 20 MiB; a capped volume of 12 MiB fits alone. Six created at once
    were each weighed before any other was published (a capped one's image is made
    between the check and its publication): now at most one lands, the rest are
    refused typed, and what she holds stays within her quota."""
    team.make_token("erin", max_snapshot_mb=20)
    body = _tar({"README": b"hi\n"})

    def create(i: int) -> int | str:
        with team.tenant("erin") as http:
            r = http.post(f"/v1/volumes?name=v{i}&max_mb=12", content=body)
        return r.status_code if r.status_code < 400 else r.json()["error"]["code"]

    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(create, range(6)))
    assert sorted(codes, key=str) == sorted([201] + [QuotaExceeded.code] * 5, key=str), codes
    with team.tenant("erin") as http:
        vols = http.get("/v1/volumes").json()["volumes"]
        held = sum(max(v["size_bytes"], (v["max_mb"] or 0) << 20) for v in vols)
        assert held <= 20 << 20, f"erin holds {held} bytes over her 20 MiB: {vols}"
        for v in vols:
            assert http.delete(f"/v1/volumes/{v['name']}").status_code == 204
    no_traceback(team)


@pytest.mark.parametrize("name", ["data%0A", "a.b%0A"])
def test_a_name_with_a_trailing_newline_is_refused_typed(team, name):
    """``^...$`` with ``re.match`` lets ``$`` match before a final newline: ``data\\n``
    was a volume of its own (a directory named so in the state dir, a name that looks
    like another in every listing), and a mount spec of it passed. Now refused typed,
    for a create, a mount, an upload and a network alike."""
    with team.tenant("bob") as http:
        reply = http.post(f"/v1/volumes?name={name}", content=_tar({"x": b"1"}))
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_argument"
        reply = http.post("/v1/sandboxes", json={"volumes": {"/data": "data\n"}})
        assert reply.status_code in (400, 422), reply.text
        reply = http.post("/v1/networks", json={"name": "net\n"})
        assert reply.status_code in (400, 422), reply.text
        assert http.get("/v1/volumes").json()["volumes"] == []


def test_an_upload_1200_directories_deep_is_counted_and_goes_whole(team):
    team.make_token("fay", max_snapshot_mb=64)
    with team.tenant("fay") as http:
        assert http.post("/v1/volumes?name=deep", content=_tar({"x": b"1"})).status_code == 201
        before = http.get("/v1/volumes/deep").json()["size_bytes"]
        r = http.post("/v1/volumes/deep/uploads", json={"path": "a/" * 1200 + "f", "size": 0})
        assert r.status_code == 201, r.text
        r = http.patch(f"/v1/volumes/deep/uploads/{r.json()['upload_id']}", content=b"",
                       headers={"Upload-Offset": "0"})
        assert r.status_code == 200, r.text
        after = http.get("/v1/volumes/deep").json()
        assert after["files"] >= 1200
        assert after["size_bytes"] - before >= 1200 * 512, after  # the directories count
        r = http.post("/v1/volumes/deep/snapshot", json={"name": "deep2"})
        assert r.status_code == 201, r.text
        assert r.json()["files"] == after["files"]
        for name in ("deep", "deep2"):
            r = http.delete(f"/v1/volumes/{name}")
            assert r.status_code == 204, r.text
        assert http.get("/v1/volumes").json()["volumes"] == []
    left = list((team.daemon.base / "state" / "volumes" / "fay").iterdir())
    assert left == [], left
    no_traceback(team)


def test_an_archive_replacing_a_deep_tree_by_a_file_is_no_traceback(team):
    body = _dirs_tar(["/".join(["d"] * depth) for depth in range(1, 1051)], then_file="d")
    with team.tenant("bob") as http:
        r = http.post("/v1/volumes?name=replaced", content=body)
        assert r.status_code == 201, r.text
        assert r.json()["files"] == 1
        assert http.delete("/v1/volumes/replaced").status_code == 204
    no_traceback(team)


def test_a_stopped_sandboxs_deep_tree_is_kept_and_counted_without_a_traceback(team):
    """Code in a sandbox makes /workspace 1100 directories deep and the sandbox stops:
    its writable layer is kept for reading (kept_files.py), weighed by an os.walk that
    recursed past Python's limit (a traceback on the stop path, the staged copy left on
    the disk, counted against no quota). Now it is kept and counted."""
    with team.tenant("bob") as http:
        sid = http.post("/v1/sandboxes", json={"memory_mb": 64}).json()["id"]
        made = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": [
            "python3", "-c", "import os\nos.chdir('/workspace')\nfor _ in range(1100):\n"
            "    os.mkdir('d'); os.chdir('d')\nopen('/workspace/top', 'w').write('kept')"]})
        assert made.status_code == 200 and made.json()["returncode"] == 0, made.text
        assert http.post(f"/v1/sandboxes/{sid}/stop", json={}).status_code == 200
        r = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/top"})
        assert r.status_code == 200 and r.content == b"kept", r.text
        assert http.delete(f"/v1/sandboxes/{sid}").status_code in (200, 204)
    no_traceback(team)


PEER_ROUTES = (
    ("GET", "/v1/peer/volumes/data?owner=alice"),
    ("GET", "/v1/peer/volumes/..%2F..%2Fsecrets?owner=alice"),
    ("GET", "/v1/peer/checkpoints/snap-000000000000?owner=alice"),
    ("GET", "/v1/peer/checkpoints/..%2F..%2Fkdat?owner=alice"),
    ("GET", "/v1/peer/layers/sha256:" + "0" * 64),
    ("GET", "/v1/peer/snapshots/anything?owner=alice"),
)


@pytest.mark.parametrize(("method", "url"), PEER_ROUTES)
def test_peer_routes_answer_no_stranger_and_no_tenant(team, method, url):
    """A TCP client without a key gets 401 and a tenant 403 on every peer route, with
    any owner, name, id or digest (forged ones included): neither reaches a lookup, so
    neither learns what exists (a name with an encoded '/' matches no route). The
    admin's forged names and ids are refused typed."""
    import httpx

    with httpx.Client(base_url=team.url, timeout=30) as stranger:
        assert stranger.request(method, url).status_code == 401
    with team.tenant("bob") as http:
        r = http.request(method, url)
        code = r.json()["error"]["code"]  # a name with a '/' matches no route at all
        assert (r.status_code, code) == (403, "forbidden") or "no route" in r.text, r.text
    with team.admin() as admin:
        r = admin.request(method, url)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["code"] != "internal"


def test_an_e2b_fork_count_past_the_tenants_max_sandboxes_makes_only_what_fits(team):
    """gail may run 3 sandboxes; her checkpointable one asks E2B's fork for 5 copies
    (within E2B's 20): at most 2 are made, the others answer each with a typed error,
    and nothing past her quota runs afterwards."""
    from corral.runtime import criu
    from corral.runtime.paths import default_cache_dir

    if criu.find(default_cache_dir()) is None:
        pytest.skip(f"no cached CRIU: {criu.BUILD}")
    import httpx

    team.make_token("gail", max_sandboxes=3)
    key = {"X-API-Key": team.tokens["gail"]}
    with httpx.Client(base_url=team.url, timeout=120, headers=key) as e2b:
        made = e2b.post("/sandboxes", json={"templateID": "base", "timeout": 120,
                                            "metadata": {"corral.checkpointable": "true"}})
        assert made.status_code == 201, made.text
        sid = made.json()["sandboxID"]
        r = e2b.post(f"/sandboxes/{sid}/fork", json={"count": 5, "timeout": 60})
        assert r.status_code == 201, r.text
        copies = r.json()
    ok = [c for c in copies if "sandbox" in c]
    refused = [c["error"] for c in copies if "error" in c]
    assert len(copies) == 5 and len(ok) <= 2, copies
    assert all(e["code"] in (403, 409, 429) for e in refused), refused
    with team.tenant("gail") as http:
        running = [s for s in http.get("/v1/sandboxes").json()["sandboxes"]
                   if s["state"] == "running"]
        assert len(running) <= 3, running
        for s in http.get("/v1/sandboxes").json()["sandboxes"]:
            http.delete(f"/v1/sandboxes/{s['id']}")
    no_traceback(team)


def test_an_archive_path_longer_than_the_host_names_is_refused_typed(team):
    with team.tenant("bob") as http:
        r = http.post("/v1/volumes?name=toolong", content=_dirs_tar(["/".join(["d"] * 2100)]))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "image_import_failed", r.text
        assert http.get("/v1/volumes").json()["volumes"] == []
    assert not any((team.daemon.base / "state" / "volumes" / "bob").iterdir())
    no_traceback(team)


def test_a_capped_volume_with_a_path_mke2fs_cannot_take_is_refused_typed(team):
    # 2310 bytes (mke2fs 1.47 crashed on 2040 of "d/d/...")
    body = _dirs_tar(["/".join(["dddddddddd"] * depth) for depth in range(1, 211)])
    with team.tenant("bob") as http:
        r = http.post("/v1/volumes?name=mkfs&max_mb=8", content=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_argument", r.text
        assert r.json()["error"]["details"]["path_bytes"] == 210 * 11 - 1
        r = http.post("/v1/volumes?name=mkfs", content=body)  # uncapped: no mkfs
        assert r.status_code == 201, r.text
        assert http.delete("/v1/volumes/mkfs").status_code == 204
    assert not any((team.daemon.base / "state" / "volumes" / "bob").iterdir())
    no_traceback(team)
