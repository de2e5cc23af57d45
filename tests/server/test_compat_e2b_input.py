"""What the E2B front-end does with bad input: a typed error in the SDK's shapes (the
control API's ``{"code": status, "message"}``, envd's Connect ``{"code": name}``), never
a crash, and nothing left behind (a refused create makes no sandbox).
"""

from __future__ import annotations

import struct

import httpx
import pytest

from tests.server.test_compat_e2b import TOKEN, checked, serving

pytest.importorskip("e2b", reason="the compat extra (e2b) is not installed")


@pytest.fixture(scope="module")
def e2b():
    with serving() as d:
        yield d


@pytest.fixture
def api(e2b):
    with checked(e2b), httpx.Client(base_url=e2b.endpoint, headers={"X-API-KEY": TOKEN},
                                    timeout=60) as c:
        yield c


CREATES = [
    {"templateID": 5},
    {"templateID": ""},
    {"templateID": "x" * 5000},
    {"templateID": "base", "timeout": "600"},
    {"templateID": "base", "timeout": True},
    {"templateID": "base", "timeout": 10**30},
    {"templateID": "base", "timeout": -1},
    {"templateID": "base", "metadata": {"k": 1}},
    {"templateID": "base", "metadata": {"k" * 200: "v"}},
    {"templateID": "base", "envVars": {"A=B": "x"}},
    {"templateID": "base", "envVars": ["A"]},
    {"templateID": "base", "mcp": {"x": {}}},
    {"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]},
    {"templateID": "base", "network": {"denyOut": ["0.0.0.0/33"]}},
    {"templateID": "base", "network": {"allowOut": "example.com"}},
    {"templateID": "base", "network": {"rules": {"example.com": {}}}},
    {"templateID": "base", "autoPause": True, "allow_internet_access": True},
    {"templateID": "base", "autoPause": True, "autoPauseMemory": False},
    {"templateID": "base", "autoPause": True, "autoResume": {"enabled": False}},
    {"templateID": "base", "autoPause": "yes"},
    {"templateID": "../../etc"},
    [],
    "text",
]


@pytest.mark.parametrize("body", CREATES, ids=range(len(CREATES)))
def test_bad_creates_are_refused(api, body):
    r = api.post("/v2/sandboxes", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert isinstance(r.json()["code"], int) and r.json()["message"]


def test_bad_bodies_and_queries(api):
    assert api.post("/v2/sandboxes", content=b"{not json").status_code == 400
    many = "&".join(f"k{i}=v" for i in range(100))
    for params in ({"limit": "0"}, {"limit": "x"}, {"nextToken": "-1"}, {"state": "dead"},
                   {"metadata": "%ff%fe=%00"}, {"limit": "9" * 5000},
                   {"nextToken": "9" * 5000}, {"metadata": many}):
        r = api.get("/v2/sandboxes", params=params)
        assert r.status_code in (200, 400), (params, r.text)
    for path in ("/sandboxes/nope", "/sandboxes/nope/timeout", "/v2/sandboxes/nope/connect",
                 "/sandboxes/nope/pause", "/sandboxes/nope/fork", "/sandboxes/nope/snapshots"):
        r = api.post(path, json={"timeout": 10}) if "sandboxes/nope/" in path else api.get(path)
        assert r.status_code == 404, (path, r.text)
    assert api.delete("/templates/base").status_code == 501  # a template, not a snapshot
    assert api.get("/templates").status_code == 501


def envelope(raw: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(raw)) + raw


def test_bad_envd_calls(api, e2b):
    made = api.post("/v2/sandboxes", json={"templateID": "base"}).json()
    headers = {"E2b-Sandbox-Id": made["sandboxID"], "X-Access-Token": made["envdAccessToken"]}
    try:
        with httpx.Client(base_url=e2b.endpoint, headers=headers, timeout=60) as envd:
            stream = {"Content-Type": "application/connect+json"}
            for body in (b"", b"\x00\x00", envelope(b"{}", 1), envelope(b"[]"),
                         envelope(b"{bad"), envelope(b'{"process": 5}'),
                         envelope(b'{"process": {"cmd": 5}}'),
                         envelope(b'{"process": {"cmd": "/bin/sh", "envs": {"A=B": "x"}}}'),
                         envelope(b'{"process": {"cmd": "/bin/sh", "args": [1]}}'),
                         envelope(b'{"process": {"cmd": "/bin/sh", "cwd": "/no/such"}}'),
                         envelope(b'{"process": {"cmd": "/bin/sh"}, "pty": {"size": {"rows": -1}}}'),
                         envelope(b'{"process": {"pid": [1]}}'), b"\x00\xff\xff\xff\xff",
                         envelope(b'{"process": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")):
                for method in ("Start", "Connect"):
                    r = envd.post(f"/process.Process/{method}", content=body, headers=stream)
                    assert r.status_code < 500, (method, body, r.text)
                    assert b'"error"' in r.content or r.status_code >= 400, (method, body)
            r = envd.post("/process.Process/Start", headers={**stream, "Connect-Timeout-Ms": "9" * 5000},
                          content=envelope(b'{"process": {"cmd": "/bin/true"}}'))
            assert r.status_code == 200, r.text  # a deadline it cannot read is none
            unary = {"Content-Type": "application/json"}
            for method in ("List", "SendInput", "SendSignal", "CloseStdin", "Update",
                           "StreamInput"):
                for body in (b"{bad", b"[]", b'{"process": {"pid": "1"}}',
                             b'{"process": {"pid": 1}, "signal": ["x"]}',
                             b'{"process": {"pid": 1}, "input": {"stdin": "%%%"}}'):
                    r = envd.post(f"/process.Process/{method}", content=body, headers=unary)
                    assert 400 <= r.status_code < 500 or r.status_code == 501 or (
                        method == "List" and r.status_code == 200), (method, body, r.text)
                    assert r.status_code == 200 or isinstance(r.json()["code"], str)
            bad_fs = (b"{bad", b'{"path": 5}', b'{"path": ""}', b'{"path": "a\\u0000"}',
                      b'{"source": "/nope"}')
            watch = (b'{"path": "/tmp", "recursive": "yes"}', b'{"path": "/nope"}',
                     b'{"watcherId": 5}', b'{"watcherId": "unknown"}')
            for method in ("Stat", "ListDir", "MakeDir", "Move", "Remove", "CreateWatcher",
                           "GetWatcherEvents", "RemoveWatcher"):
                for body in bad_fs + (watch if "Watcher" in method else ()):
                    r = envd.post(f"/filesystem.Filesystem/{method}", content=body,
                                  headers=unary)
                    assert 400 <= r.status_code < 600 and r.status_code != 500, (method, body)
            for body in bad_fs + watch[:2]:  # a server stream: its error ends the stream (Connect)
                r = envd.post("/filesystem.Filesystem/WatchDir", content=envelope(body),
                              headers=stream)
                assert r.status_code == 200 and b'"error"' in r.content, (body, r.content)
            r = envd.post("/filesystem.Filesystem/ListDir", headers=unary,
                          content=b'{"path": "/tmp", "depth": "2"}')
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
            assert envd.get("/files").status_code == 400
            assert envd.get("/files", params={"path": "/etc"}).status_code in (400, 404, 409)
            r = envd.post("/files", params={"path": "/tmp/x"}, content=b"--b\r\nbad",
                          headers={"Content-Type": "multipart/form-data; boundary=b"})
            assert 400 <= r.status_code < 500, r.text
            assert envd.get("/nope").status_code == 501
    finally:
        assert api.delete(f"/sandboxes/{made['sandboxID']}").status_code == 204
