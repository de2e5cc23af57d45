"""The wire contract (issue 23, must-do 6): one declaration per endpoint, shared by the
daemon and the SDK. The daemon serves exactly the declared operations, the SDK (and the
CLI, the RL toolkit, the cluster layer) spells no path of its own, the cluster router
has a dispatch for every routing and the operations use only those, and the OpenAPI
document lists the error codes each operation declares. No daemon, no root."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from corral.api import OPERATIONS, Access, Operation, Routing, match, operation, url
from corral.client._async._router import _DISPATCH as ASYNC_DISPATCH
from corral.client._sync._router import _DISPATCH as SYNC_DISPATCH
from corral.server.endpoints import HANDLERS, endpoints
from corral.server.openapi import openapi_document
from tests.server.test_units import TOKEN, make_client

SRC = Path(__file__).resolve().parents[2] / "src" / "corral"
# what talks to a daemon over the native API: every path it sends comes from corral.api
CALLERS = ["client", "cli", "rl", "cluster", "integrations"]
ALLOWED_PATHS: set[str] = set()  # none: even the node proof's path is declared (node_proof)


def test_every_operation_is_served_and_every_route_declared():
    app = make_client()._transport.app
    served = {(m, r.path) for r in app.routes for m in r.methods if m != "HEAD"}
    declared = {(op.method, op.path) for op in OPERATIONS}
    assert served - declared == {("GET", "/openapi.json")}
    assert declared <= served
    assert set(HANDLERS) == {op.name for op in OPERATIONS}
    assert len({op.name for op in OPERATIONS}) == len(OPERATIONS)


async def test_a_handler_without_an_operation_stops_the_routes(monkeypatch):
    async def stray(request):  # pragma: no cover - never served
        raise AssertionError

    monkeypatch.setitem(HANDLERS, "stray", stray)
    with pytest.raises(RuntimeError, match="handlers without an operation: \\['stray'\\]"):
        endpoints()


def test_every_path_of_an_operation_matches_it_and_no_other():
    for op in OPERATIONS:
        concrete = op.url(**{p: f"x-{p} /%?" for p in op.params})
        found = match(op.method, concrete)
        assert found is not None and found[0] is op, (op.name, concrete)
        assert set(found[1]) == set(op.params)
    assert url("exec_command", sandbox_id="a/b") == "/v1/sandboxes/a%2Fb/exec"  # one segment
    with pytest.raises(TypeError):
        operation("exec_command").url()


def test_an_operation_without_routing_is_refused():
    with pytest.raises(TypeError, match="declares no routing"):
        Operation("new_thing", "GET", "/v1/new", "A new endpoint")


def test_the_cluster_router_handles_every_routing_and_nothing_else():
    used = {op.routing for op in OPERATIONS}
    assert set(ASYNC_DISPATCH) == set(Routing) == set(SYNC_DISPATCH)
    assert used <= set(Routing)
    # the lists it merges are replies of one list field, which is the key it merges by
    for op in OPERATIONS:
        if op.routing is Routing.MERGE:
            assert len(op.reply.model_fields) == 1, op.name
        if op.routing is Routing.SANDBOX:
            assert "sandbox_id" in op.params, op.name
        if op.routing is Routing.HOLDER:
            assert op.params == ("id_or_name",), op.name
        if op.routing is Routing.EVERYWHERE:  # a snapshot's copies, a volume's
            assert op.params in (("id_or_name",), ("name",)), op.name
        if op.routing is Routing.VOLUME:
            assert op.params[0] == "name" and op.path.startswith("/v1/volumes/"), op.name
        if op.routing is Routing.POOL:
            assert op.params == ("name",) and op.path.startswith("/v1/pools/"), op.name


def test_the_peer_credential_opens_only_peer_operations():
    peer = {op.name for op in OPERATIONS if op.access is Access.PEER}
    assert peer == {"peer_snapshot", "peer_layer", "peer_image", "peer_volume",
                    "peer_checkpoint", "refresh_tenants"}
    assert all(op.method == "GET" or op.name == "refresh_tenants" for op in OPERATIONS
               if op.access is Access.PEER)


def _path_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {  # a string on its own (a docstring, also of an attribute) is prose
        id(node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            text = node.value
            if ("/v1/" in text or text.startswith("/v1") or text == "/metrics") and \
                    text not in ALLOWED_PATHS:
                found.append((node.lineno, text))
    return found


def test_the_sdk_spells_no_path_of_its_own():
    found = []
    for name in CALLERS:
        for path in sorted((SRC / name).rglob("*.py")):
            found += [f"{path.relative_to(SRC)}:{line}: {text!r}"
                      for line, text in _path_literals(path)]
    assert found == []


def test_the_path_check_sees_a_path_literal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Calls GET /v1/info."""\n'
                   'async def f(c):\n    return await c.request("GET", "/v1/info")\n')
    assert _path_literals(bad) == [(3, "/v1/info")]


async def test_the_openapi_document_lists_each_operations_error_codes():
    reply = await make_client().get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    doc = reply.json()
    assert doc == openapi_document(endpoints())
    for op in OPERATIONS:
        described = doc["paths"][op.path][op.method.lower()]
        assert described["operationId"] == op.name
        assert described["x-error-codes"] == list(op.codes())
        assert described["x-routing"] == op.routing.value
        by_status = {code for status, r in described["responses"].items() if status[0] in "45"
                     for code in r.get("x-error-codes", ())}
        assert by_status == set(op.codes()), op.name
        for err in op.errors:
            assert err.code in described["responses"][str(err.status)]["x-error-codes"]
    exec_codes = doc["paths"]["/v1/sandboxes/{sandbox_id}/exec"]["post"]["x-error-codes"]
    assert {"sandbox_not_found", "invalid_argument", "unauthorized"} <= set(exec_codes)


def test_every_model_the_sdk_shares_is_defined_outside_the_daemon():
    """Every body and reply of every operation is a model of the shared wire contract
    (``corral.api`` and the schema modules), never one of a daemon module: the SDK and
    the daemon import the same class (the process and peer models included)."""
    for op in OPERATIONS:
        for model in (op.body, op.reply):
            for part in model if isinstance(model, tuple) else (model,):
                if isinstance(part, type):  # a pydantic model or a schema dataclass
                    module = part.__module__
                    assert not module.startswith(("corral.server", "corral.runtime")), (
                        op.name, module)
                else:
                    assert part is None or isinstance(part, str), (op.name, part)


def test_an_exec_result_crosses_the_wire_through_one_model():
    """The daemon encodes an ExecResult as ``ExecResponse`` and the SDK decodes that same
    model: every field of how a command ended is named once (``EXEC_STATUS``)."""
    from corral.api.models import EXEC_STATUS, exec_response
    from corral.client._models import CommandResult, parse_exec
    from corral.schema import ExecResult

    assert set(EXEC_STATUS) <= {f.name for f in dataclasses.fields(ExecResult)}
    assert set(EXEC_STATUS) <= {f.name for f in dataclasses.fields(CommandResult)}
    sent = ExecResult(returncode=-9, stdout=b"ok\n", stderr=b"\xff\xfe", timed_out=True,
                      oom_killed=True, stdout_truncated=True, stderr_truncated=True,
                      duration=1.5, stdout_dropped=7, stderr_dropped=8, output_tail=9,
                      output_limited_to=10)
    got = parse_exec(exec_response(sent), args=["x"], sandbox_id="sb-1", timeout=2.0)
    assert (got.stdout_bytes, got.stderr_bytes) == (b"ok\n", b"\xff\xfe")
    for name in EXEC_STATUS:
        assert getattr(got, name) == getattr(sent, name), name
