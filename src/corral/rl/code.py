"""Code out of model completions, and tests run on it inside a sandbox.

Shared by the reward functions (:mod:`corral.rl.rewards`), the TRL environment
(:mod:`corral.rl.trl_env`) and the code-generation env (:mod:`corral.rl.envs.codegen`),
so that "which code does a completion contain" and "how many tests does it pass" have
one answer everywhere.

Extraction (:func:`extract_code`), in this order:

1. The last ``<answer>...</answer>`` block: inside it, the last Python code fence if it
   has one, else its whole text.
2. Else the last closed markdown fence labelled ``python``, ``py``, ``python3`` or not
   labelled at all (fences of other languages, e.g. ``bash``, are skipped).
3. Else nothing (``None``), unless ``fallback="raw"``: then the whole text.

"Last wins" because models draft, then correct themselves; an unclosed fence (a
completion cut at ``max_completion_length``) does not count.

Tests (:func:`run_tests`): a test is a snippet of Python, typically ``assert f(2) == 4``,
run after the solution in a copy of its namespace; the solution is also importable as a
module (``from solution import f``). All tests of one solution run in one ``python3``
process inside the sandbox (:data:`HARNESS`): each test is isolated from the others'
exceptions and may have its own time limit (``SIGALRM``), so one endless loop costs that
test, not the whole report. The tests travel on the command's standard input and are
never written into the sandbox, so a solution cannot read them from disk. The harness
guards against accidental passes (a solution that exits early, or prints what looks like
a report): a report counts only if it carries a random token the solution is not given.
A solution that deliberately inspects the harness's memory can still forge one; score
adversarial code with one process per test if that matters.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from corral.client._async._sandbox import AsyncSandbox
from corral.client._models import CommandResult
from corral.client._sync import Sandbox
from corral.errors import InvalidArgument

PYTHON_FENCE_LANGS = frozenset({"", "python", "py", "python3"})
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.S)

MAX_ERROR_CHARS = 2000
"""Characters kept of each test's error (the end of its traceback)."""
MAX_OUTPUT_CHARS = 4000
"""Characters kept of what the solution and its tests printed (the end of it)."""

Fallback = Literal["none", "raw"]
Tests = Sequence[str] | str | None


def completion_text(completion: Any) -> str:
    """The text of one completion, as TRL hands it to a reward function.

    A plain string stays as is. A conversational completion (a list of message dicts)
    gives the contents of its assistant messages, in order, joined by newlines; content
    given as a list of blocks keeps its ``text`` blocks.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    parts: list[str] = []
    for message in completion or ():
        if not isinstance(message, Mapping) or message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, Sequence):
            parts.extend(
                b.get("text", "") for b in content if isinstance(b, Mapping) and b.get("type") == "text"
            )
    return "\n".join(parts)


def _last_python_fence(text: str) -> str | None:
    blocks = [code for lang, code in _FENCE_RE.findall(text) if lang.lower() in PYTHON_FENCE_LANGS]
    return blocks[-1] if blocks else None


def extract_code(completion: Any, *, fallback: Fallback = "none") -> str | None:
    """The code a completion proposes (rules in the module docstring), or ``None``.

    >>> extract_code("Sure:\\n```python\\nprint(1)\\n```")
    'print(1)\\n'
    >>> extract_code("<answer>x = 2</answer>")
    'x = 2'
    >>> extract_code("no code here") is None
    True
    """
    if fallback not in ("none", "raw"):
        raise InvalidArgument(f"fallback must be 'none' or 'raw', got {fallback!r}")
    text = completion_text(completion)
    answers = _ANSWER_RE.findall(text)
    if answers:
        inner = answers[-1]
        fenced = _last_python_fence(inner)
        return fenced if fenced is not None else inner.strip()
    fenced = _last_python_fence(text)
    if fenced is not None:
        return fenced
    return text if fallback == "raw" else None


def normalize_tests(tests: Tests, *, where: str = "tests") -> list[str]:
    """A row's tests as a list of snippets: a string is one test, ``None`` none."""
    if tests is None:
        return []
    if isinstance(tests, str):
        return [tests]
    if isinstance(tests, Sequence) and all(isinstance(t, str) for t in tests):
        return list(tests)
    raise InvalidArgument(
        f"{where} must be a string of Python or a list of them (one per test case), "
        f"got {type(tests).__name__}"
    )


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


