"""SandboxFusion's own client (``sandbox-fusion``), and verl's request, against a real
corral daemon.

Each client test runs a plain SandboxFusion script (no corral import) in a subprocess
whose only configuration is ``SANDBOX_FUSION_ENDPOINT``, exactly what a user sets; it
prints a JSON summary that the test checks. Every test also checks that the daemon
logged no traceback and that no sandbox is left but the warm pools' idle ones.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from corral.pool_schema import pool_tag
from tests.conftest import ROOT_REASON, Daemon, _base_dir, have_root_runtime
from tests.server.conftest import free_port, uds_client

pytest.importorskip("sandbox_fusion", reason="the compat extra (sandbox-fusion) is not installed")

TOKEN = "sf-test-token-0123456789"
PRELUDE = """
import json, os, sys
from sandbox_fusion import (
    RunCodeRequest, RunJupyterRequest, RunStatus, run_code, run_jupyter,
)
out = {}
def code(**kw):
    # the default 10 s limits are not what these tests check (those that do pass their
    # own): a C++ compile can take longer than that on a loaded host
    kw.setdefault("compile_timeout", 120)
    kw.setdefault("run_timeout", 120)
    r = run_code(RunCodeRequest(**kw), max_attempts=1)
    return r.dict()
"""


class FusionDaemon(Daemon):
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/sandboxfusion/{TOKEN}"


@contextlib.contextmanager
def serving(*args: str) -> Iterator[FusionDaemon]:
    """A daemon for a module's tests (they are skipped without root), removed after."""
    if not have_root_runtime():
        pytest.skip(ROOT_REASON)
    port = free_port()
    d = FusionDaemon(_base_dir(), ["--tcp", f"127.0.0.1:{port}", "--token", TOKEN, *args])
    d.port = port
    d.start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


POOL_TAG_PREFIX = pool_tag("")  # a pool's sandboxes carry pool_tag(its name)


def leftovers(d: Daemon) -> set[str]:
    """Sandboxes no pool keeps (a pool's ready or still-starting ones carry its tag),
    and the pools' handed-out ones: what requests left behind."""
    with uds_client(d.socket) as c:
        ids = {s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]
               if not any(t.startswith(POOL_TAG_PREFIX) for t in s["spec"]["tags"])}
        for pool in c.get("/v1/pools").json()["pools"]:
            ids |= set(c.get(f"/v1/pools/{pool['name']}").json()["acquired_ids"])
    return ids


@contextlib.contextmanager
def checked(d: FusionDaemon) -> Iterator[FusionDaemon]:
    """``d`` for one test; afterwards its log holds no traceback and nothing is left."""
    logged = d.log.stat().st_size
    yield d
    with open(d.log, "rb") as log:
        log.seek(logged)
        assert b"Traceback" not in log.read(), f"the daemon logged an error: {d.log}"
    assert leftovers(d) == set(), "a request left a sandbox behind"


@pytest.fixture(scope="module")
def sf_daemon():
    with serving("--log-level", "debug") as d:
        yield d


@pytest.fixture
def daemon_ok(sf_daemon):
    with checked(sf_daemon) as d:
        yield d


