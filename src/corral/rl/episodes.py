"""Run many episodes, each in a sandbox of its own, and get their records as they end.

An episode is a function ``episode(sandbox, seed) -> result`` (plain, or ``async``):
it gets a running sandbox (fresh from an image, restored from a snapshot, or taken
from a warm pool) and returns a reward, a dict (``reward``/``return``, ``steps``,
``digest``, anything else), or any JSON-able value. The runner keeps ``concurrency``
episodes in flight, bounds each one's wall time, deletes every sandbox afterwards
(in the background: a worker starts its next episode meanwhile, with at most
``concurrency`` deletes in flight, all done before the run ends; one that fails is
tried again at the run's end, and :attr:`EpisodeRunner.undeleted` names any still
left), and yields an
:class:`EpisodeResult` per episode, fastest first::

    def episode(sb: corral.Sandbox, seed: int) -> dict:
        r = sb.exec(["python3", "rollout.py", str(seed)], timeout=60)
        return corral.rl.parse_json_line(r.stdout)

    for rec in corral.rl.run_episodes(episode, range(200), snapshot=snap, concurrency=16):
        print(rec.seed, rec.status, rec.reward, rec.attempts)

Failures are told apart, because an RL job must never score a broken machine as a bad
policy:

- ``ok``: the episode returned. ``error``: it raised, or its command failed (the
  policy's doing: a result, never retried). ``timeout``: it ran past ``timeout``
  seconds, or raised a :class:`TimeoutError` (also a result).
- ``infra_error``: the sandbox could not be had, or was lost under the episode
  (:data:`INFRA_ERRORS`: the daemon unreachable or full, the sandbox killed or deleted
  from outside, ...). Such an attempt is retried on a new sandbox up to ``retries``
  times; ``attempts`` counts them. Only when every attempt failed so is the episode
  reported ``infra_error``, with ``reward=None``: never a zero.
- A sandbox that broke its own engine (:class:`~corral.errors.SandboxProtocolError`:
  forged or malformed frames from its agent, an agent that hangs up or stops answering,
  a sandbox ended with a ``"sandbox fault: ..."`` reason) is the policy's doing: an
  ``error`` (``timeout`` if a command's timeout had to be enforced from outside), never
  retried. Otherwise a policy could turn every failing episode into a retry.

A configuration error (an unknown image or snapshot, an invalid spec, a bad token)
fails the same way for every episode, so it is raised at once instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import anyio
import anyio.to_thread

import corral
from corral._bridge import iterate_sync
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DaemonUnavailable,
    InternalError,
    InvalidArgument,
    InvalidState,
    SandboxLost,
    SandboxNotFound,
    SandboxStartError,
    SandboxTimeout,
    is_sandbox_fault,
)
from corral.rl._cleanup import delete_again
from corral.rl._progress import EpisodeProgress
from corral.rl._script import (
    DEFAULT_EPISODE_TIMEOUT_S,
    EpisodeError,
    EpisodeTimeout,
    ScriptEpisode,
    parse_json_line,
)

__all__ = [
    "INFRA_ERRORS",
    "EpisodeError",
    "EpisodeResult",
    "EpisodeRunner",
    "EpisodeStatus",
    "EpisodeTimeout",
    "ScriptEpisode",
    "arun_episodes",
    "is_infrastructure_error",
    "parse_json_line",
    "run_episodes",
    "sandbox_lost",
]

logger = logging.getLogger("corral.rl")

DEFAULT_CONCURRENCY = 8
DEFAULT_RETRIES = 2
RETRY_BACKOFF_S = 0.2
DELETE_TRIES = 3  # a sandbox whose delete failed is tried again this often at the run's end
LIFETIME_MARGIN_S = 300.0
"""Added to the episode timeout for a sandbox's lifetime: if this process dies, the
daemon still stops its sandboxes soon after."""

INFRA_ERRORS: tuple[type[CorralError], ...] = (
    SandboxLost, SandboxStartError, DaemonUnavailable, CapacityExceeded, InternalError,
    SandboxTimeout, SandboxNotFound, InvalidState,
)
"""Errors of the machinery, not of the episode: the attempt is retried on a new sandbox.
(``SandboxNotFound`` / ``InvalidState`` here mean the sandbox was deleted or stopped
under the episode; ``SandboxTimeout`` that its lifetime ran out.) Never
:class:`~corral.errors.SandboxProtocolError`: a sandbox that broke its engine is the
policy's error, and it is deliberately not a subclass of any of these."""


