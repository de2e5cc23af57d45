"""In-process grading: the solution and its tests in one ``python3`` process.

The weaker way (docs/grading.md), kept for tests that pass objects which are not plain
data to the solution (a callback, an object of the test's own), which the judge
(:mod:`corral.rl._judge`) cannot send across. A report counts only if it carries a
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


# The harness runs as `python3 -I -c HARNESS` with a JSON request on stdin. It keeps the
# real stdout for its report and sends everything the solution prints to a file, so
# neither a chatty solution nor one printing a fake report can hide or forge the result.
HARNESS = r"""
import json, os, signal, sys, tempfile, time, traceback, types
t0 = time.monotonic()
req = json.loads(sys.stdin.buffer.read())
token = req.pop("token")
sys.stdin = open(os.devnull)
report_fd = os.dup(1)
os.set_inheritable(report_fd, False)
capture = tempfile.TemporaryFile()
os.dup2(capture.fileno(), 1)
os.dup2(capture.fileno(), 2)
deadline = t0 + req["budget"]

class HarnessTimeout(BaseException):
    pass

def on_alarm(signum, frame):
    raise HarnessTimeout()

signal.signal(signal.SIGALRM, on_alarm)

def run(src, filename, ns, is_test):
    left = deadline - time.monotonic()
    if req["test_timeout"]:
        left = min(left, req["test_timeout"])
    if left <= 0.01:
        return "timeout", "not run: the time budget was used up"
    try:
        signal.setitimer(signal.ITIMER_REAL, left)
        try:
            exec(compile(src, filename, "exec"), ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except HarnessTimeout:
        return "timeout", "timed out after %.3gs" % left
    except SystemExit as exc:
        if not is_test and exc.code in (None, 0):
            return "ok", None
        return "error", "SystemExit(%r)" % (exc.code,)
    except BaseException as exc:
        # Skip this frame: the traceback starts in the solution or the test.
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
        return "error", tb[-req["max_error"]:]
    return "ok", None

path = req.get("path")
if path is None:
    code, filename = req["code"], "solution.py"
else:
    filename = path
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            code = f.read()
    except OSError as exc:
        code = None
        load = ("error", "cannot read %s: %s" % (path, exc))
name = os.path.splitext(os.path.basename(filename))[0] or "solution"
module = types.ModuleType(name)
module.__file__ = os.path.abspath(filename)
sys.modules[name] = module
sys.path.insert(0, os.path.dirname(module.__file__))
if code is not None:
    load = run(code, filename, module.__dict__, False)
results = []
for i, test in enumerate(req["tests"]):
    if load[0] != "ok":
        results.append(["skipped", "not run: the solution did not load"])
        continue
    results.append(list(run(test, "<test %d>" % i, dict(module.__dict__), True)))
sys.stdout.flush()
sys.stderr.flush()
capture.seek(0, 2)
size = capture.tell()
capture.seek(max(0, size - req["max_output"] * 4))
out = capture.read().decode(errors="replace")[-req["max_output"]:]
report = {"load": list(load), "tests": results, "output": out, "elapsed": time.monotonic() - t0}
os.write(report_fd, (token + json.dumps(report) + "\n").encode())
os._exit(0)
"""



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
    return ["python3", "-I", "-c", HARNESS], json.dumps(request).encode(), token


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