@dataclass(frozen=True)
class TestReport:
    """How one solution did on its tests inside a sandbox.

    ``status`` is ``"ok"`` (the harness reported), ``"timeout"`` (the whole run went over
    its time and was killed), ``"oom"`` (killed for memory) or ``"crashed"`` (no
    report: the solution killed the harness, e.g. ``os._exit``). Each test's outcome in
    ``tests`` is ``"ok"``, ``"error"`` (an exception; its traceback in ``errors``),
    ``"timeout"`` or ``"skipped"`` (the solution itself did not load).
    """

    __test__ = False  # not a pytest test class, despite the name

    status: Literal["ok", "timeout", "oom", "crashed"]
    load: Literal["ok", "error", "timeout", "not run"] = "not run"
    load_error: str | None = None
    tests: list[str] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    output: str = ""
    result: CommandResult | None = None

    @property
    def loaded(self) -> bool:
        """The solution ran to its end (its top level) without an exception."""
        return self.load == "ok"

    @property
    def timed_out(self) -> bool:
        """The run, the solution's top level or at least one test went over its time."""
        return self.status == "timeout" or self.load == "timeout" or "timeout" in self.tests

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def passed(self) -> int:
        return sum(1 for t in self.tests if t == "ok")

    @property
    def fraction(self) -> float:
        """Tests passed over tests run; with no tests, 1.0 if the solution ran cleanly."""
        if self.status != "ok":
            return 0.0
        if not self.tests:
            return 1.0 if self.loaded else 0.0
        return self.passed / len(self.tests)

    @property
    def all_passed(self) -> bool:
        return self.status == "ok" and self.fraction == 1.0

    @property
    def reason(self) -> str:
        """One line: why the score is what it is."""
        if self.status == "timeout":
            return "timeout: the run was killed at its time limit"
        if self.status == "oom":
            return "oom: the run was killed for using too much memory"
        if self.status == "crashed":
            code = self.result.returncode if self.result is not None else "?"
            return f"crashed: the harness gave no report (exit status {code})"
        if self.load == "timeout":
            return "timeout: " + _last_line(self.load_error)
        if not self.loaded:
            return "load error: " + _last_line(self.load_error)
        if not self.tests:
            return "ran cleanly (no tests)"
        failed = [i for i, t in enumerate(self.tests) if t != "ok"]
        if not failed:
            return f"passed {self.total}/{self.total}"
        first = failed[0]
        why = "timeout" if self.tests[first] == "timeout" else _last_line(self.errors[first])
        return f"passed {self.passed}/{self.total}; test {first}: {why}"

    def feedback(self) -> str:
        """A multi-line account for an agent: what failed, tracebacks, printed output."""
        lines = [self.reason]
        if self.load_error:
            lines.append(self.load_error.rstrip())
        for i, (state, err) in enumerate(zip(self.tests, self.errors, strict=True)):
            if state not in ("ok", "skipped"):
                lines.append(f"--- test {i}: {state}")
                if err:
                    lines.append(err.rstrip())
        if self.output.strip():
            lines.append("--- output")
            lines.append(self.output.rstrip())
        return "\n".join(lines)


def clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters: its head and its tail (where the
    traceback ends), with a note of what was cut in between."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


def render_result(result: CommandResult, limit: int) -> str:
    """A command's result as an agent reads it: how it ended, then its output."""
    if result.timed_out:
        head = f"timed out after {result.timeout:g}s and was killed"
    elif result.oom_killed:
        head = "killed: out of memory"
    else:
        head = f"exit code {result.returncode}"
    stderr = f"[stderr]\n{result.stderr}" if result.stderr else ""
    return clip(f"{head}\n{result.stdout}{stderr}", limit)


def _last_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"


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
    # Keep a little of the command's time for the report, so a slow test is reported as
    # a timed-out test rather than the whole run being killed.
    budget = max(0.05, timeout - min(0.5, timeout * 0.2))
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


async def arun_tests(
    sb: AsyncSandbox,
    tests: Tests,
    *,
    code: str | None = None,
    path: str | None = None,
    timeout: float = 10.0,
    test_timeout: float | None = None,
    cwd: str | None = None,
) -> TestReport:
    """Run ``tests`` on a solution (``code``, or the file at ``path`` in the sandbox).

    ``timeout`` bounds the whole run (the command is killed after it: status
    ``"timeout"``); ``test_timeout`` each test. Sandbox and daemon failures raise
    their :mod:`corral.errors` exception: they are not the solution's fault.
    """
    snippets = normalize_tests(tests)
    argv, stdin, token = harness_request(
        snippets, code=code, path=path, timeout=timeout, test_timeout=test_timeout
    )
    result = await sb.exec(argv, stdin=stdin, timeout=timeout, cwd=cwd)
    return parse_report(result, token, len(snippets))


def run_tests(
    sb: Sandbox,
    tests: Tests,
    *,
    code: str | None = None,
    path: str | None = None,
    timeout: float = 10.0,
    test_timeout: float | None = None,
    cwd: str | None = None,
) -> TestReport:
    """The blocking twin of :func:`arun_tests`."""
    snippets = normalize_tests(tests)
    argv, stdin, token = harness_request(
        snippets, code=code, path=path, timeout=timeout, test_timeout=test_timeout
    )
    result = sb.exec(argv, stdin=stdin, timeout=timeout, cwd=cwd)
    return parse_report(result, token, len(snippets))
