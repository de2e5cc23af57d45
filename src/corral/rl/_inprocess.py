"""In-process grading: the solution and its tests in one ``python3`` process.

The weaker way (docs/grading.md), kept for tests that pass objects which are not plain
data to the solution (a callback, an object of the test's own), which the judge
(:mod:`corral.guest.judge`) cannot send across. A report counts only if it carries a
random token the solution is not given, which stops accidents (a solution that exits
early or prints something that looks like a report) but not a solution that searches
its own process for the token: results graded this way are flagged
``grading="in_process"``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence

from corral.client._models import CommandResult
from corral.errors import InvalidArgument
from corral.guest import program
from corral.rl._test_report import TestReport

MAX_ERROR_CHARS = 2000
"""Characters kept of each test's error (the end of its traceback)."""
MAX_OUTPUT_CHARS = 4000
"""Characters kept of what the solution and its tests printed (the end of it)."""


def time_budget(timeout: float) -> float:
    """The part of a run's ``timeout`` its tests may use: a little is kept for the
    report, so a slow test is reported as a timed-out test rather than the whole run
    being killed."""
    return max(0.05, timeout - min(0.5, timeout * 0.2))





def harness_request(
    tests: Sequence[str],
    *,
    code: str | None = None,
    path: str | None = None,
    timeout: float,
    test_timeout: float | None = None,
) -> tuple[list[str], bytes, str]:
    """The command, its stdin and the report token of one harness run."""
    if (code is None) == (path is None):
        raise InvalidArgument("give the solution as code= or as path=, not both")
    token = "corral-report-" + secrets.token_hex(16)
    budget = time_budget(timeout)
    request = {
        "token": token, "code": code, "path": path, "tests": list(tests), "budget": budget,
        "test_timeout": test_timeout, "max_error": MAX_ERROR_CHARS, "max_output": MAX_OUTPUT_CHARS,
    }
    return ["python3", "-I", "-c", program("harness")], json.dumps(request).encode(), token


def parse_report(result: CommandResult, token: str, n_tests: int) -> TestReport:
    """Turn the harness command's result into a :class:`TestReport`."""
    if result.timed_out:
        return TestReport("timeout", result=result)
    if result.oom_killed:
        return TestReport("oom", result=result)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(token):
            try:
                data = json.loads(line[len(token):])
                load, tests = data["load"], data["tests"]
            except (ValueError, KeyError, TypeError):
                break
            if len(tests) != n_tests:
                break
            return TestReport(
                "ok",
                load=load[0],
                load_error=load[1],
                tests=[t[0] for t in tests],
                errors=[t[1] for t in tests],
                output=str(data.get("output") or ""),
                result=result,
            )
    return TestReport("crashed", result=result)
