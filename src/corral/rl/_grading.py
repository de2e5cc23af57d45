"""Isolated grading, the host's side: start the judge, hand it the request, read its
verdict (the judge itself, which runs in the sandbox, is :mod:`corral.guest.judge`).

The exchange, all over one interactive process (``sb.spawn``):

1. ``python3 -I -c <judge>`` starts, makes itself non-dumpable, stops every other
   process of the sandbox, forks the solution process and prints ``READY``;
2. only then the request goes to its stdin: solution, tests, limits and a nonce;
3. it answers one line: the nonce and its report.

Nothing about the tests exists in the sandbox before step 2, and after step 1 nothing
in the sandbox but the judge can read its stdin or write its stdout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Literal

from corral.client._async._process import AsyncProcess
from corral.client._models import CommandResult, parse_exec
from corral.client._sync._process import Process
from corral.errors import ExecTimeout, InvalidArgument
from corral.guest import program
from corral.rl._inprocess import MAX_ERROR_CHARS, MAX_OUTPUT_CHARS, time_budget
from corral.rl._test_report import TestReport

Grading = Literal["auto", "isolated", "in_process"]
GRADINGS = ("auto", "isolated", "in_process")
READY = "corral-judge-ready"
TRUSTED_PATH = "/usr/local/bin:/usr/bin:/bin"
"""``PATH`` of the judge and the harness: only the image's own directories, which the
sandbox cannot write (its ``~/.local/bin`` comes first in its usual ``PATH``)."""
END_WAIT_S = 5.0
EXIT_LOOKS_S = (0.0, 0.01)
"""Pauses before each look at a judge's record for its exit, after its verdict."""
"""How long a judge that answered may take to exit by itself before it is killed."""
UNSPLITTABLE = "unsplittable"
UNGRADABLE = "ungradable"


def judge_argv(*, warm: bool = False) -> list[str]:
    """The judge's command line (what it judges comes later, on its stdin). ``warm``: a
    pre-started judge, which imports the modules tests and solutions use most before it
    says READY (``WARM_MODULES`` in :mod:`corral.guest.judge`)."""
    source = program("confine", "judge_wire", "judge_solution", "judge")
    return ["python3", "-I", "-c", source, *(["warm"] if warm else [])]


def check_grading(grading: str) -> None:
    if grading not in GRADINGS:
        raise InvalidArgument(
            f"grading must be one of {', '.join(map(repr, GRADINGS))}, got {grading!r} "
            "(docs/grading.md explains the difference)"
        )


@dataclass(frozen=True)
class JudgeRun:
    """One judged run: what to start, what to send, how to read what came back."""

    tests: list[str]
    code: str | None = None
    path: str | None = None
    timeout: float = 10.0
    test_timeout: float | None = None
    entry_point: str | None = None
    nonce: str = field(default_factory=lambda: "corral-verdict-" + secrets.token_hex(16))

    def __post_init__(self) -> None:
        if (self.code is None) == (self.path is None):
            raise InvalidArgument("give the solution as code= or as path=, not both")

    @property
    def argv(self) -> list[str]:
        return judge_argv()

    def request(self) -> bytes:
        filename = self.path if self.path is not None else "solution.py"
        module = os.path.splitext(os.path.basename(filename))[0] or "solution"
        body = {
            "nonce": self.nonce, "code": self.code, "filename": filename, "module": module,
            "tests": self.tests, "budget": time_budget(self.timeout),
            "test_timeout": self.test_timeout, "max_error": MAX_ERROR_CHARS,
            "max_output": MAX_OUTPUT_CHARS, "entry_point": self.entry_point,
        }
        return json.dumps(body).encode() + b"\n"

    def report(self, ready: str | None, line: str | None, result: CommandResult | None) -> TestReport:
        """The verdict. ``ready``/``line``: what the judge answered (``None``: nothing
        within the time); ``result``: how its process ended."""
        if result is not None and result.oom_killed:
            return TestReport("oom", result=result)
        if line is None or ready is None or (result is not None and result.timed_out):
            return TestReport("timeout", result=result)
        if ready.strip() != READY or not line.startswith(self.nonce):
            return TestReport("crashed", result=result)
        try:
            data = json.loads(line[len(self.nonce):])
            load, tests = data["load"], data["tests"]
            states = [str(t[0]) for t in tests]
            errors = [None if t[1] is None else str(t[1]) for t in tests]
            # Tests that compared two of the solution's objects: its process said how.
            compared = tuple(i for i, t in enumerate(tests) if len(t) > 2 and t[2] is True)
        except (ValueError, KeyError, TypeError, IndexError):
            return TestReport("crashed", result=result)
        if len(states) != len(self.tests):
            return TestReport("crashed", result=result)
        return TestReport(
            "ok", load=load[0], load_error=load[1], tests=states, errors=errors,
            output=str(data.get("output") or ""), result=result,
            grading="in_process" if compared else "isolated", in_process_tests=compared,
        )


async def aended(proc: AsyncProcess, answered: bool) -> CommandResult:
    """How the judge ended. One that answered exits by itself (waited for: no signal, a
    request fewer); one that did not is killed. A judge exits right after its verdict,
    so its record usually says so already: one plain request then, instead of opening
    its output stream (the stream stays the way when it still runs or left output)."""
    if answered:
        for pause in EXIT_LOOKS_S:
            await asyncio.sleep(pause)
            info = await proc.refresh()
            result = info.get("result")
            if info.get("state") != "running":
                if result is not None and not info.get("unread_bytes"):
                    ended = parse_exec(result, args=proc.args, sandbox_id=proc.sandbox_id,
                                       timeout=None)
                    proc._result = ended  # it exited: closing it then sends no kill
                    return ended
                break
        try:
            return await proc.wait(timeout=END_WAIT_S)
        except ExecTimeout:
            pass
    return await proc.kill()


def ended(proc: Process, answered: bool) -> CommandResult:
    """The blocking twin of :func:`aended`."""
    if answered:
        try:
            return proc.wait(timeout=END_WAIT_S)
        except ExecTimeout:
            pass
    return proc.kill()


def unsplittable(report: TestReport) -> list[int]:
    """The tests the judge could not run outside the solution's process."""
    return [i for i, t in enumerate(report.tests) if t == UNSPLITTABLE]


def refuse_unsplittable(report: TestReport) -> TestReport:
    """``grading="isolated"``: a test that cannot be judged in isolation is reported
    not gradable (never scored as a failure)."""
    tests = [UNGRADABLE if t == UNSPLITTABLE else t for t in report.tests]
    errors = [
        f"not graded: {e}; this test needs grading='auto' or 'in_process' "
        "(it passes objects that are not plain data to the solution)"
        if t == UNSPLITTABLE else e
        for t, e in zip(report.tests, report.errors, strict=True)
    ]
    return dataclasses.replace(report, tests=tests, errors=errors)


def merge_in_process(report: TestReport, indices: list[int], inproc: TestReport) -> TestReport:
    """``grading="auto"``: the unsplittable tests' outcomes from an in-process run."""
    tests, errors = list(report.tests), list(report.errors)
    for k, i in enumerate(indices):
        if inproc.status == "ok" and k < len(inproc.tests):
            tests[i], errors[i] = inproc.tests[k], inproc.errors[k]
        else:
            tests[i], errors[i] = "error", f"in-process run: {inproc.reason}"
    flagged = tuple(sorted(set(indices) | set(report.in_process_tests)))
    return dataclasses.replace(
        report, tests=tests, errors=errors, grading="in_process", in_process_tests=flagged
    )