def run_script(d: FusionDaemon, body: str, *, endpoint: str | None = None) -> dict:
    """Run a SandboxFusion script with only ``SANDBOX_FUSION_ENDPOINT`` set for ``d``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_FUSION")}
    env["SANDBOX_FUSION_ENDPOINT"] = endpoint or d.endpoint
    script = Path(d.base) / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_python_with_stdin_and_bash(daemon_ok):
    out = run_script(daemon_ok, """
        out["py"] = code(language="python", stdin="21\\n",
                         code="import sys\\nn = int(sys.stdin.read())\\nprint(n * 2)")
        out["bash"] = code(language="bash", code="echo hi; echo err >&2; whoami")
        out["perl"] = code(language="perl", stdin="4", code="my $n = <STDIN>; print $n ** 2")
    """)
    py, bash = out["py"], out["bash"]
    assert py["status"] == "Success" and py["message"] == "", py
    assert py["compile_result"] is None
    run = py["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == (
        "Finished", 0, "42\n", "")
    assert run["execution_time"] > 0
    assert bash["status"] == "Success", bash
    assert bash["run_result"]["stdout"] == "hi\nsandbox\n"
    assert bash["run_result"]["stderr"] == "err\n"
    assert out["perl"]["run_result"]["stdout"] == "16", out["perl"]


def test_timeout_and_nonzero_exit(daemon_ok):
    # run_timeout 5 s: 'started' is printed within it on a loaded host (1 s was tight)
    out = run_script(daemon_ok, """
        out["slow"] = code(language="python", run_timeout=5,
                           code="import time\\nprint('started', flush=True)\\ntime.sleep(600)")
        out["exit"] = code(language="python", code="import sys\\nprint('x')\\nsys.exit(3)")
        out["raise"] = code(language="python", code="raise ValueError('boom')")
    """)
    slow = out["slow"]
    assert slow["status"] == "Failed", slow
    assert slow["run_result"]["status"] == "TimeLimitExceeded"
    assert slow["run_result"]["return_code"] is None
    assert slow["run_result"]["stdout"] == "started\n"
    ex = out["exit"]
    assert ex["status"] == "Failed" and ex["run_result"]["status"] == "Finished"
    assert (ex["run_result"]["return_code"], ex["run_result"]["stdout"]) == (3, "x\n")
    assert out["raise"]["run_result"]["return_code"] == 1
    assert "ValueError: boom" in out["raise"]["run_result"]["stderr"]


def test_files_in_and_fetch_files_out(daemon_ok):
    files = {"data/in.txt": b64(b"abc"), "bin.dat": b64(bytes(range(256))), "skip.txt": None}
    out = run_script(daemon_ok, f"""
        out["r"] = code(language="python", files={files!r},
            fetch_files=["out.txt", "bin.dat", "missing.txt", "data"],
            code="data = open('data/in.txt').read()\\n"
                 "open('out.txt', 'w').write(data.upper())\\n"
                 "import os\\nprint(os.path.exists('skip.txt'), len(open('bin.dat','rb').read()))")
    """)
    r = out["r"]
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "False 256\n"
    assert set(r["files"]) == {"out.txt", "bin.dat"}
    assert base64.b64decode(r["files"]["out.txt"]) == b"ABC"
    assert base64.b64decode(r["files"]["bin.dat"]) == bytes(range(256))


CPP = """
#include <bits/stdc++.h>
int main() { long a, b; std::cin >> a >> b; std::cout << a * b << std::endl; }
"""


def test_cpp_and_nodejs_from_the_fusion_image(daemon_ok):
    """``make test`` builds the ``fusion`` image (scripts/install.sh runs prepare)."""
    out = run_script(daemon_ok, f"""
        out["cpp"] = code(language="cpp", stdin="5 7\\n", code={CPP!r})
        out["bad_cpp"] = code(language="cpp", code="int main() {{ return undeclared; }}")
        out["cpp_exit"] = code(language="cpp", code="int main() {{ return 4; }}")
        out["node"] = code(language="nodejs", stdin="hello",
                           code="const s = require('fs').readFileSync(0, 'utf8');"
                                "console.log(s.toUpperCase(), process.version.startsWith('v'))")
        out["node_err"] = code(language="nodejs", code="throw new Error('nope')")
        out["pytest"] = code(language="pytest",
                             code="def test_ok():\\n    assert 1 + 1 == 2\\n"
                                  "def test_bad():\\n    assert 1 + 1 == 3\\n")
    """)
    cpp = out["cpp"]
    assert cpp["status"] == "Success", cpp
    assert (cpp["compile_result"]["status"], cpp["compile_result"]["return_code"]) == (
        "Finished", 0)
    assert cpp["run_result"]["stdout"] == "35\n"
    bad = out["bad_cpp"]
    assert bad["status"] == "Failed" and bad["run_result"] is None, bad
    assert bad["compile_result"]["return_code"] != 0
    assert "undeclared" in bad["compile_result"]["stderr"]
    assert out["cpp_exit"]["status"] == "Failed"
    assert out["cpp_exit"]["run_result"]["return_code"] == 4
    node = out["node"]
    assert node["status"] == "Success", node
    assert node["run_result"]["stdout"] == "HELLO true\n"
    assert out["node_err"]["run_result"]["return_code"] == 1
    assert "Error: nope" in out["node_err"]["run_result"]["stderr"]
    pt = out["pytest"]
    assert pt["status"] == "Failed" and pt["run_result"]["return_code"] == 1, pt
    assert "1 failed, 1 passed" in pt["run_result"]["stdout"]


def test_run_jupyter_cells(daemon_ok):
    out = run_script(daemon_ok, """
        r = run_jupyter(RunJupyterRequest(cells=[
            "a = 123", "a", "print(a)", "import sys; sys.stderr.write('stderr message')",
            "raise RuntimeError('error message')", "a + 1",
        ]), max_attempts=1)
        out["r"] = r.dict()
    """)
    r = out["r"]
    assert r["status"] == "Success", r
    cells = r["cells"]
    assert len(cells) == 6
    assert cells[0] == {"stdout": "", "stderr": "", "display": [], "error": []}
    assert cells[1]["display"] == [{"text/plain": "123"}]
    assert cells[2]["stdout"] == "123\n"
    assert cells[3]["stderr"] == "stderr message"
    assert cells[4]["error"][0]["ename"] == "RuntimeError"
    assert cells[4]["error"][0]["evalue"] == "error message"
    assert cells[5]["display"] == [{"text/plain": "124"}]  # cells after an error still run


def test_run_jupyter_timeouts_and_files(daemon_ok):
    # cell_timeout 5 s: the other cells must finish within it on a loaded host (1 s
    # was tight); the sleep never ends within it
    out = run_script(daemon_ok, """
        import base64
        r = run_jupyter(RunJupyterRequest(
            cells=["import time", "time.sleep(600)", "open('out.txt', 'w').write(open('in.txt').read() * 2)"],
            cell_timeout=5, files={"in.txt": base64.b64encode(b"ab").decode()},
            fetch_files=["out.txt"]), max_attempts=1)
        out["cells"] = r.dict()
        r = run_jupyter(RunJupyterRequest(cells=["import time; time.sleep(30)"], total_timeout=1),
                        max_attempts=1)
        out["total"] = r.dict()
    """)
    cells = out["cells"]
    assert cells["status"] == "Success", cells
    assert cells["cells"][1]["error"][0]["ename"] == "CellTimeout"
    assert cells["cells"][2]["display"] == [{"text/plain": "4"}]
    assert base64.b64decode(cells["files"]["out.txt"]) == b"abab"
    total = out["total"]
    assert total["status"] == "Failed" and total["cells"] == [], total
    assert total["driver"]["status"] == "TimeLimitExceeded"


def verl_request(d: FusionDaemon, **over) -> httpx.Response:
    """What verl's ``call_sandbox_api`` posts (raw JSON to ``sandbox_fusion_url``)."""
    payload = {
        "compile_timeout": 10, "run_timeout": 10, "code": "print(input()[::-1])",
        "stdin": "abc", "memory_limit_MB": 1024, "language": "python", "files": {},
        "fetch_files": [], **over,
    }
    return httpx.post(f"{d.endpoint}/run_code", content=json.dumps(payload),
                      headers={"Content-Type": "application/json",
                               "Accept": "application/json"}, timeout=60)


