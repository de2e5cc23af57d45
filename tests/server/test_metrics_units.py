"""The pieces of metrics and JSON logging that need no daemon."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from corral.runtime.events import SandboxEnded
from corral.schema import ExecResult, SandboxState
from corral.server.accesslog import JsonFormatter, route_template
from corral.server.metrics import OTHER, bounded, end_reason, exec_outcome
from corral.server.settings import ServerSettings


def test_bounded_keeps_the_first_and_sums_the_rest():
    few = [("a", 1.0), ("b", 2.0)]
    assert bounded(few, limit=2) == few
    many = [(f"p{i}", float(i)) for i in range(10)]
    assert bounded(many, limit=4) == [("p0", 0.0), ("p1", 1.0), ("p2", 2.0), (OTHER, 42.0)]
    assert len(bounded(many * 1000, limit=50)) == 50


@pytest.mark.parametrize("result, outcome", [
    (ExecResult(returncode=0), "ok"),
    (ExecResult(returncode=1), "nonzero"),
    (ExecResult(returncode=-9, timed_out=True), "timeout"),
    (ExecResult(returncode=-9, oom_killed=True), "oom"),
])
def test_exec_outcome(result, outcome):
    assert exec_outcome(result) == outcome


@pytest.mark.parametrize("state, reason, expected", [
    (SandboxState.STOPPED, "deleted", "deleted"),
    (SandboxState.STOPPED, "stopped by request", "stopped"),
    (SandboxState.STOPPED, "timeout: its lifetime of 1 s ran out", "timeout"),
    (SandboxState.STOPPED, "idle timeout: no activity for 5 s", "idle_timeout"),
    (SandboxState.STOPPED, "lease expired: its client stopped renewing it", "lease_expired"),
    (SandboxState.FAILED, "sandbox fault: anything a sandbox may print", "failed"),
    (SandboxState.STOPPED, "the daemon shut down", "stopped"),
])
def test_end_reasons_are_a_closed_set(state, reason, expected):
    assert end_reason(SandboxEnded("sb-x", state, reason)) == expected


def test_json_formatter_one_line_with_extras_and_traceback():
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("corral.server", logging.ERROR, __file__, 1, "failed %s",
                               ("x",), exc_info)
    record.route = "/v1/sandboxes/{sandbox_id}"
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "failed x" and entry["level"] == "error"
    assert entry["logger"] == "corral.server" and entry["route"] == "/v1/sandboxes/{sandbox_id}"
    assert "ValueError: boom" in entry["exc"] and entry["time"].endswith("Z")


def test_route_template_only_from_a_matched_route():
    class Route:
        path = "/v1/sandboxes/{sandbox_id}"

    assert route_template({"route": Route(), "path": "/v1/sandboxes/sb-1"}) == Route.path
    assert route_template({"path": "/v1/secret"}) is None


def test_log_format_is_checked():
    with pytest.raises(ValueError, match="log-format"):
        ServerSettings(log_format="xml", max_memory_mb=1024)
