"""stdin/stdout judging: competitive-programming tests in many languages.

Most code-RL data (APPS, TACO, CodeContests, LiveCodeBench, the Codeforces sets) is
a program that reads a test's input and prints its answer. :func:`run_io_tests` judges
one such program inside a sandbox with the stdin/stdout judge
(:mod:`corral.guest.io_judge`; docs/grading.md): it compiles once, runs every test case
under a CPU-time and a memory limit, and compares the output (or asks the task's own
checker). Each test gets a verdict: ``AC``, ``WA``, ``PE`` (a checker's presentation
error), ``PC`` (a checker's partial credit, in :attr:`TestReport.case_scores`), ``TLE``,
``MLE``, ``RE``, ``CE``, ``IE`` (not gradable: a broken checker, testlib's ``FAIL``, a
missing toolchain), ``SKIP``.

Tests come in the shapes datasets use (:func:`normalize_io_tests`)::

    [{"input": "1 2\\n", "output": "3\\n"}, ...]
    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}          # APPS, TACO
    {"input": [...], "output": [...]}                             # CodeContests
    [{"input": ..., "output": ..., "testtype": "stdin"}, ...]      # LiveCodeBench

Languages: ``python``, ``c``, ``cpp``, ``java``, ``javascript``, ``go``, ``rust`` (the
``judge`` built-in image has them all; ``python`` runs on any image).
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
from corral.errors import ExecTimeout, InvalidArgument
from corral.guest import program
from corral.rl._grading import READY, TRUSTED_PATH, aended, ended
from corral.rl._test_report import TestReport
from corral.rl.code import completion_text

Compare = Literal["exact", "lines", "tokens", "float"]
COMPARES = ("exact", "lines", "tokens", "float")
LANGUAGES = ("python", "c", "cpp", "java", "javascript", "go", "rust")
JUDGE_IMAGE = "judge"
"""The built-in image with every language's toolchain (``corral.runtime.prepare``)."""
DEFAULT_TIME_LIMIT = 2.0
DEFAULT_MEMORY_MB = 256
DEFAULT_OUTPUT_LIMIT = 16 << 20
COMPILE_ALLOWANCE_S = 60.0

