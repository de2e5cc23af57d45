"""Images through the HTTP API of a real daemon: list, get, build (streamed), import, delete."""

from __future__ import annotations

import io
import json
import secrets
import tarfile

import pytest

from corral.runtime.images import ImageStore
from corral.runtime.paths import Layout
from tests.conftest import requires_root
from tests.runtime.oci_archives import base_layer, docker_save, second_layer
from tests.server.conftest import assert_error, uds_client

pytestmark = [requires_root, pytest.mark.timeout(300)]


@pytest.fixture
def image_name(client):
    made = f"t-api-{secrets.token_hex(4)}"
    yield made
    client.delete(f"/v1/images/{made}")


def build(client, body: bytes | dict, **headers) -> list[dict]:
    """POST a build; its NDJSON lines."""
    kw = {"json": body} if isinstance(body, dict) else {"content": body}
    with client.stream("POST", "/v1/images/build", headers=headers, timeout=300, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


def run(client, image: str, cmd: str) -> str:
    made = client.post("/v1/sandboxes", json={"image": image, "memory_mb": 128})
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    try:
        r = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
        assert r.json()["returncode"] == 0, r.json()
        return r.json()["stdout"]
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


def test_image_endpoints_are_in_openapi(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"get"} <= set(paths["/v1/images"])
    assert {"get", "delete"} <= set(paths["/v1/images/{name}"])
    build_op = paths["/v1/images/build"]["post"]
    assert build_op["responses"]["200"]["content"]["application/x-ndjson"]["schema"] == {
        "$ref": "#/components/schemas/BuildEvent"}
    assert "post" in paths["/v1/images/import"]


def test_list_and_get(client):
    images = {i["name"]: i for i in client.get("/v1/images").json()["images"]}
    assert images["python"]["kind"] == "debootstrap"
    assert images["rl"]["kind"] == "built" and images["rl"]["base"] == "python"
    assert client.get("/v1/images/rl").json() == images["rl"]
    assert_error(client.get("/v1/images/no-such-image"), 404, "image_not_found")
    assert_error(client.get("/v1/images/Bad%20Name"), 400, "invalid_argument")


def test_build_streams_its_log_then_the_image_and_a_rebuild_is_cached(client, image_name):
    token = secrets.token_hex(6)
    spec = {"base": "python", "steps": [
        {"run": f"echo building-{token}; echo {token} > /workspace/t"},
        {"env": {"TOKEN": token}}, {"workdir": "/workspace"}]}
    lines = build(client, {"spec": spec, "name": image_name})
    assert [x["type"] for x in lines] == ["step", "log", "step", "step", "image"]
    assert lines[0] == {"type": "step", "step": 1, "total": 3, "cached": False,
                        "instruction": f"run: echo building-{token}; echo {token} > /workspace/t"}
    assert lines[1]["line"] == f"building-{token}"
    done = lines[-1]
    assert done["image"]["name"] == image_name and done["image"]["env"] == {"TOKEN": token}
    assert done["stats"]["built"] == 1 and done["stats"]["cached"] == 0
    assert client.get(f"/v1/images/{image_name}").json() == done["image"]
    assert run(client, image_name, "cat t; echo $TOKEN") == f"{token}\n{token}\n"

    again = build(client, {"spec": spec, "name": image_name})
    assert [x["type"] for x in again] == ["step", "step", "step", "image"]
    assert again[0]["cached"] is True
    assert (again[-1]["stats"]["built"], again[-1]["stats"]["cached"]) == (0, 1)

    assert client.delete(f"/v1/images/{image_name}").status_code == 204
    assert_error(client.get(f"/v1/images/{image_name}"), 404, "image_not_found")
    assert client.delete(f"/v1/images/{image_name}").status_code == 204  # idempotent


def context_tar(request: dict, files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("build.json", json.dumps(request).encode()), *files.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_build_with_a_context_copies_its_files(client, image_name):
    token = secrets.token_hex(6)
    request = {"name": image_name, "spec": {"steps": [{"copy": "app -> /app"},
                                                      {"workdir": "/app"}]}}
    body = context_tar(request, {"context/app/main.py": f"print('{token}')\n".encode()})
    lines = build(client, body, **{"Content-Type": "application/x-tar"})
    assert lines[-1]["type"] == "image", lines
    assert run(client, image_name, "python3 main.py") == f"{token}\n"

    for src in ("../outside", "/etc/hostname"):  # never the daemon's own files
        bad = {"name": image_name, "spec": {"steps": [{"copy": f"{src} -> /app/"}]}}
        reply = client.post("/v1/images/build", content=context_tar(bad, {}),
                            headers={"Content-Type": "application/x-tar"})
        assert_error(reply, 400, "invalid_argument")
    evil = context_tar(request, {"context/../../escape": b"x"})
    reply = client.post("/v1/images/build", content=evil,
                        headers={"Content-Type": "application/x-tar"})
    assert_error(reply, 400, "image_import_failed")


def test_a_failing_step_is_the_streams_last_line(client, image_name):
    token = secrets.token_hex(6)
    spec = {"steps": [{"run": f"echo oops-{token} >&2; exit 7"}]}
    lines = build(client, {"spec": spec, "name": image_name})
    assert lines[-1]["type"] == "error"
    error = lines[-1]["error"]
    assert error["code"] == "image_build_failed" and error["details"]["step"] == 1
    assert error["details"]["returncode"] == 7 and f"oops-{token}" in error["details"]["output"]
    assert_error(client.get(f"/v1/images/{image_name}"), 404, "image_not_found")


def test_bad_build_requests_are_plain_errors(client, image_name):
    reply = client.post("/v1/images/build", json={"spec": {"base": "nope", "steps": [
        {"run": "true"}]}, "name": image_name})
    assert_error(reply, 404, "image_not_found")
    reply = client.post("/v1/images/build", json={"spec": {"steps": []}, "name": image_name})
    assert_error(reply, 400, "invalid_argument")
    reply = client.post("/v1/images/build", json={"spec": {"steps": [{"run": "true"}]}})
    assert_error(reply, 400, "invalid_argument")  # no name
    assert_error(client.post("/v1/images/build", json={"nope": 1}), 400, "invalid_argument")


def test_delete_is_refused_while_sandboxes_or_snapshots_use_the_image(client, image_name):
    spec = {"steps": [{"run": f"echo {secrets.token_hex(4)} > /workspace/x"}]}
    assert build(client, {"spec": spec, "name": image_name})[-1]["type"] == "image"
    sid = client.post("/v1/sandboxes", json={"image": image_name, "memory_mb": 64}).json()["id"]
    try:
        error = assert_error(client.delete(f"/v1/images/{image_name}"), 409, "image_in_use")
        assert error["details"]["sandboxes"] == [sid]
        snap = client.post(f"/v1/sandboxes/{sid}/snapshot", json={}).json()["id"]
    finally:
        client.delete(f"/v1/sandboxes/{sid}")
    error = assert_error(client.delete(f"/v1/images/{image_name}"), 409, "image_in_use")
    assert error["details"]["snapshots"] == [snap]
    client.delete(f"/v1/snapshots/{snap}")
    assert client.delete(f"/v1/images/{image_name}").status_code == 204


def test_import_an_archive(client, image_name):
    rootfs = ImageStore(Layout.create().images_dir).get("python").rootfs
    archive = docker_save([base_layer(rootfs).bytes(), second_layer().bytes()])
    reply = client.post("/v1/images/import", params={"name": image_name}, content=archive)
    assert reply.status_code == 201, reply.text
    info = reply.json()
    assert info["kind"] == "oci" and info["workdir"] == "/srv/data"
    assert run(client, image_name, "echo $GREETING; cat /etc/os-release") == (
        "hello from oci\nID=corral-test\nVERSION=2\n")
    assert_error(client.post("/v1/images/import", content=archive), 400, "invalid_argument")
    reply = client.post("/v1/images/import", params={"name": image_name}, content=b"junk" * 300)
    assert_error(reply, 400, "image_import_failed")


def test_builds_survive_a_daemon_restart(make_daemon):
    daemon = make_daemon()
    name = f"t-restart-{secrets.token_hex(4)}"
    spec = {"steps": [{"run": f"echo {secrets.token_hex(6)} > /workspace/r"}]}
    with uds_client(daemon.socket) as c:
        assert build(c, {"spec": spec, "name": name})[-1]["stats"]["built"] == 1
    daemon.stop()
    daemon.start()
    with uds_client(daemon.socket) as c:
        assert c.get(f"/v1/images/{name}").status_code == 200
        done = build(c, {"spec": spec, "name": name})[-1]
        assert (done["stats"]["built"], done["stats"]["cached"]) == (0, 1)
        assert c.delete(f"/v1/images/{name}").status_code == 204