def test_verl_request_shape(daemon_ok):
    r = verl_request(daemon_ok)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"status", "message", "compile_result", "run_result",
                         "executor_pod_name", "files"}
    assert body["status"] == "Success"
    assert body["run_result"]["stdout"] == "cba\n"
    assert set(body["run_result"]) == {"status", "execution_time", "return_code", "stdout",
                                       "stderr"}
    # memory_limit_MB is the sandbox's memory: going over it is an OOM kill
    r = verl_request(daemon_ok, memory_limit_MB=64, stdin=None,
                     code="x = bytearray(512 << 20)\nprint('survived')")
    assert r.json()["status"] == "Failed", r.text
    assert r.json()["run_result"]["stdout"] == ""
    # a memory size no pool keeps: a sandbox made for the request alone
    r = verl_request(daemon_ok, memory_limit_MB=5000)
    assert r.json()["run_result"]["stdout"] == "cba\n", r.text
    # a big test input (over what goes inline with the command) arrives whole
    big = "".join(f"{i}\n" for i in range(300_000))
    r = verl_request(daemon_ok, stdin=big,
                     code="import sys\nlines = sys.stdin.read().split()\n"
                          "print(len(lines), sum(map(int, lines)))")
    assert r.json()["run_result"]["stdout"] == f"300000 {sum(range(300_000))}\n", r.text
    # verl sends stdin None when a case has no input
    r = verl_request(daemon_ok, stdin=None, code="print('no input')")
    assert r.json()["run_result"]["stdout"] == "no input\n"


