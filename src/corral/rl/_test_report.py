"""The result of running tests on a solution: :class:`TestReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from corral.client._models import CommandResult


@dataclass(frozen=True)
class TestReport:
    """How one solution did on its tests inside a sandbox.

    ``status`` is ``"ok"`` (the judge reported), ``"timeout"`` (the whole run went over
    its time and was killed), ``"oom"`` (killed for memory) or ``"crashed"`` (no
    report: e.g. the solution killed the judge). Each test's outcome in ``tests`` is
    ``"ok"``, ``"error"`` (an exception; its traceback in ``errors``), ``"timeout"``,
    ``"skipped"`` (the solution itself did not load) or ``"ungradable"`` (the judge
    cannot grade it, ``errors`` says why: never counted as a failure, a reward is
    ``None``). :attr:`verdicts` gives the judge's letters (``AC``, ``WA``...).

    ``grading`` says how the verdict was reached (docs/grading.md): ``"isolated"`` —
    every test ran in a judge process the solution cannot reach, on plain data the
    solution returned; ``"in_process"`` — the tests listed in ``in_process_tests`` ran
    inside the solution's own process (they pass objects that are not plain data to
    it), where a hostile solution can forge their result.
    """

    __test__ = False  # not a pytest test class, despite the name

    status: Literal["ok", "timeout", "oom", "crashed"]
    load: Literal["ok", "error", "timeout", "not run"] = "not run"
    load_error: str | None = None
    tests: list[str] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    output: str = ""
    result: CommandResult | None = None
    grading: Literal["isolated", "in_process"] = "isolated"
    in_process_tests: tuple[int, ...] = ()

    verdict_list: tuple[str, ...] = ()
    """Per-test verdicts from the stdin/stdout judge (``AC``, ``WA``, ``PE``, ``PC``,
    ``TLE``, ``MLE``, ``RE``, ``CE``, ``IE``, ``SKIP``); empty for Python tests (see
    :attr:`verdicts`)."""
    compile_error: str | None = None
    """The compiler's message (bounded) when the solution did not compile (``CE``)."""
    case_stats: tuple[tuple[float, int], ...] = ()
    """stdin/stdout judge: ``(cpu_seconds, peak_bytes)`` of each test case's run."""
    case_scores: tuple[float, ...] = ()
    """stdin/stdout judge: each case's credit in [0, 1] (1 ``AC``; between 0 and 1 a
    checker's partial credit, ``PC``); :attr:`fraction` is their mean when given."""

    @property
    def verdicts(self) -> list[str]:
        """One judge verdict per test: ``AC`` accepted, ``WA`` wrong answer (a failed
        ``assert``), ``RE`` another exception, ``TLE``, ``MLE``, ``CE`` (did not compile
        or load), ``IE`` not gradable, ``SKIP`` not run."""
        if self.verdict_list:
            return list(self.verdict_list)
        return [_verdict(t, e, self.load) for t, e in zip(self.tests, self.errors, strict=True)]

    @property
    def ungradable(self) -> list[int]:
        """Tests the judge could not grade (their reason in :attr:`errors`)."""
        return [i for i, v in enumerate(self.verdicts) if v == "IE"]

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
        if len(self.case_scores) == len(self.tests):
            return sum(self.case_scores) / len(self.tests)
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
        if self.ungradable:
            i = self.ungradable[0]
            return f"not gradable: test {i}: {_last_line(self.errors[i])}"
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



def _verdict(state: str, error: str | None, load: str) -> str:
    if state == "ok":
        return "AC"
    if state == "timeout":
        return "TLE"
    if state == "ungradable":
        return "IE"
    if state == "skipped":
        return "CE" if load == "error" else "TLE" if load == "timeout" else "SKIP"
    if error and "AssertionError" in _last_line(error):
        return "WA"
    return "RE"


def _last_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"
