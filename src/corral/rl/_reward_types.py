"""What a code reward reports per completion and over its life (corral.rl.rewards)."""

from __future__ import annotations

from dataclasses import dataclass

from corral.rl.code import TestReport


@dataclass(frozen=True)
class RewardOutcome:
    """What happened to one completion: its reward and why.

    ``reward`` is ``None`` only for infrastructure failures (``infra_error`` says
    which). ``code`` is what was extracted from the completion and run (``None`` if
    nothing was found); ``report`` the test harness's account (``None`` if nothing ran).
    """

    index: int
    reward: float | None
    reason: str
    code: str | None = None
    report: TestReport | None = None
    sandbox_id: str | None = None
    infra_error: str | None = None
    duration: float = 0.0
    attempts: int = 1
    """Sandboxes it took: more than one when an infrastructure failure was retried."""

    @property
    def timed_out(self) -> bool:
        return self.report is not None and self.report.timed_out

    @property
    def verdicts(self) -> list[str]:
        """The judge's verdict per test (``AC``, ``WA``, ``TLE``, ``MLE``, ``RE``, ``CE``,
        ``IE``: not gradable, ``SKIP``); empty if nothing ran."""
        return self.report.verdicts if self.report is not None else []


@dataclass
class RewardStats:
    """Counters over the life of one reward function (read them to see what ran)."""

    completions: int = 0
    sandboxes_created: int = 0
    sandboxes_deleted: int = 0
    no_code: int = 0
    timeouts: int = 0
    infra_failures: int = 0
    infra_retries: int = 0
    """Completions run again on a new sandbox after an infrastructure failure."""
    in_process_graded: int = 0
    """Completions with tests run in the solution's own process (docs/grading.md)."""
    ungradable: int = 0
    """Completions with a test the judge could not grade: reward ``None``, reason logged."""
    prestarted: int = 0
    """Completions judged by a pre-started judge (``prestart=``; counted in
    ``sandboxes_created`` too)."""
