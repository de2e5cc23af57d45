"""One completion, one row's tests, one verdict: what the reward functions, the TRL
environment and ``CodegenEnv`` share (docs/grading.md).

A row's tests are either Python snippets (``assert f(2) == 4``, HumanEval's
``check``), judged by :func:`corral.rl.code.arun_tests`, or stdin/stdout cases, judged
by :func:`corral.rl.stdio.arun_io_tests` (:func:`corral.rl.stdio.is_io_tests` tells
which). :func:`score` turns a report into a reward, never scoring "not gradable" as 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from corral.client._async._sandbox import AsyncSandbox
from corral.client._sync import Sandbox
from corral.errors import InvalidArgument
from corral.rl._grading import Grading
from corral.rl._prestart import Prestarted
from corral.rl._test_report import TestReport
from corral.rl.code import (
    Fallback,
    arun_prestarted,
    arun_tests,
    extract_code,
    normalize_tests,
    run_tests,
)
from corral.rl.stdio import (
    DEFAULT_MEMORY_MB,
    DEFAULT_TIME_LIMIT,
    JUDGE_IMAGE,
    Compare,
    IOCase,
    IORun,
    arun_io_tests,
    extract_program,
    is_io_tests,
    language_name,
    normalize_io_tests,
    run_io_tests,
)

Mode = Literal["binary", "fraction", "first_failure"]
MODES = ("binary", "fraction", "first_failure")
IO_SANDBOX_MEMORY_MB = 1536
"""A stdin/stdout run's sandbox: room for a compiler (javac, rustc) and the program."""


@dataclass(frozen=True)
class JudgeOptions:
    """How a row is judged (the reward function's settings)."""

    timeout: float | None = None
    test_timeout: float | None = None
    grading: Grading = "auto"
    fallback: Fallback = "none"
    language: str | None = None
    time_limit: float = DEFAULT_TIME_LIMIT
    case_memory_mb: int = DEFAULT_MEMORY_MB
    compare: Compare = "tokens"
    tolerance: float = 1e-6
    stop_on_failure: bool = False


