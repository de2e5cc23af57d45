"""The in-process harness: the solution and its tests in one ``python3 -I`` process.

The weaker way (docs/grading.md), sent by :mod:`corral.rl._inprocess` with a JSON
request on stdin. It keeps the real stdout for its report and sends everything the
solution prints to a file, so neither a chatty solution nor one printing a fake report
can hide or forge the result; a solution that searches its own process for the report
token can (results graded this way are flagged ``grading="in_process"``).
"""

import json
import os
import signal
import sys
import tempfile
import time
import traceback
import types

# Module level on purpose (under the guard, so importing this file does nothing): the
# names stay globals of ``__main__``, as in any harness of this kind, which is what the
# hack tests show a solution can find.
if __name__ == "__main__":
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
