"""Code-execution rewards for TRL's ``GRPOTrainer`` (``reward_funcs=``).

TRL calls a reward function as ``f(prompts=..., completions=..., completion_ids=...,
**columns)`` where ``columns`` are the dataset's other columns, one value per
completion, and expects one ``float`` (or ``None``: "not applicable / unknown") per
completion back. A sync function is called on the training thread; an async one
(``async def __call__``) on TRL's own event loop, concurrently with the other async
reward functions.

::

    from corral.rl import code_reward

    reward = code_reward("fraction", timeout=10)       # dataset column "tests"
    trainer = GRPOTrainer(model=..., reward_funcs=[reward], train_dataset=dataset)

Each completion gets ONE FRESH sandbox, created for it and deleted afterwards, so
nothing one completion does reaches another; at most ``concurrency`` run at once.
Creating a sandbox costs a few milliseconds (the daemon keeps warm slots); with
``prestart=N`` a pool of sandboxes whose judge already started waits for the
completions (each still used once), so a reward pays neither the create nor Python's
start-up (docs/grading.md).

Scores:

- ``mode="binary"``: 1.0 if every test passes, else 0.0;
  ``mode="fraction"``: the fraction of the tests passed.
- No code found in the completion (see :func:`corral.rl.code.extract_code`): 0.0.
- A timeout (the whole run, the solution's top level, or a test): what passed before
  counts, the rest is 0; the reason is logged (``logging`` name ``corral.rl.rewards``).
- ``None`` when a test is not gradable (verdict ``IE``: a built-in the solution
  redefines with no ``entry_point`` to say which is meant, a broken checker, a missing
  toolchain; docs/grading.md), logged with the reason.
- ``None`` when the infrastructure failed (daemon down, sandbox could not start, no
  capacity, sandbox lost): never 0.0, which would teach the policy that its code was
  wrong. TRL leaves ``None`` out of the reward (NaN) instead. Before that, a completion
  whose sandbox could not be had or went away with its node (a daemon or Ray node gone,
  no room) is run again on a new sandbox, up to ``retries`` times: on a Ray cluster
  (``CORRAL_URL=ray://``) that is on another node, since placement stops choosing a
  dead one.

The tests of each completion come from the dataset column named by ``tests_column``
(default ``"tests"``): a list of Python snippets (``["assert f(2) == 4", ...]``) or one
string (an empty list means "the code must run without an exception"), or stdin/stdout
cases (``[{"input": ..., "output": ...}]``, :mod:`corral.rl.stdio`), judged in any of
seven languages on the ``judge`` image with per-case ``time_limit`` and
``case_memory_mb``; ``mode="first_failure"`` scores the cases passed before the first
failure. Optional columns ``entry_point``, ``checker`` and ``language`` reach the judge.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio

from corral._bridge import run_sync
from corral.client._async._client import AsyncClient
from corral.client._async._sandbox import AsyncSandbox
from corral.client._models import spec_body
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DaemonUnavailable,
    ImageNotFound,
    InvalidArgument,
    SandboxLost,
    SandboxNotFound,
    SandboxProtocolError,
    SandboxStartError,
)
from corral.rl._grading import Grading, check_grading
from corral.rl._judging import (
    JudgeOptions,
    Mode,
    Task,
    ajudge,
    ajudge_prestarted,
    check_mode,
    make_task,
    parse_tests,
    run_timeout,
    sandbox_needs,
    score,
)
from corral.rl._prestart import JudgePool
from corral.rl._reward_types import RewardOutcome, RewardStats
from corral.rl._wandb import log_metrics
from corral.rl.code import Fallback, needs_in_process
from corral.rl.episodes import (  # "the machinery failed", shared with episodes
    DEFAULT_RETRIES,
    INFRA_ERRORS,
    RETRY_BACKOFF_S,
)
from corral.rl.stdio import COMPARES, DEFAULT_TIME_LIMIT, Compare, IOCase

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 512
SANDBOX_LIFETIME_MARGIN_S = 120.0
"""A reward's sandbox lives at most its timeout plus this: if this process dies between
create and delete, the daemon still removes it."""
RETRIED: tuple[type[CorralError], ...] = (
    SandboxLost, DaemonUnavailable, CapacityExceeded, SandboxStartError,
)
"""Infrastructure failures a completion is run again for, on a new sandbox (elsewhere
on a cluster): its node or daemon went away, or it got no sandbox. The other
:data:`INFRA_ERRORS` (its sandbox stopped or timed out under it) score ``None`` at once:
what its own code may have caused is not paid for again."""


def default_concurrency() -> int:
    """Sandboxes evaluated at once by default: four per core. A run is mostly CPU (~30 ms
    of Python start-up and tests), which two per core already saturate, but a batch
    from a policy also holds code that loops until its timeout, only waiting: on 2 cores,
    a mixed batch (examples/reward_batch.py, 9 of 64 looping) scored 16 completions/s
    at 8 against 10 at 4; without loops both gave 32."""
    return max(2, 4 * (os.cpu_count() or 1))


class AsyncCodeReward:
    """An async TRL reward function that runs each completion's code in a fresh sandbox.

    Build it with :func:`async_code_reward` (or :func:`code_reward` for the blocking
    twin). TRL sees an ``async def __call__`` and runs it on its event loop, in parallel
    with the other async reward functions; ``__name__`` is what TRL logs the reward as.
    """

    def __init__(
        self,
        mode: Mode = "binary",
        *,
        timeout: float | None = None,
        test_timeout: float | None = None,
        image: str | None = None,
        concurrency: int | None = None,
        tests_column: str = "tests",
        memory_mb: int = DEFAULT_MEMORY_MB,
        cpus: float | None = None,
        fallback: Fallback = "none",
        url: str | None = None,
        tags: Sequence[str] = (),
        name: str | None = None,
        on_result: Callable[[RewardOutcome], Any] | None = None,
        grading: Grading = "auto",
        retries: int = DEFAULT_RETRIES,
        language: str | None = None,
        time_limit: float = DEFAULT_TIME_LIMIT,
        case_memory_mb: int = 256,
        compare: Compare = "tokens",
        tolerance: float = 1e-6,
        wandb: bool = True,
        prestart: int = 0,
    ) -> None:
        check_grading(grading)
        self.wandb = bool(wandb)  # log each batch's metrics to an open W&B run
        check_mode(mode)
        if compare not in COMPARES:
            raise InvalidArgument(f"compare must be one of {COMPARES}, got {compare!r}")
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise InvalidArgument(f"retries must be an integer >= 0, got {retries!r}")
        self.retries = retries
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0
        ):
            raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
        if test_timeout is not None and not test_timeout > 0:
            raise InvalidArgument(f"test_timeout must be positive or None, got {test_timeout!r}")
        concurrency = default_concurrency() if concurrency is None else concurrency
        if not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidArgument(f"concurrency must be a positive integer, got {concurrency!r}")
        if fallback not in ("none", "raw"):
            raise InvalidArgument(f"fallback must be 'none' or 'raw', got {fallback!r}")
        self.mode: Mode = mode
        self.timeout = None if timeout is None else float(timeout)
        self.image, self.memory_mb = image, memory_mb
        self.options = JudgeOptions(
            timeout=self.timeout, test_timeout=test_timeout, grading=grading,
            fallback=fallback, language=language, time_limit=time_limit,
            case_memory_mb=case_memory_mb, compare=compare, tolerance=tolerance,
        )
        self.test_timeout = test_timeout
        self.grading: Grading = grading
        self.concurrency = concurrency
        self.tests_column = tests_column
        self.fallback: Fallback = fallback
        self.url = url
        self.on_result = on_result
        self.__name__ = name or f"code_reward_{mode}"
        # Validated now, so a typo fails at construction rather than at step 1.
        self._spec = spec_body({
            "image": image or "python", "memory_mb": memory_mb, "cpus": cpus,
            "timeout": (self.timeout or DEFAULT_TIMEOUT_S) + SANDBOX_LIFETIME_MARGIN_S,
            "tags": ["corral.rl", f"reward={self.__name__}", *tags],
        })
        self.stats = RewardStats()
        self.last_outcomes: list[RewardOutcome] = []
        if not isinstance(prestart, int) or isinstance(prestart, bool) or prestart < 0:
            raise InvalidArgument(f"prestart must be an integer >= 0, got {prestart!r}")
        self.prestart_size = prestart if grading != "in_process" else 0
        self._pool = JudgePool(self._spec, self.timeout or DEFAULT_TIMEOUT_S,
                               SANDBOX_LIFETIME_MARGIN_S) if self.prestart_size else None
        self._refill: asyncio.Task[int] | None = None

    # ------------------------------------------------------------------ TRL API

    async def __call__(
        self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (), **kwargs: Any
    ) -> list[float | None]:
        tests = self._tests_from(kwargs, len(completions))
        outcomes = await self.evaluate(completions, tests, columns=kwargs)
        return [o.reward for o in outcomes]

    # ------------------------------------------------------------------ direct use

    async def evaluate(
        self,
        completions: Sequence[Any],
        tests: Sequence[Any],
        *,
        on_result: Callable[[RewardOutcome], Any] | None = None,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> list[RewardOutcome]:
        """Score ``completions[i]`` against ``tests[i]``; outcomes in input order.

        ``on_result`` (default: the one given at construction) is called with each
        outcome as soon as it is known (completion order, not input order), e.g. to
        print progress or log the code that was run. ``columns``: the dataset's other
        columns, one value per completion; ``entry_point`` (the task's function name,
        HumanEval's), ``checker`` and ``language`` are read from them when present.
        """
        on_result = on_result or self.on_result
        if len(tests) != len(completions):
            raise InvalidArgument(
                f"got {len(completions)} completions but {len(tests)} test lists: "
                "give one list of tests per completion"
            )
        snippets = [parse_tests(t, f"{self.tests_column}[{i}]") for i, t in enumerate(tests)]
        extras = [_row_extras(columns or {}, i) for i in range(len(completions))]
        semaphore = asyncio.Semaphore(self.concurrency)
        async with AsyncClient(self.url) as client:

            results: list[RewardOutcome | None] = [None] * len(completions)

            async def one(i: int) -> None:
                async with semaphore:
                    outcome = await self._score(client, i, completions[i], snippets[i], extras[i])
                if on_result is not None:
                    on_result(outcome)
                results[i] = outcome

            # A task group, not gather: if one evaluation raises (a configuration error),
            # the others are cancelled and delete their sandboxes before the client closes.
            # (anyio's: asyncio.TaskGroup is Python 3.11+.)
            try:
                async with anyio.create_task_group() as group:
                    for i in range(len(completions)):
                        group.start_soon(one, i)
            except BaseExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
        if self._pool is not None and (self._refill is None or self._refill.done()):
            self._refill = asyncio.get_running_loop().create_task(self._fill())
        outcomes = [r for r in results if r is not None]
        self.last_outcomes = outcomes
        if self.wandb:
            self._log_batch(outcomes)
        return outcomes

    async def prestart(self) -> int:
        """Start judges until ``prestart`` wait, and wait for that (a reward refills in
        the background after each batch by itself); returns how many wait."""
        return await self._fill()

    async def _fill(self) -> int:
        if self._pool is None:
            return 0
        async with AsyncClient(self.url) as client:
            return await self._pool.fill(client, self.prestart_size, self.concurrency)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_refill": None}  # the pool copies itself empty

    async def aclose(self) -> None:  # the blocking twin's is close()
        """Delete the pre-started judges' sandboxes (else the daemon ends them within
        their lifetime, ``corral.rl._prestart.MAX_IDLE_S`` plus the run's timeout)."""
        refill = self._refill
        if refill is not None and refill.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([refill])  # what it starts is deleted below, not lost
        if self._pool is not None:
            async with AsyncClient(self.url) as client:
                await self._pool.drain(client)

    def _log_batch(self, outcomes: Sequence[RewardOutcome]) -> None:
        """One batch's metrics to an open W&B run, at the trainer's current step."""
        scored = [o.reward for o in outcomes if o.reward is not None]
        prefix = f"corral/{self.__name__}/"
        log_metrics({
            prefix + "reward_mean": sum(scored) / len(scored) if scored else math.nan,
            prefix + "completions": len(outcomes),
            prefix + "infra_failures": len(outcomes) - len(scored),
            prefix + "timeouts": self.stats.timeouts,
            prefix + "infra_retries": self.stats.infra_retries,
            prefix + "sandboxes_created": self.stats.sandboxes_created,
        }, commit=False)

    def _tests_from(self, kwargs: dict[str, Any], n: int) -> Sequence[Any]:
        if self.tests_column not in kwargs:
            columns = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric"))
            raise InvalidArgument(
                f"{self.__name__}: the dataset has no {self.tests_column!r} column (columns: "
                f"{columns}); add one with each prompt's tests, or pass tests_column= to name it"
            )
        tests = kwargs[self.tests_column]
        if len(tests) != n:
            raise InvalidArgument(
                f"{self.__name__}: {len(tests)} values in column {self.tests_column!r} "
                f"for {n} completions"
            )
        return tests

    async def _score(
        self, client: AsyncClient, i: int, completion: Any, tests: list[str] | list[IOCase],
        extras: dict[str, Any],
    ) -> RewardOutcome:
        start = time.monotonic()
        self.stats.completions += 1
        task = make_task(completion, tests, self.options, **extras)
        code = task.code if task is not None else None
        if task is None:
            self.stats.no_code += 1
            log.debug("%s: completion %d has no code: reward 0.0", self.__name__, i)
            return RewardOutcome(i, 0.0, "no code found in the completion")
        failures: list[str] = []
        for attempt in range(1, self.retries + 2):
            if attempt > 1:
                self.stats.infra_retries += 1
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 2))
            outcome = await self._attempt(client, i, task, start, attempt == 1)
            if isinstance(outcome, RewardOutcome):
                return replace(outcome, attempts=attempt)
            exc, sandbox_id = outcome
            failures.append(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, RETRIED):
                break
            log.info("%s: completion %d attempt %d: %s", self.__name__, i, attempt, failures[-1])
        self.stats.infra_failures += 1
        log.warning("%s: completion %d not evaluated (%s): reward None",
                    self.__name__, i, "; ".join(failures))
        return RewardOutcome(
            i, None, f"infrastructure: {type(exc).__name__}", code=code, sandbox_id=sandbox_id,
            infra_error=str(exc), duration=time.monotonic() - start, attempts=len(failures),
        )

    async def _attempt(
        self, client: AsyncClient, i: int, task: Task, start: float, first: bool = True
    ) -> RewardOutcome | tuple[CorralError, str | None]:
        """One sandbox's try: the outcome, or the infrastructure failure and the sandbox
        it hit."""
        sb: AsyncSandbox | None = None
        live: AsyncSandbox | None = None  # the sandbox to delete after
        code = task.code
        image, memory_mb = sandbox_needs(task.io, self.image, self.memory_mb)
        spec = {**self._spec, "image": image, "memory_mb": memory_mb,
                "timeout": run_timeout(task, self.options) + SANDBOX_LIFETIME_MARGIN_S}
        judge = self._pool.take() if self._pool is not None and first and not task.io else None
        try:
            if judge is not None:  # made for no other completion, waiting at READY
                sb = live = AsyncSandbox(judge.sandbox, client=client)
                self.stats.prestarted += 1
                self.stats.sandboxes_created += 1
                report = await ajudge_prestarted(sb, judge, task, self.options,
                                                 delete_first=self._pool.delete_first)
                live = None  # the verdict's request deleted it
                self.stats.sandboxes_deleted += 1
                if needs_in_process(report):  # "auto": judged again, the usual way
                    judge = None
            if judge is None:
                sb = live = await AsyncSandbox.create(client=client, **spec)
                self.stats.sandboxes_created += 1
                report = await ajudge(sb, task, self.options, self.mode, fresh=True)
        except ImageNotFound:
            raise  # a configuration error: every completion would fail the same way
        except SandboxProtocolError as exc:  # the completion broke its sandbox: it fails
            log.info("%s: completion %d broke its sandbox: reward 0.0 (%s)", self.__name__, i, exc)
            return RewardOutcome(i, 0.0, exc.message, code=code, sandbox_id=sb.id if sb else None,
                                 duration=time.monotonic() - start)
        except INFRA_ERRORS as exc:
            if judge is not None and isinstance(exc, SandboxNotFound):  # gone while it
                exc = SandboxLost(f"a pre-started judge's sandbox was gone: {exc}")  # waited
            return exc, sb.id if sb else None
        finally:
            if live is not None:
                await self._delete(live)
        reward = score(report, self.mode)
        if reward is None:
            self.stats.ungradable += 1
            log.warning("%s: completion %d is not gradable (%s): reward None",
                        self.__name__, i, report.reason)
        elif report.timed_out:
            self.stats.timeouts += 1
            log.info("%s: completion %d: %s: reward %.3g", self.__name__, i, report.reason, reward)
        if report.grading == "in_process":
            self.stats.in_process_graded += 1
            if self.stats.in_process_graded == 1 and self.grading == "auto":
                log.warning(
                    "%s: tests %s of completion %d pass objects that are not plain data to the "
                    "solution, so they ran in its own process, where a hostile solution can "
                    "forge their result (docs/grading.md); grading='isolated' fails them instead",
                    self.__name__, list(report.in_process_tests), i,
                )
        return RewardOutcome(
            i, reward, report.reason, code=code, report=report, sandbox_id=sb.id,
            duration=time.monotonic() - start,
        )

    async def _delete(self, sb: AsyncSandbox) -> None:
        try:
            await sb.delete()
            self.stats.sandboxes_deleted += 1
        except CorralError as exc:  # the daemon reaps it at the end of its lifetime
            log.warning("%s: could not delete sandbox %s: %s", self.__name__, sb.id, exc)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.__name__} mode={self.mode} "
            f"timeout={'auto' if self.timeout is None else format(self.timeout, 'g') + 's'} "
            f"concurrency={self.concurrency}>"
        )


