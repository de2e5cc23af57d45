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

Tests (:func:`run_tests`): a test is a snippet of Python, typically ``assert f(2) == 4``
or a HumanEval ``check(candidate)``; it reads the names the solution defines as if it
ran after it in its namespace, and the solution is importable as a module (``from
solution import f``). Each test is isolated from the others' exceptions and may have
its own time limit, so one endless loop costs that test, not the whole report.

The verdict is decided where the solution cannot reach it (docs/grading.md): a judge
process, unreachable from the solution, runs the tests; every call into the solution
crosses a pipe to the solution's own process and comes back as plain data through a
strict decoder (an object whose ``__eq__`` always answers True cannot cross). The tests
and expected values never enter the solution's process, its disk, argv or environment.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from corral.client._async._process import AsyncProcess
from corral.client._async._sandbox import AsyncSandbox
from corral.client._models import CommandResult
from corral.client._sync import Sandbox
from corral.errors import ExecTimeout, InvalidArgument
from corral.rl._grading import (
    END_WAIT_S,
    READY,
    TRUSTED_PATH,
    Grading,
    JudgeRun,
    aended,
    check_grading,
    ended,
    merge_in_process,
    refuse_unsplittable,
    unsplittable,
)
from corral.rl._inprocess import (
    MAX_ERROR_CHARS,
    MAX_OUTPUT_CHARS,
    harness_request,
    parse_report,
)
from corral.rl._test_report import TestReport

TRUSTED_ENV = {"PATH": TRUSTED_PATH}

PYTHON_FENCE_LANGS = frozenset({"", "python", "py", "python3"})
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.S)

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


def clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters: its head and its tail (where the
    traceback ends), with a note of what was cut in between."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


def render_result(result: CommandResult, limit: int) -> str:
    """A command's result as an agent reads it: how it ended, then its output (a
    stream the daemon cut shows where: its head, a note, its tail)."""
    if result.timed_out:
        head = f"timed out after {result.timeout:g}s and was killed"
    elif result.oom_killed:
        head = "killed: out of memory"
    else:
        head = f"exit code {result.returncode}"
    stdout, stderr = _output_text(result, "stdout"), _output_text(result, "stderr")
    stderr = f"[stderr]\n{stderr}" if stderr else ""
    return clip(f"{head}\n{stdout}{stderr}", limit)


def _output_text(result: CommandResult, name: Literal["stdout", "stderr"]) -> str:
    if not getattr(result, f"{name}_truncated"):
        return getattr(result, name)
    head, tail = (part.decode(errors="replace") for part in result.head_and_tail(name))
    dropped = getattr(result, f"{name}_dropped")
    return f"{head}\n... [{dropped} bytes of {name} left out] ...\n{tail}"

# ------------------------------------------------------------------------ running


async def arun_tests(
    sb: AsyncSandbox,
    tests: Tests,
    *,
    code: str | None = None,
    path: str | None = None,
    timeout: float = 10.0,
    test_timeout: float | None = None,
    cwd: str | None = None,
    grading: Grading = "auto",
    entry_point: str | None = None,
    fresh: bool = False,
) -> TestReport:
    """Run ``tests`` on a solution (``code``, or the file at ``path`` in the sandbox).

    ``timeout`` bounds the whole run (the judge is killed after it: status
    ``"timeout"``); ``test_timeout`` each test. ``grading`` (docs/grading.md):
    ``"isolated"`` judges every test outside the solution's process; ``"auto"`` (the
    default) does too, and runs the few tests that pass non-plain objects to the
    solution inside its process, flagged in :attr:`TestReport.grading`;
    ``"in_process"`` runs all of them there (the weaker, older way). A judged run
    stops every other process of the sandbox first (from outside, then the judge itself
    does; ``fresh=True`` — the sandbox was just created from an image and has run
    nothing — skips the first, a request to the daemon). Sandbox and daemon failures raise
    their :mod:`corral.errors` exception: they are not the solution's fault.

    Built-in names a test uses are the judge's, never the solution's, except
    ``entry_point`` (the task's function, e.g. HumanEval's ``def max``) and what a test
    imports from the solution; a test that uses a built-in the solution redefines is
    reported not gradable (``"ungradable"``, verdict ``IE``).
    """
    snippets = normalize_tests(tests)
    check_grading(grading)
    if grading == "in_process":
        return await _arun_in_process(sb, snippets, code, path, timeout, test_timeout, cwd)
    run = JudgeRun(snippets, code=code, path=path, timeout=timeout, test_timeout=test_timeout,
                   entry_point=entry_point)
    if not fresh:  # nothing an earlier step left running may meet the judge
        await sb.kill_processes()
    async with await sb.spawn(run.argv, timeout=timeout, cwd=cwd, env=TRUSTED_ENV) as proc:
        ready = None
        try:
            ready = await proc.exchange(b"", timeout=timeout)
        except ExecTimeout:
            pass
        report = await _averdict(proc, run, ready)
    return await _after_judge(sb, report, snippets, grading, code, path, timeout, test_timeout, cwd)


