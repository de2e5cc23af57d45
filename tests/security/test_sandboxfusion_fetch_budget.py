"""SandboxFusion's ``fetch_files`` and replies outside the output budget
(server/compat/sandboxfusion.py, runtime/output_budget.py).

The attack: code in the sandbox writes large files and the request names them in
``fetch_files`` (or the completion being judged writes the file its harness fetches):
the daemon read up to 256 MiB of them per request into its memory, base64 and JSON on
top (~1 GiB at its peak), none of it in the output budget, and the reply went whole
into the connection's buffer for a client that need not read it. Now a fetch reserves
its room first (lowered or refused typed as a command's output is) and every reply of
the front-end holds its size until written."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest

from tests.security.unread_replies import PATIENCE_S, head_only, held_bytes
from tests.server.conftest import uds_client
from tests.server.test_compat_sandboxfusion import serving, verl_request

MiB = 1 << 20


@pytest.fixture(scope="module")
def sf_budget():
    with serving("--output-memory-mb", "64", "--tenant-output-memory-mb", "32") as d:
        yield d


def _held(d) -> float:
    with uds_client(d.socket) as c:
        return held_bytes(c)


def _nothing_held(d) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while _held(d) != 0:
        assert time.monotonic() < deadline, _held(d)
        time.sleep(0.05)


def _writer(mib: int) -> str:
    return f"open('/tmp/big.bin', 'wb').write(b'\\x00' * ({mib} << 20)); print('ok')"


def test_a_fetch_past_the_budget_is_refused_typed(sf_budget):
    r = verl_request(sf_budget, code=_writer(40), stdin="", fetch_files=["/tmp/big.bin"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "SandboxError", str(body)[:300]
    assert "output budget" in body["message"], body["message"]
    _nothing_held(sf_budget)
    # within it, a fetch is whole; a link's own size (its stat) is no bound on its file
    code = _writer(1) + "; import os; os.symlink('/tmp/big.bin', '/tmp/link')"
    r = verl_request(sf_budget, code=code, stdin="", fetch_files=["/tmp/big.bin", "/tmp/link"])
    assert r.json()["status"] == "Success", r.text[:300]
    for name in ("/tmp/big.bin", "/tmp/link"):
        assert base64.b64decode(r.json()["files"][name]) == bytes(MiB)
    _nothing_held(sf_budget)


def test_a_reply_not_read_keeps_its_room(sf_budget):
    payload = {"compile_timeout": 10, "run_timeout": 10, "code": _writer(9), "stdin": "",
               "memory_limit_MB": 1024, "language": "python", "files": {},
               "fetch_files": ["/tmp/big.bin"]}
    path = sf_budget.endpoint.split(str(sf_budget.port), 1)[1] + "/run_code"
    s, head, length = head_only(sf_budget.port, "POST", path, json.dumps(payload).encode())
    try:
        assert head.startswith(b"HTTP/1.1 200"), head
        assert length > 12 * MiB  # 9 MiB, in base64
        assert _held(sf_budget) >= length - 4 * MiB  # (the kernel's buffers take some)
    finally:
        s.close()
    _nothing_held(sf_budget)


def test_cells_results_past_the_budget_are_refused_typed(sf_budget):
    """The cells' results file is written by the kernel in the sandbox (a cell's value
    is shown whole): up to 256 MiB of it was read and parsed outside the budget."""
    r = httpx.post(f"{sf_budget.endpoint}/run_jupyter", json={
        "cells": ["x = 'a' * (20 << 20)", "x"], "cell_timeout": 60, "total_timeout": 120},
        timeout=PATIENCE_S)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "SandboxError", str(body)[:300]
    assert "output budget" in body["message"], body["message"]
    _nothing_held(sf_budget)
    small = httpx.post(f"{sf_budget.endpoint}/run_jupyter", json={"cells": ["1 + 1"]},
                       timeout=PATIENCE_S).json()
    assert small["status"] == "Success" and small["cells"][0]["display"] == [
        {"text/plain": "2"}], small
    _nothing_held(sf_budget)