class CodeReward(AsyncCodeReward):
    """The blocking twin of :class:`AsyncCodeReward`: TRL calls it on its training
    thread; inside, the completions still run concurrently (up to ``concurrency``)."""

    def __call__(  # type: ignore[override]
        self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (), **kwargs: Any
    ) -> list[float | None]:
        tests = self._tests_from(kwargs, len(completions))
        return [o.reward for o in self.evaluate(completions, tests, columns=kwargs)]

    def evaluate(  # type: ignore[override]
        self,
        completions: Sequence[Any],
        tests: Sequence[Any],
        *,
        on_result: Callable[[RewardOutcome], Any] | None = None,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> list[RewardOutcome]:
        """Blocking :meth:`AsyncCodeReward.evaluate` (``on_result`` is called on a
        worker thread when this thread already runs an event loop)."""
        return run_sync(super().evaluate(completions, tests, on_result=on_result, columns=columns))

    def prestart(self) -> int:  # type: ignore[override]
        """Blocking :meth:`AsyncCodeReward.prestart`."""
        return run_sync(super().prestart())

    def close(self) -> None:
        """Blocking :meth:`AsyncCodeReward.aclose`."""
        run_sync(super().aclose())


def code_reward(
    mode: Mode = "binary",
    *,
    timeout: float | None = None,
    test_timeout: float | None = None,
    image: str | None = None,
    concurrency: int | None = None,
    tests_column: str = "tests",
    memory_mb: int = DEFAULT_MEMORY_MB,
    cpus: float | None = None,
    fallback: Fallback = "none",
    url: str | None = None,
    tags: Sequence[str] = (),
    name: str | None = None,
    on_result: Callable[[RewardOutcome], Any] | None = None,
    grading: Grading = "auto",
    retries: int = DEFAULT_RETRIES,
    language: str | None = None,
    time_limit: float = DEFAULT_TIME_LIMIT,
    case_memory_mb: int = 256,
    compare: Compare = "tokens",
    tolerance: float = 1e-6,
    wandb: bool = True,
    prestart: int = 0,
) -> CodeReward:
    """A blocking TRL reward function scoring code completions in fresh sandboxes.

    ``mode``: ``"binary"`` (all tests pass → 1.0), ``"fraction"`` (tests passed /
    tests) or ``"first_failure"`` (tests passed before the first failure / tests).
    ``timeout``: seconds for one completion's whole run (default: 10 for Python tests,
    enough to compile and run every case for stdin/stdout tests; ``test_timeout``: per
    Python test). stdin/stdout rows also take ``language``, ``time_limit`` (CPU
    seconds a case), ``case_memory_mb``, ``compare`` and ``tolerance``
    (docs/grading.md). ``concurrency``: sandboxes at once (default four per core). ``tests_column``:
    the dataset column with each row's tests. ``fallback="raw"`` scores the whole
    completion as code when it has no ``<answer>`` tag or code fence. ``url``: the
    daemon (default: ``CORRAL_URL`` or the local one). ``name``: what TRL logs the
    reward as (default ``code_reward_<mode>``). ``on_result``: called with each
    :class:`RewardOutcome` as it is known (to log the code run and why it scored so).
    ``grading``: how the verdict is reached (docs/grading.md): ``"auto"`` (default)
    judges every test outside the completion's process where it can, ``"isolated"``
    always (a test that cannot be split that way fails), ``"in_process"`` never.
    ``retries``: how many times a completion whose sandbox could not be had or went away
    (node or daemon lost, no room) is run again on a new one before it scores ``None``.
    ``wandb``: with a W&B run open (``wandb.init()``), each batch's metrics are logged
    to it (``corral/<name>/reward_mean``, ``infra_failures``, ``timeouts``...) at the
    trainer's current step; ``False`` keeps them out. ``prestart``: judges kept started
    in fresh sandboxes, each waiting for one completion (refilled after each batch, in
    the background; :meth:`~CodeReward.prestart` fills now, :meth:`~CodeReward.close`
    deletes them), so a completion pays neither the create nor Python's start-up
    (docs/grading.md); ``0``, the default, starts each one when its completion comes.

    >>> reward = code_reward("fraction", timeout=5)
    >>> reward(prompts=["p"], completions=["```python\\ndef f(x): return 2*x\\n```"],
    ...        tests=[["assert f(2) == 4", "assert f(3) == 7"]])   # doctest: +SKIP
    [0.5]
    """
    return CodeReward(
        mode, timeout=timeout, test_timeout=test_timeout, image=image, concurrency=concurrency,
        tests_column=tests_column, memory_mb=memory_mb, cpus=cpus, fallback=fallback, url=url,
        tags=tags, name=name, on_result=on_result, grading=grading, retries=retries,
        language=language, time_limit=time_limit, case_memory_mb=case_memory_mb,
        compare=compare, tolerance=tolerance,
        wandb=wandb, prestart=prestart,
    )


def async_code_reward(
    mode: Mode = "binary",
    *,
    timeout: float | None = None,
    test_timeout: float | None = None,
    image: str | None = None,
    concurrency: int | None = None,
    tests_column: str = "tests",
    memory_mb: int = DEFAULT_MEMORY_MB,
    cpus: float | None = None,
    fallback: Fallback = "none",
    url: str | None = None,
    tags: Sequence[str] = (),
    name: str | None = None,
    on_result: Callable[[RewardOutcome], Any] | None = None,
    grading: Grading = "auto",
    retries: int = DEFAULT_RETRIES,
    language: str | None = None,
    time_limit: float = DEFAULT_TIME_LIMIT,
    case_memory_mb: int = 256,
    compare: Compare = "tokens",
    tolerance: float = 1e-6,
    wandb: bool = True,
    prestart: int = 0,
) -> AsyncCodeReward:
    """Like :func:`code_reward`, as an async reward function (TRL runs it on its event
    loop, concurrently with the other async reward functions)."""
    return AsyncCodeReward(
        mode, timeout=timeout, test_timeout=test_timeout, image=image, concurrency=concurrency,
        tests_column=tests_column, memory_mb=memory_mb, cpus=cpus, fallback=fallback, url=url,
        tags=tags, name=name, on_result=on_result, grading=grading, retries=retries,
        language=language, time_limit=time_limit, case_memory_mb=case_memory_mb,
        compare=compare, tolerance=tolerance,
        wandb=wandb, prestart=prestart,
    )


ROW_EXTRAS = ("entry_point", "checker", "language")


def _row_extras(columns: Mapping[str, Sequence[Any]], i: int) -> dict[str, Any]:
    """A row's ``entry_point``, ``checker`` and ``language`` columns, where present."""
    out: dict[str, Any] = {}
    for name in ROW_EXTRAS:
        values = columns.get(name)
        if values is not None and i < len(values) and values[i]:
            out[name] = values[i]
    return out