def test_bad_input_is_answered_in_its_own_shape(daemon_ok):
    url = f"{daemon_ok.endpoint}/run_code"
    r = httpx.post(url, content=b"{not json", timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
    r = httpx.post(url, json={"code": "print(1)", "language": "cobol"}, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "language"]
    r = httpx.post(url, json={"language": "python"}, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "code"]
    r = httpx.post(url, json={"code": "1", "language": "python", "run_timeout": -1}, timeout=30)
    assert r.status_code == 422
    r = httpx.post(url, json={"code": "1", "language": "python", "files": {"a": "!!"}},
                   timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "SandboxError"
    assert "base64" in r.json()["message"]
    # a SandboxFusion language no image here provides: what to build, in the message
    r = httpx.post(url, json={"code": "fn main(){}", "language": "rust"}, timeout=30)
    assert r.json()["status"] == "SandboxError" and "CORRAL_FUSION_IMAGES" in r.json()["message"]
    r = httpx.post(url, json={"code": "x", "language": "verilog"}, timeout=30)
    assert r.json()["status"] == "SandboxError" and "does not run" in r.json()["message"]
    # memory_limit_MB: more than any sandbox may have is a SandboxError, not a 500;
    # less than the least a sandbox has gets that least
    r = httpx.post(url, json={"code": "1", "language": "python", "memory_limit_MB": 1 << 40},
                   timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "SandboxError", r.text
    r = httpx.post(url, json={"code": "print(2)", "language": "python", "memory_limit_MB": 1},
                   timeout=60)
    assert r.status_code == 200 and r.json()["status"] in ("Success", "Failed"), r.text
    # files the sandbox user may not write, or outside its root: a SandboxError, and the
    # sandbox is gone all the same (checked() looks)
    for name in ("/etc/passwd", "../../../../../x"):
        r = httpx.post(url, json={"code": "1", "language": "python", "files": {name: "YQ=="}},
                       timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "SandboxError", r.text
    # a fetched file is read only up to a bound: a huge sparse one is refused, named
    r = httpx.post(url, json={"code": "open('big', 'w').truncate(1 << 40)", "language": "python",
                              "fetch_files": ["big", "/dev/zero"]}, timeout=60)
    assert r.json()["status"] == "SandboxError" and "big" in r.json()["message"], r.text
    r = httpx.post(url, json={"code": "import os; os.mkfifo('pipe')", "language": "python",
                              "fetch_files": ["pipe", "/dev/zero"]},
                   timeout=60)
    assert r.json()["status"] == "Success" and r.json()["files"] == {}, r.text
    r = httpx.post(f"{daemon_ok.endpoint}/run_jupyter", json={"cells": "print(1)"}, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "cells"]


def test_wrong_token_is_refused_and_never_logged(daemon_ok):
    good = TOKEN
    base = daemon_ok.endpoint.removesuffix(good)
    for endpoint in (base + "wrong-token", base + good + "x", base + good[:-1], base,
                     base.rstrip("/")):
        r = httpx.post(f"{endpoint}/run_code", json={"code": "print(1)", "language": "python"},
                       timeout=30)
        assert r.status_code in (401, 404), r.text
    out = run_script(daemon_ok, """
        try:
            code(language="python", code="print(1)")
        except Exception as e:
            out["error"] = str(e)
    """, endpoint=daemon_ok.endpoint.replace(good, "nope"))
    assert "401" in out["error"]
    # The daemon runs with --log-level debug: the access log shows every request.
    log = daemon_ok.log.read_text(errors="replace")
    assert "/sandboxfusion/TOKEN/run_code" in log
    assert good not in log


def handed_out(d: FusionDaemon) -> set[str]:
    with uds_client(d.socket) as c:
        pools = c.get("/v1/pools").json()["pools"]
        return {sid for p in pools for sid in c.get(f"/v1/pools/{p['name']}").json()[
            "acquired_ids"]}


def test_a_client_that_hangs_up_gets_its_sandbox_deleted(daemon_ok):
    body = json.dumps({"code": "import time; time.sleep(300)", "language": "python",
                       "run_timeout": 600}).encode()
    with socket.create_connection(("127.0.0.1", daemon_ok.port), timeout=10) as s:
        s.sendall(b"POST /sandboxfusion/" + TOKEN.encode() + b"/run_code HTTP/1.1\r\n"
                  b"Host: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        for _ in range(600):  # bounded: until the request holds its sandbox
            if taken := handed_out(daemon_ok):
                break
            time.sleep(0.05)
        assert taken, "the request never got a sandbox"
    for _ in range(600):  # bounded: until the daemon noticed and deleted it
        if not handed_out(daemon_ok):
            break
        time.sleep(0.05)
    assert handed_out(daemon_ok) == set()
    with uds_client(daemon_ok.socket) as c:
        assert c.get(f"/v1/sandboxes/{taken.pop()}").status_code == 404


def test_load_200_requests_at_concurrency_16(daemon_ok):
    def one(i: int) -> str:
        r = httpx.post(f"{daemon_ok.endpoint}/run_code",
                       json={"code": f"print({i} * 2)", "language": "python"}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["run_result"]["stdout"] == f"{i * 2}\n", r.text
        return r.json()["status"]

    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(200)))
    took = time.perf_counter() - started
    assert statuses == ["Success"] * 200
    print(f"\nSandboxFusion /run_code: 200 requests at concurrency 16 in {took:.1f} s "
          f"({200 / took:.1f} requests/s)")