ALIASES = {
    "python": "python", "py": "python", "python3": "python", "py3": "python",
    "c": "c", "gcc": "c",
    "cpp": "cpp", "c++": "cpp", "cc": "cpp", "cxx": "cpp", "g++": "cpp", "cpp17": "cpp",
    "java": "java",
    "javascript": "javascript", "js": "javascript", "node": "javascript",
    "nodejs": "javascript",
    "go": "go", "golang": "go",
    "rust": "rust", "rs": "rust",
}
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n(.*?)```", re.S)


def language_name(name: str) -> str:
    """The judge's name of a language (``"C++"`` → ``"cpp"``)."""
    lang = ALIASES.get(str(name).strip().lower())
    if lang is None:
        raise InvalidArgument(
            f"unknown language {name!r}: the judge runs {', '.join(LANGUAGES)} "
            "(or an alias such as py, c++, js, golang, rs)"
        )
    return lang


def extract_program(completion: Any, *, language: str | None = None) -> tuple[str, str] | None:
    """``(code, language)`` of the last closed code fence of a known language in a
    completion (an unlabelled fence counts as ``language``, default Python), or
    ``None``. ``language`` given: only fences of that language (or unlabelled) count."""
    want = language_name(language) if language is not None else None
    found = None
    for label, code in _FENCE_RE.findall(completion_text(completion)):
        lang = ALIASES.get(label.lower()) if label else (want or "python")
        if lang is not None and (want is None or lang == want):
            found = (code, lang)
    return found


@dataclass(frozen=True)
class IOCase:
    """One test case: what goes to stdin, what stdout should be."""

    input: str
    output: str
    time_limit: float | None = None
    memory_mb: int | None = None


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value) + "\n"  # a list of lines (some APPS rows)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value}\n"
    raise InvalidArgument(f"{where} must be text, got {type(value).__name__}")


def normalize_io_tests(tests: Any, *, where: str = "tests") -> list[IOCase]:
    """Test cases from any of the shapes in the module docstring (a JSON string of one
    of them too)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise InvalidArgument(f"{where} is a string but not JSON test cases") from None
    if isinstance(tests, IOCase):
        return [tests]
    if isinstance(tests, Mapping):
        ins = tests.get("inputs", tests.get("input"))
        outs = tests.get("outputs", tests.get("output"))
        if isinstance(ins, list) and isinstance(outs, list):
            if len(ins) != len(outs):
                raise InvalidArgument(f"{where}: {len(ins)} inputs but {len(outs)} outputs")
            return [IOCase(_text(i, f"{where}.inputs[{k}]"), _text(o, f"{where}.outputs[{k}]"))
                    for k, (i, o) in enumerate(zip(ins, outs, strict=True))]
        tests = [tests]
    if not isinstance(tests, Sequence):
        raise InvalidArgument(
            f"{where} must be a list of {{'input', 'output'}} cases or "
            f"{{'inputs': [...], 'outputs': [...]}}, got {type(tests).__name__}"
        )
    cases = []
    for k, case in enumerate(tests):
        if isinstance(case, IOCase):
            cases.append(case)
            continue
        if not isinstance(case, Mapping) or "input" not in case or "output" not in case:
            raise InvalidArgument(f"{where}[{k}] must be a mapping with 'input' and 'output'")
        cases.append(IOCase(
            _text(case["input"], f"{where}[{k}].input"), _text(case["output"], f"{where}[{k}].output"),
            case.get("time_limit"), case.get("memory_mb"),
        ))
    return cases


def is_io_tests(tests: Any) -> bool:
    """Whether a row's tests are stdin/stdout cases (else Python test snippets)."""
    if isinstance(tests, (Mapping, IOCase)):
        return True
    if isinstance(tests, str):
        return tests.lstrip().startswith(("{", "[{"))
    return isinstance(tests, Sequence) and bool(tests) and all(
        isinstance(t, (Mapping, IOCase)) for t in tests
    )


@dataclass(frozen=True)
class IORun:
    """One stdin/stdout judging run: what to start, what to send, how to read back."""

    code: str
    language: str
    cases: list[IOCase]
    time_limit: float = DEFAULT_TIME_LIMIT
    memory_mb: int = DEFAULT_MEMORY_MB
    compare: Compare = "tokens"
    tolerance: float = 1e-6
    checker: Mapping[str, Any] | None = None
    stop_on_failure: bool = False
    output_limit: int = DEFAULT_OUTPUT_LIMIT
    nonce: str = field(default_factory=lambda: "corral-verdict-" + secrets.token_hex(16))

    def __post_init__(self) -> None:
        if self.compare not in COMPARES:
            raise InvalidArgument(f"compare must be one of {COMPARES}, got {self.compare!r}")
        if not self.time_limit > 0 or not self.memory_mb > 0:
            raise InvalidArgument("time_limit and memory_mb must be positive")
        if self.checker is not None:
            kind = self.checker.get("kind", "python")
            if kind not in ("python", "program") or not isinstance(self.checker.get("source"), str):
                raise InvalidArgument(
                    "checker must be {'kind': 'python', 'source': 'def check(input, output, "
                    "expected): ...'} or {'kind': 'program', 'language': 'cpp', 'source': ..., "
                    "'files': {'testlib.h': ...}}"
                )
            points = self.checker.get("max_points", 1.0)
            if isinstance(points, bool) or not isinstance(points, (int, float)) or not points > 0:
                raise InvalidArgument(f"checker max_points must be a positive number, got {points!r}")

    @property
    def argv(self) -> list[str]:
        return ["python3", "-I", "-c", program("confine", "case_memory", "io_judge")]

    def default_timeout(self) -> float:
        """A bound on the whole run: compiling, then every case at its wall limit."""
        # The judge's wall guard per case is 3x its CPU limit (Java: 2x the time + 1 s)
        # + 5 s; a little more here so the judge, not the host, reports a slow case.
        per = sum(4 * (6 * (c.time_limit or self.time_limit) + 10) for c in self.cases)
        return COMPILE_ALLOWANCE_S + per

    def request(self) -> bytes:
        body = {
            "nonce": self.nonce, "language": language_name(self.language), "code": self.code,
            "tests": [{"input": c.input, "output": c.output, "time_limit": c.time_limit,
                       "memory_mb": c.memory_mb} for c in self.cases],
            "time_limit": self.time_limit, "memory_mb": self.memory_mb,
            "compare": self.compare, "tolerance": self.tolerance,
            "checker": dict(self.checker) if self.checker else None,
            "stop_on_failure": self.stop_on_failure, "output_limit": self.output_limit,
        }
        return json.dumps(body).encode() + b"\n"

    def report(self, ready: str | None, line: str | None, result: CommandResult | None) -> TestReport:
        if result is not None and result.oom_killed:
            return TestReport("oom", result=result)
        if line is None or ready is None or (result is not None and result.timed_out):
            return TestReport("timeout", result=result)
        if ready.strip() != READY or not line.startswith(self.nonce):
            return TestReport("crashed", result=result)
        try:
            data = json.loads(line[len(self.nonce):])
            compiled, message = data["compile"]
            rows = [(str(t[0]), float(t[1]), int(t[2]), t[3],
                     min(1.0, max(0.0, float(t[4]))) if len(t) > 4 else float(t[0] == "AC"))
                    for t in data["tests"]]
        except (ValueError, KeyError, TypeError, IndexError):
            return TestReport("crashed", result=result)
        if len(rows) != len(self.cases):
            return TestReport("crashed", result=result)
        verdicts = tuple(r[0] for r in rows)
        return TestReport(
            "ok", load="ok" if compiled == "ok" else "error",
            load_error=None if compiled == "ok" else str(message or compiled),
            tests=[_STATE.get(v, "error") for v in verdicts],
            errors=[None if r[0] == "AC" else f"{r[0]}: {r[3] or ''}".strip() for r in rows],
            result=result, verdict_list=verdicts,
            compile_error=str(message) if compiled == "error" else None,
            case_stats=tuple((r[1], r[2]) for r in rows),
            case_scores=tuple(r[4] for r in rows),
        )


_STATE = {"AC": "ok", "TLE": "timeout", "IE": "ungradable", "SKIP": "skipped"}


async def arun_io_tests(
    sb: AsyncSandbox,
    tests: Any,
    *,
    code: str,
    language: str = "python",
    time_limit: float = DEFAULT_TIME_LIMIT,
    memory_mb: int = DEFAULT_MEMORY_MB,
    compare: Compare = "tokens",
    tolerance: float = 1e-6,
    checker: Mapping[str, Any] | None = None,
    stop_on_failure: bool = False,
    timeout: float | None = None,
    fresh: bool = False,
) -> TestReport:
    """Judge ``code`` (in ``language``) on stdin/stdout ``tests`` inside ``sb``.

    ``time_limit`` (CPU seconds) and ``memory_mb`` apply to each case unless the case
    sets its own; ``compare``: ``"exact"``, ``"lines"`` (trailing spaces and blank lines
    ignored), ``"tokens"`` (whitespace-separated, the default) or ``"float"`` (tokens,
    numbers equal within ``tolerance``, absolute or relative); ``checker`` replaces the
    comparison (module docstring of :mod:`corral.guest.io_judge`). ``stop_on_failure``
    skips the cases after the first that fails. ``timeout`` bounds the whole run
    (default: enough to compile and run every case to its limit). Per-case verdicts are
    in :attr:`TestReport.verdicts`, CPU seconds and peak memory in ``case_stats``.
    ``fresh=True``: ``sb`` was just created from an image and has run nothing, so the
    sweep of its processes from outside is skipped (the judge still stops every other
    process itself before it reads the tests).
    """
    run = IORun(code, language, normalize_io_tests(tests), time_limit, memory_mb, compare,
                tolerance, checker, stop_on_failure)
    limit = timeout if timeout is not None else run.default_timeout()
    if not fresh:
        await sb.kill_processes()
    async with await sb.spawn(run.argv, timeout=limit, env={"PATH": TRUSTED_PATH}) as proc:
        ready = line = None
        try:
            ready = await proc.exchange(b"", timeout=limit)
            if ready.strip() == READY:
                line = await proc.exchange(run.request(), timeout=limit)
        except ExecTimeout:
            pass
        return run.report(ready, line, await aended(proc, line is not None))


def run_io_tests(
    sb: Sandbox,
    tests: Any,
    *,
    code: str,
    language: str = "python",
    time_limit: float = DEFAULT_TIME_LIMIT,
    memory_mb: int = DEFAULT_MEMORY_MB,
    compare: Compare = "tokens",
    tolerance: float = 1e-6,
    checker: Mapping[str, Any] | None = None,
    stop_on_failure: bool = False,
    timeout: float | None = None,
    fresh: bool = False,
) -> TestReport:
    """The blocking twin of :func:`arun_io_tests`."""
    run = IORun(code, language, normalize_io_tests(tests), time_limit, memory_mb, compare,
                tolerance, checker, stop_on_failure)
    limit = timeout if timeout is not None else run.default_timeout()
    if not fresh:
        sb.kill_processes()
    with sb.spawn(run.argv, timeout=limit, env={"PATH": TRUSTED_PATH}) as proc:
        ready = line = None
        try:
            ready = proc.exchange(b"", timeout=limit)
            if ready.strip() == READY:
                line = proc.exchange(run.request(), timeout=limit)
        except ExecTimeout:
            pass
        return run.report(ready, line, ended(proc, line is not None))


__all__ = [
    "COMPARES", "JUDGE_IMAGE", "LANGUAGES", "IOCase", "IORun", "arun_io_tests",
    "extract_program", "is_io_tests", "language_name", "normalize_io_tests", "run_io_tests",
]