@dataclass(frozen=True)
class Task:
    """What one completion is judged on."""

    code: str
    language: str
    snippets: list[str] | None = None
    cases: list[IOCase] | None = None
    entry_point: str | None = None
    checker: Mapping[str, Any] | None = None
    chosen: bool = False
    """The completion chose the language (no ``language`` from the row or the reward)."""

    @property
    def io(self) -> bool:
        return self.cases is not None


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise InvalidArgument(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")


def parse_tests(tests: Any, where: str) -> list[str] | list[IOCase]:
    """A row's tests, checked now (a bad row fails before any sandbox starts)."""
    if is_io_tests(tests):
        return normalize_io_tests(tests, where=where)
    return normalize_tests(tests, where=where)


def make_task(
    completion: Any, tests: list[str] | list[IOCase], options: JudgeOptions, *,
    entry_point: str | None = None, checker: Mapping[str, Any] | None = None,
    language: str | None = None,
) -> Task | None:
    """The code to judge, or ``None`` when the completion has none. Python tests take
    the last Python fence; stdin/stdout tests the last fence of any judge language
    (``language``, the row's or the reward's, restricts it)."""
    io = bool(tests) and isinstance(tests[0], IOCase)
    lang = language or options.language
    if not io:
        code = extract_code(completion, fallback=options.fallback)
        if code is None:
            return None
        return Task(code, "python", snippets=list(tests), entry_point=entry_point)  # type: ignore[arg-type]
    found = extract_program(completion, language=lang)
    if found is None and options.fallback == "raw":
        from corral.rl.code import completion_text

        found = (completion_text(completion), language_name(lang or "python"))
    if found is None:
        return None
    return Task(found[0], found[1], cases=list(tests), checker=checker,  # type: ignore[arg-type]
                chosen=lang is None)


def sandbox_needs(task_io: bool, image: str | None, memory_mb: int) -> tuple[str, int]:
    """The image and memory of a completion's sandbox."""
    if not task_io:
        return image or "python", memory_mb
    return image or JUDGE_IMAGE, max(memory_mb, IO_SANDBOX_MEMORY_MB)


def run_timeout(task: Task, options: JudgeOptions) -> float:
    if options.timeout is not None:
        return options.timeout
    if not task.io:
        return 10.0
    run = IORun(task.code, task.language, task.cases or [], options.time_limit,
                options.case_memory_mb)
    return run.default_timeout()


async def ajudge(sb: AsyncSandbox, task: Task, options: JudgeOptions, mode: Mode, *,
                 fresh: bool = False) -> TestReport:
    """Judge ``task`` inside ``sb`` (``fresh``: just created, nothing run in it yet)."""
    timeout = run_timeout(task, options)
    if not task.io:
        return await arun_tests(
            sb, task.snippets, code=task.code, timeout=timeout,
            test_timeout=options.test_timeout, grading=options.grading,
            entry_point=task.entry_point, fresh=fresh,
        )
    report = await arun_io_tests(
        sb, task.cases, code=task.code, language=task.language,
        time_limit=options.time_limit, memory_mb=options.case_memory_mb,
        compare=options.compare, tolerance=options.tolerance, checker=task.checker,
        stop_on_failure=options.stop_on_failure or mode != "fraction", timeout=timeout,
        fresh=fresh,
    )
    return chosen_toolchain_missing(task, report)


async def ajudge_prestarted(sb: AsyncSandbox, judge: Prestarted, task: Task,
                            options: JudgeOptions, *, delete_first: bool = False) -> TestReport:
    """Judge a Python ``task`` with ``judge``, a judge already waiting in ``sb``, in one
    request that deletes ``sb`` too (``delete_first``: before the reply; else right
    after it). With ``grading="auto"``, a report that
    :func:`~corral.rl.code.needs_in_process` is to be judged again in a fresh sandbox."""
    _, proc = judge.bind(sb.client)
    return await arun_prestarted(
        proc, judge.ready, task.snippets, code=task.code, timeout=run_timeout(task, options),
        test_timeout=options.test_timeout, grading=options.grading,
        entry_point=task.entry_point, delete_first=delete_first,
    )


NO_TOOLCHAIN = "is not installed in this image"  # corral/guest/io_judge.py's NoToolchain


def chosen_toolchain_missing(task: Task, report: TestReport) -> TestReport:
    """A language the image cannot run is not gradable (``IE``, reward ``None``) when the
    task asked for it; chosen by the completion, it is a compile error (``CE``, 0): else
    a wrong answer in a language the image lacks would be spared its 0."""
    if not (task.chosen and report.status == "ok" and report.load == "error"
            and report.compile_error is None and NO_TOOLCHAIN in (report.load_error or "")):
        return report
    why = f"{report.load_error}: the completion chose {task.language}"
    n = len(report.verdicts)
    return replace(report, load_error=why, compile_error=why, tests=["error"] * n,
                   errors=[f"CE: {why}"] * n, verdict_list=("CE",) * n)


def score(report: TestReport, mode: Mode) -> float | None:
    """The reward of a report: ``None`` if any test was not gradable."""
    if report.status == "ok" and report.ungradable:
        return None
    if mode == "fraction":
        return report.fraction
    if mode == "first_failure":
        if report.status != "ok" or not report.tests:
            return float(report.all_passed)
        verdicts = report.verdicts
        passed = next((i for i, v in enumerate(verdicts) if v != "AC"), len(verdicts))
        return passed / len(verdicts)
    return float(report.all_passed)


def judge_file(
    sb: Sandbox, tests: list[str] | list[IOCase], path: str, *, timeout: float,
    test_timeout: float | None = None, grading: Grading = "auto",
    entry_point: str | None = None, language: str | None = None,
) -> TestReport:
    """The tests on the solution file at ``path`` in ``sb`` (the multi-step envs):
    stdin/stdout cases are judged on its text, in ``language`` (default: by suffix)."""
    if tests and isinstance(tests[0], IOCase):
        code = sb.files.read(path).decode(errors="replace")
        return run_io_tests(sb, tests, code=code, language=language or path.rsplit(".", 1)[-1])
    return run_tests(sb, tests, path=path, timeout=timeout, test_timeout=test_timeout,  # type: ignore[arg-type]
                     grading=grading, entry_point=entry_point)