async def arun_prestarted(
    proc: AsyncProcess,
    ready: str,
    tests: Tests,
    *,
    code: str,
    timeout: float = 10.0,
    test_timeout: float | None = None,
    grading: Grading = "auto",
    entry_point: str | None = None,
    delete_first: bool = True,
) -> TestReport:
    """:func:`arun_tests` on a judge already started in a fresh sandbox that has run
    nothing else (``proc``, which answered ``ready``: :mod:`corral.rl._prestart`), in
    ONE request that also deletes the sandbox (``proc.consume``; ``delete_first=False``:
    the reply does not wait for the deletion): the request, the verdict, the judge's
    exit. ``grading`` is ``"auto"`` or ``"isolated"``; with
    ``"auto"``, tests the judge could not split stay ``"unsplittable"`` in the report
    (:func:`needs_in_process`): the sandbox is gone, so the caller judges the completion
    again the usual way (a fresh sandbox, :func:`arun_tests`)."""
    snippets = normalize_tests(tests)
    check_grading(grading)
    if grading == "in_process":
        raise InvalidArgument("a pre-started judge grades in isolation: grading='in_process' "
                              "runs the tests in the solution's process instead")
    run = JudgeRun(snippets, code=code, timeout=timeout, test_timeout=test_timeout,
                   entry_point=entry_point)
    line, result = await proc.consume(run.request(), timeout=run.timeout,
                                      exit_timeout=END_WAIT_S, delete_first=delete_first)
    report = run.report(ready if ready.strip() == READY else None, line, result)
    if grading == "isolated" and needs_in_process(report):
        return refuse_unsplittable(report)
    return report


def needs_in_process(report: TestReport) -> bool:
    """Whether a judged report holds tests to run in the solution's process."""
    return report.status == "ok" and bool(unsplittable(report))


async def _averdict(proc: AsyncProcess, run: JudgeRun, ready: str | None) -> TestReport:
    """The request to a judge that said ``ready``, its verdict, how it ended."""
    line = None
    if ready is not None and ready.strip() == READY:
        try:
            line = await proc.exchange(run.request(), timeout=run.timeout)
        except ExecTimeout:
            pass
    return run.report(ready, line, await aended(proc, line is not None))


async def _after_judge(sb, report, snippets, grading, code, path, timeout, test_timeout, cwd):  # type: ignore[no-untyped-def]
    """The tests the judge could not split: refused, or run in the solution's process."""
    split = unsplittable(report)
    if not split or report.status != "ok":
        return report
    if grading == "isolated":
        return refuse_unsplittable(report)
    inproc = await _arun_in_process(
        sb, [snippets[i] for i in split], code, path, timeout, test_timeout, cwd
    )
    return merge_in_process(report, split, inproc)


def run_tests(
    sb: Sandbox,
    tests: Tests,
    *,
    code: str | None = None,
    path: str | None = None,
    timeout: float = 10.0,
    test_timeout: float | None = None,
    cwd: str | None = None,
    grading: Grading = "auto",
    entry_point: str | None = None,
    fresh: bool = False,
) -> TestReport:
    """The blocking twin of :func:`arun_tests`."""
    snippets = normalize_tests(tests)
    check_grading(grading)
    if grading == "in_process":
        return _run_in_process(sb, snippets, code, path, timeout, test_timeout, cwd)
    run = JudgeRun(snippets, code=code, path=path, timeout=timeout, test_timeout=test_timeout,
                   entry_point=entry_point)
    if not fresh:  # nothing an earlier step left running may meet the judge
        sb.kill_processes()
    with sb.spawn(run.argv, timeout=timeout, cwd=cwd, env=TRUSTED_ENV) as proc:
        ready = line = None
        try:
            ready = proc.exchange(b"", timeout=timeout)
            if ready.strip() == READY:
                line = proc.exchange(run.request(), timeout=timeout)
        except ExecTimeout:
            pass
        report = run.report(ready, line, ended(proc, line is not None))
    split = unsplittable(report)
    if not split or report.status != "ok":
        return report
    if grading == "isolated":
        return refuse_unsplittable(report)
    inproc = _run_in_process(sb, [snippets[i] for i in split], code, path, timeout, test_timeout, cwd)
    return merge_in_process(report, split, inproc)


async def _arun_in_process(sb, snippets, code, path, timeout, test_timeout, cwd) -> TestReport:  # type: ignore[no-untyped-def]
    argv, stdin, token = harness_request(
        snippets, code=code, path=path, timeout=timeout, test_timeout=test_timeout
    )
    await sb.kill_processes()  # e.g. what the solution left running in the judged run
    result = await sb.exec(argv, stdin=stdin, timeout=timeout, cwd=cwd, env=TRUSTED_ENV)
    return dataclasses.replace(
        parse_report(result, token, len(snippets)), grading="in_process",
        in_process_tests=tuple(range(len(snippets))),
    )


def _run_in_process(sb, snippets, code, path, timeout, test_timeout, cwd) -> TestReport:  # type: ignore[no-untyped-def]
    argv, stdin, token = harness_request(
        snippets, code=code, path=path, timeout=timeout, test_timeout=test_timeout
    )
    sb.kill_processes()  # e.g. what the solution left running in the judged run
    result = sb.exec(argv, stdin=stdin, timeout=timeout, cwd=cwd, env=TRUSTED_ENV)
    return dataclasses.replace(
        parse_report(result, token, len(snippets)), grading="in_process",
        in_process_tests=tuple(range(len(snippets))),
    )


__all__ = [
    "MAX_ERROR_CHARS", "MAX_OUTPUT_CHARS", "TestReport", "arun_prestarted", "arun_tests", "clip", "completion_text",
    "extract_code", "harness_request", "normalize_tests", "parse_report", "render_result",
    "run_tests",
]