def is_infrastructure_error(exc: BaseException) -> bool:
    """True if ``exc`` is a failure of the sandbox machinery (:data:`INFRA_ERRORS`)."""
    return isinstance(exc, INFRA_ERRORS)


class EpisodeStatus(str, Enum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    INFRA_ERROR = "infra_error"


@dataclass(frozen=True, kw_only=True)
class EpisodeResult:
    """One episode's record.

    ``reward`` is the episode's return (``None`` unless ``status`` is ``ok`` and the
    episode reported one); ``value`` is what the episode function returned; ``digest``
    identifies the trajectory: the one the episode reported (``digest``), else a
    SHA-256 of its ``trajectory``, else of the whole value, so "same seed, same
    trajectory" is one comparison. Timings are of the last attempt: ``queue_s`` from
    the run's start until a worker took the episode, ``create_s`` getting its sandbox,
    ``run_s`` the episode function; ``total_s`` covers every attempt.
    """

    index: int
    seed: Any
    status: EpisodeStatus
    reward: float | None = None
    steps: int | None = None
    digest: str | None = None
    value: Any = None
    error: str | None = None
    sandbox_id: str | None = None
    attempts: int = 1
    queue_s: float = 0.0
    create_s: float = 0.0
    run_s: float = 0.0
    total_s: float = 0.0
    infra_errors: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.status is EpisodeStatus.OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        d["infra_errors"] = list(self.infra_errors)
        return d


# ------------------------------------------------------------------ results


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    return value


def _canonical(value: Any) -> bytes:
    return json.dumps(_jsonable(value), sort_keys=True, separators=(",", ":"),
                      default=repr).encode()


def _digest(value: Any) -> str:
    """A short SHA-256 of ``value`` as canonical JSON (16 hex digits)."""
    return hashlib.sha256(_canonical(value)).hexdigest()[:16]


def _number(x: Any) -> float | None:
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _interpret(value: Any) -> tuple[float | None, int | None, str]:
    """(reward, steps, digest) from what an episode function returned."""
    if isinstance(value, Mapping):
        reward = _number(value.get("reward", value.get("return")))
        steps = value.get("steps")
        digest = value.get("digest")
        if not isinstance(digest, str):
            digest = _digest(value.get("trajectory", value))
        return reward, steps if isinstance(steps, int) else None, digest
    return _number(value), None, _digest(value)


async def sandbox_lost(sb: corral.AsyncSandbox) -> str | None:
    """Why ``sb`` is no longer usable (deleted, stopped, failed), or None if it runs
    or was ended by its own doing (a ``"sandbox fault: ..."`` reason: the policy's).

    A command that died by a signal may be the policy's doing (a segfault) or the
    machine's (the sandbox was stopped under it): this tells them apart.
    """
    try:
        info = await sb.refresh()
    except SandboxNotFound:
        return f"sandbox {sb.id} was deleted during the episode"
    except CorralError as exc:
        return f"sandbox {sb.id} could not be checked: {exc.message}"
    if info.state in (corral.SandboxState.RUNNING, corral.SandboxState.PAUSED):
        return None
    if is_sandbox_fault(info.reason):
        return None  # the sandbox broke its engine: the policy's doing, not a loss
    reason = f" ({info.reason})" if info.reason else ""
    return f"sandbox {sb.id} ended during the episode: {info.state.value}{reason}"


# ------------------------------------------------------------------ runner

EpisodeFn = Callable[[Any, Any], Any]
_DONE = object()  # the last worker's end, in the results queue


def _endpoint_args(client: Any) -> tuple[str | None, str | None]:
    """(url, token) to build another client to the same daemon; url ``None`` keeps the
    SDK's default resolution (and so its embedded daemon)."""
    if client is None:
        return None, None
    args = client.connect_args
    return args["url"], args["token"]


class EpisodeRunner:
    """Runs episodes on sandboxes from one source; see the module docstring.

    Exactly one source: ``image`` (a fresh sandbox per episode; the default image if
    none is given), ``snapshot`` (a :class:`~corral.Snapshot`, its id or name:
    restored per episode, so every episode starts from the same files, shared, not
    copied) or ``pool`` (a :class:`~corral.Pool` / :class:`~corral.AsyncPool`).
    ``sandbox`` holds further keyword arguments of ``Sandbox.create`` (``memory_mb``,
    ``cpus``, ``env``, ...) for the first two. Use :func:`run_episodes` /
    :func:`arun_episodes` rather than this class unless you run several batches.
    """

    def __init__(
        self,
        episode: EpisodeFn,
        *,
        image: str | None = None,
        snapshot: Any = None,
        pool: Any = None,
        sandbox: Mapping[str, Any] | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout: float | None = DEFAULT_EPISODE_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        tags: Iterable[str] = (),
        client: Any = None,
    ) -> None:
        if not callable(episode):
            raise InvalidArgument(f"episode must be a function (sandbox, seed) -> result, got {episode!r}")
        if sum(x is not None for x in (image, snapshot, pool)) > 1:
            raise InvalidArgument("give one sandbox source: image=, snapshot= or pool=")
        if pool is not None and sandbox:
            raise InvalidArgument("a pool's sandboxes have the pool's spec: drop sandbox= or pool=")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidArgument(f"concurrency must be a positive integer, got {concurrency!r}")
        if not isinstance(retries, int) or retries < 0:
            raise InvalidArgument(f"retries must be an integer >= 0, got {retries!r}")
        if timeout is not None and timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0 seconds (or None), got {timeout!r}")
        self.episode = episode
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self._pool = pool
        self._snapshot = None if snapshot is None else str(getattr(snapshot, "id", snapshot))
        self._spec = dict(sandbox or {})
        if image is not None:
            self._spec["image"] = image
        if timeout is not None and pool is None:
            self._spec.setdefault("timeout", timeout + LIFETIME_MARGIN_S)
        self._tags = list(tags)
        self._is_async = inspect.iscoroutinefunction(episode) or inspect.iscoroutinefunction(
            type(episode).__call__)
        self._user_client = client
        self._aclient: corral.AsyncClient | None = None
        self._sclient: corral.Client | None = None
        self._threads: anyio.CapacityLimiter | None = None
        self._deleting: set[asyncio.Task[None]] = set()
        self._delete_slots: asyncio.Semaphore | None = None
        self._undeleted: dict[str, corral.AsyncSandbox] = {}  # deletes to try again
        self.sandboxes_created = 0
        """Sandboxes this runner got (created, restored or acquired), all attempts."""

    # -------------------------------------------------------------- plumbing

    def _async_client(self) -> corral.AsyncClient:
        if isinstance(self._user_client, corral.AsyncClient):
            return self._user_client
        if self._aclient is None:
            url, token = _endpoint_args(self._user_client)
            self._aclient = corral.AsyncClient(url, token=token)
        return self._aclient

    def _sync_client(self) -> corral.Client:
        if isinstance(self._user_client, corral.Client):
            return self._user_client
        if self._sclient is None:
            url, token = _endpoint_args(self._user_client or self._aclient)
            self._sclient = corral.Client(url, token=token)
        return self._sclient

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        # A blocking episode that overran its timeout is abandoned (its thread runs on
        # until its sandbox's deletion fails its call) and frees its slot.
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(self.concurrency)
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=self._threads)

    async def aclose(self) -> None:
        """Close the clients and threads this runner made (not the caller's)."""
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None
        if self._sclient is not None:
            self._sclient.close()
            self._sclient = None

    async def __aenter__(self) -> EpisodeRunner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------ sandboxes

    async def _acquire(self, run_tag: str) -> corral.AsyncSandbox:
        client = self._async_client()
        if self._pool is not None:
            if inspect.iscoroutinefunction(self._pool.acquire):
                return await self._pool.acquire()
            sb = await self._blocking(self._pool.acquire)
            return corral.AsyncSandbox(sb.info, client=client)
        tags = [*self._tags, *self._spec.get("tags", ()), run_tag]
        spec = {**self._spec, "tags": tags}
        if self._snapshot is not None:
            spec["snapshot"] = self._snapshot
        return await corral.AsyncSandbox.create(client=client, **spec)

    async def _release(self, sb: corral.AsyncSandbox) -> None:
        try:
            await asyncio.shield(sb.delete())
        except SandboxNotFound:
            pass  # gone already (deleted from outside, or its lifetime ran out)
        except CorralError as exc:  # the run's end tries again (_sweep)
            logger.warning("could not delete sandbox %s (tried again at the run's end): %s",
                           sb.id, exc)
            self._undeleted[sb.id] = sb

    async def _release_soon(self, sb: corral.AsyncSandbox) -> None:
        """Delete ``sb`` while the worker goes on to its next sandbox: a delete is a
        round trip and a teardown nothing waits for. At most ``concurrency`` deletes
        are in flight (a worker waits for a place), and the run ends only once every
        one did (:meth:`_drain`), so no sandbox outlives its run."""
        if self._delete_slots is None:
            self._delete_slots = asyncio.Semaphore(self.concurrency)
        slots = self._delete_slots
        try:
            await slots.acquire()
        except BaseException:  # the run stopped meanwhile: a pool's sandbox has no sweep
            await self._release(sb)
            raise
        task = asyncio.ensure_future(self._release(sb))
        self._deleting.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._deleting.discard(t)
            slots.release()

        task.add_done_callback(done)

    async def _drain(self) -> None:
        """Wait for the deletes :meth:`_release_soon` started."""
        while self._deleting:
            await asyncio.gather(*self._deleting, return_exceptions=True)

    @property
    def undeleted(self) -> list[str]:
        """Ids of sandboxes this runner could not delete, even at its runs' ends
        (:data:`DELETE_TRIES` times): empty unless the daemon kept refusing."""
        return sorted(self._undeleted)

    async def _sweep(self, run_tag: str) -> None:
        """Delete what a run left (a create whose reply was lost still made one)."""
        # failed deletes first, a pool's too (no tag sweep finds them)
        await delete_again(self._undeleted, DELETE_TRIES, RETRY_BACKOFF_S)
        if self._pool is not None:
            return
        try:
            client = self._async_client()
            left = await corral.AsyncSandbox.list(tags=[run_tag], client=client)
            await asyncio.gather(*(sb.delete() for sb in left), return_exceptions=True)
        except CorralError as exc:
            logger.warning("could not clean up the sandboxes tagged %s: %s", run_tag, exc)

    # -------------------------------------------------------------- episode

    async def _call(self, sb: corral.AsyncSandbox, seed: Any) -> tuple[EpisodeStatus, Any, str | None]:
        """Run the episode function once; (status, value, error)."""
        if isinstance(self.episode, ScriptEpisode):
            call: Awaitable[Any] = self.episode.arun(sb, seed)
        elif self._is_async:
            call = self.episode(sb, seed)
        else:
            view = corral.Sandbox(sb.info, client=self._sync_client())
            call = self._blocking(self.episode, view, seed)
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
        except BaseException:
            task.cancel()
            raise
        if not done:
            task.cancel()
            return EpisodeStatus.TIMEOUT, None, f"the episode ran past its {self.timeout:g} s timeout"
        exc = task.exception()
        if exc is None:
            return EpisodeStatus.OK, task.result(), None
        message = f"{type(exc).__name__}: {exc}"
        if is_infrastructure_error(exc):
            return EpisodeStatus.INFRA_ERROR, None, message
        if not isinstance(exc, Exception):
            raise exc
        lost = await sandbox_lost(sb)
        if lost is not None:  # e.g. a command killed because its sandbox was stopped
            return EpisodeStatus.INFRA_ERROR, None, f"{lost}; the episode saw {message}"
        if isinstance(exc, TimeoutError):
            return EpisodeStatus.TIMEOUT, None, message
        return EpisodeStatus.ERROR, None, message

    async def _episode(self, index: int, seed: Any, started: float, run_tag: str) -> EpisodeResult:
        t_slot = time.perf_counter()
        queue_s = t_slot - started
        infra: list[str] = []
        create_s = run_s = 0.0
        sandbox_id: str | None = None
        for attempt in range(1, self.retries + 2):
            if attempt > 1:
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 2))
            t0 = time.perf_counter()
            try:
                sb = await self._acquire(run_tag)
            except CorralError as exc:
                if not is_infrastructure_error(exc):
                    raise  # configuration: every episode would fail the same way
                infra.append(f"{type(exc).__name__}: {exc.message}")
                continue
            self.sandboxes_created += 1
            sandbox_id = sb.id
            t1 = time.perf_counter()
            create_s = t1 - t0
            try:
                status, value, error = await self._call(sb, seed)
            except BaseException:
                await self._release(sb)
                raise
            finally:
                run_s = time.perf_counter() - t1
            await self._release_soon(sb)
            if status is EpisodeStatus.INFRA_ERROR:
                infra.append(error or "")
                logger.info("episode %s (seed %r) attempt %d: %s", index, seed, attempt, error)
                continue
            reward = steps = digest = None
            if status is EpisodeStatus.OK:
                reward, steps, digest = _interpret(value)
            return EpisodeResult(
                index=index, seed=seed, status=status, reward=reward, steps=steps,
                digest=digest, value=value, error=error, sandbox_id=sandbox_id,
                attempts=attempt, queue_s=queue_s, create_s=create_s, run_s=run_s,
                total_s=time.perf_counter() - t_slot, infra_errors=tuple(infra))
        return EpisodeResult(
            index=index, seed=seed, status=EpisodeStatus.INFRA_ERROR, error=infra[-1],
            sandbox_id=sandbox_id, attempts=self.retries + 1, queue_s=queue_s,
            create_s=create_s, run_s=run_s, total_s=time.perf_counter() - t_slot,
            infra_errors=tuple(infra))

    async def run(
        self, seeds: Iterable[Any] | int, *, progress: bool | EpisodeProgress = False,
    ) -> AsyncIterator[EpisodeResult]:
        """Run one episode per item of ``seeds`` (an int ``n``: ``range(n)``); yield the
        records as they end. Leaving the loop early stops the run and deletes its
        sandboxes (use ``contextlib.aclosing`` to have that happen at once)."""
        if isinstance(seeds, int):
            seeds = range(seeds)
        total = len(seeds) if hasattr(seeds, "__len__") else None  # type: ignore[arg-type]
        items = enumerate(iter(seeds))
        run_tag = f"episodes={secrets.token_hex(6)}"
        results: asyncio.Queue[Any] = asyncio.Queue()
        started = time.perf_counter()

        n_workers = max(1, min(self.concurrency, total or self.concurrency))
        running = [n_workers]

        async def worker() -> None:
            try:
                for index, seed in items:  # shared: next() never awaits, so no race
                    await results.put(await self._episode(index, seed, started, run_tag))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                results.put_nowait(exc)
            finally:
                running[0] -= 1
                if running[0] == 0:
                    results.put_nowait(_DONE)

        workers = [asyncio.create_task(worker()) for _ in range(n_workers)]
        bar = progress if isinstance(progress, EpisodeProgress) else None
        own_bar = None
        if progress is True:
            own_bar = bar = EpisodeProgress(total, enabled=True)
            own_bar.__enter__()
        try:
            while (item := await results.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                if bar is not None:
                    bar.advance(item.status.value)
                yield item
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await self._drain()
            await self._sweep(run_tag)
            if own_bar is not None:
                own_bar.__exit__(None, None, None)


async def arun_episodes(
    episode: EpisodeFn, seeds: Iterable[Any] | int, *, progress: bool = False, **options: Any
) -> AsyncIterator[EpisodeResult]:
    """Run ``episode(sandbox, seed)`` for every seed; yield :class:`EpisodeResult` as
    they end. ``options`` are those of :class:`EpisodeRunner` (``image``, ``snapshot``,
    ``pool``, ``sandbox``, ``concurrency``, ``timeout``, ``retries``, ``tags``,
    ``client``). An ``async def`` episode gets an :class:`~corral.AsyncSandbox`; a
    plain function runs on a thread with a :class:`~corral.Sandbox`.

    >>> async for rec in corral.rl.arun_episodes(episode, range(100), image="rl"):
    ...     print(rec.seed, rec.status.value, rec.reward)
    """
    runner = EpisodeRunner(episode, **options)
    try:
        async for result in runner.run(seeds, progress=progress):
            yield result
    finally:
        await runner.aclose()


def run_episodes(
    episode: EpisodeFn, seeds: Iterable[Any] | int, *, progress: bool = False, **options: Any
) -> Iterator[EpisodeResult]:
    """The blocking :func:`arun_episodes`: an iterator of records as they end.

    The run happens on a background event loop; breaking out of the loop (or an
    exception, or Ctrl-C) stops it and deletes its sandboxes before this returns.
    Arguments are checked at once.
    """
    runner = EpisodeRunner(episode, **options)
    return iterate_sync(
        lambda: runner.run(seeds, progress=progress), cleanup=runner.aclose
    )

