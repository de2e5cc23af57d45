"""Evaluate a policy: hundreds of seeded episodes in sandboxes, a mean with a CI back.

::

    result = corral.rl.evaluate("policy.py", "CartPole-v1", seeds=range(200))
    print(result.mean, result.ci, result.infra_failures)

How it runs:

1. The policy (code defining ``act(obs)``, or a weights file: see
   :class:`~corral.rl.Policy`), the env spec and a small runner script are written
   ONCE into a base sandbox, which is snapshotted, and then loads the policy and
   takes one step (a broken policy fails here, once, with its error): the episodes
   never see what the policy's code did to the base's files. Snapshots are
   content-addressed overlay layers: every episode's sandbox is restored from it and
   shares those files, nothing is copied per episode. Episodes import gymnasium and
   numpy from the image's byte-code; where the image has none (and its folders are
   read-only), a second check run compiles it into the snapshot.
2. Each episode is one ``python3 runner.py run SEED:K`` in its own restored sandbox
   (``episodes_per_sandbox`` > 1 runs several per sandbox, trading isolation for
   speed): policy and env in one process, one JSON record per episode, through the
   episode runner (:mod:`corral.rl.episodes`): bounded concurrency, timeouts, and
   retries of infrastructure failures only. Those are counted apart
   (``infra_failures``), never as a return. With ``prestart`` (default: for gymnasium
   envs, where the host can checkpoint) the snapshot is live instead, its runner
   already loaded and waiting, and each episode's sandbox gets its seeds on that
   runner's stdin (:mod:`corral.rl._eval_live`).
3. Records are cached on disk by (policy hash, env spec, seed, episode, corral
   version): evaluating an unchanged policy again runs no sandbox at all. Only for a
   deterministic policy: the first evaluation re-runs one episode in a second sandbox
   and compares the trajectories (see :mod:`corral.rl._cache`).
4. ``adaptive=True`` adds episodes in batches until the CI's half-width is at most
   ``target_halfwidth`` or a budget (episodes, seconds) is spent; batches are taken
   in seed order and each ends before the next starts, so which episodes are counted
   never depends on which sandbox was faster.

Episodes the policy failed (it raised, or timed out) are scored as ``on_error`` says:
by default (``"raise"``) the evaluation raises :class:`EpisodeErrors` instead of giving
a mean, because no default score is honest for every env: leaving them out keeps the
episodes the policy survived (a policy crashing in 16 of 30 CartPole episodes scored
21.2 on the other 14, 9.9 over all 30), and 0 is the best return there is in
MountainCar or Acrobot, and better than a loss at tic-tac-toe. ``"zero"`` (or a
number) scores them, ``"exclude"`` leaves them out; the result says which.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import corral
from corral._bridge import run_sync
from corral.errors import CorralError, InvalidArgument, SandboxLost
from corral.rl import _eval_live
from corral.rl._cache import (
    EpisodeCache,
    default_cache_path,
    episode_key,
    policy_key,
    same_trajectory,
)
from corral.rl._eval_options import (
    EvalOptions,
    parse_seeds,
)
from corral.rl._eval_report import EvalReporter, histogram
from corral.rl._eval_result import (
    EpisodeErrors,
    EvalEpisode,
    EvalResult,
    Key,
    SeedStats,
    error_scoring,
    eval_tag,
    parse_records,
)
from corral.rl._policy import CODE_FILE, WEIGHTS_FILE, EnvSpec, Policy
from corral.rl._progress import EpisodeProgress
from corral.rl._wandb import log_metrics
from corral.rl.episodes import (
    EpisodeError,
    EpisodeResult,
    EpisodeRunner,
    EpisodeStatus,
    _endpoint_args,
    is_infrastructure_error,
    sandbox_lost,
)
from corral.rl.stats import Summary, summarize

__all__ = ["EpisodeErrors", "EvalEpisode", "EvalOptions", "EvalResult", "SeedStats", "aevaluate",
           "evaluate", "parse_seeds"]

EVAL_DIR = "/workspace/.corral-eval"
RUNNER = f"{EVAL_DIR}/runner.py"
RUNNER_ENV = {
    # One core per sandbox: BLAS thread pools would only start threads and contend.
    "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}
# Only for an image whose modules have no byte-code where Python looks (read-only dirs
# without __pycache__): a second check run compiles what it imports into the snapshot.
# Not by default: the prefix hides the image's own byte-code, and compiling numpy and
# gymnasium again cost each CartPole evaluation ~0.5 s of CPU before its first episode.
PYCACHE_ENV = {"PYTHONPYCACHEPREFIX": f"{EVAL_DIR}/pycache"}
DEFAULT_SANDBOX = {"memory_mb": 512, "cpus": 1.0}
CHECK_TIMEOUT_S = 180.0
EXEC_MARGIN_S = 30.0
FAILED = ("error", "timeout")  # the policy's failures (infrastructure failures are apart)
MIN_ADAPTIVE_EPISODES = 10


def _plan(seeds: Iterable[int], per_seed: int) -> Iterator[Key]:
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidArgument(f"seeds must be integers >= 0, got {seed!r}")
        for k in range(per_seed):
            yield (seed, k)


class _Evaluation:
    """One evaluation's sandboxes: the base snapshot (made when first needed), the
    episode runner on it, and what they cost."""

    def __init__(self, policy: Policy, env: EnvSpec, *, client: Any, timeout: float,
                 concurrency: int, retries: int, per_sandbox: int,
                 sandbox: Mapping[str, Any], prestart: bool | None = None) -> None:
        self.policy, self.env, self.timeout = policy, env, timeout
        self.per_sandbox, self.retries, self.concurrency = per_sandbox, retries, concurrency
        self.spec = {**DEFAULT_SANDBOX, **sandbox}
        self.tag = eval_tag(policy.hash)
        self._user_client = client
        self._client: corral.AsyncClient | None = None
        self._snapshot: corral.AsyncSnapshot | None = None
        self._runner: EpisodeRunner | None = None
        self.base_sandboxes = 0
        self.runner_env = dict(RUNNER_ENV)
        # Pre-started runners (_eval_live): by default where the imports are the cost
        # (a gymnasium env: ~150 ms of CPU a sandbox). Not for tic-tac-toe: a fresh
        # runner costs its sandbox ~21 ms of CPU, and a restored sandbox cost 1.8x a
        # fresh one in all (daemon + sandbox + client, docs/performance.md).
        # ``served``: the runner's process id in the live snapshot.
        self.prestart = not env.is_tictactoe if prestart is None else prestart
        self.served: str | None = None

    @property
    def sandboxes_created(self) -> int:
        return self.base_sandboxes + (self._runner.sandboxes_created if self._runner else 0)

    def client(self) -> corral.AsyncClient:
        if isinstance(self._user_client, corral.AsyncClient):
            return self._user_client
        if self._client is None:
            url, token = _endpoint_args(self._user_client)
            self._client = corral.AsyncClient(url, token=token)
        return self._client

    def _files(self) -> dict[str, bytes]:
        job = {"env": {"id": self.env.id, "kwargs": dict(self.env.kwargs),
                       "max_steps": self.env.max_steps}, "timeout": self.timeout,
               "policy": {"kind": self.policy.kind, "module": CODE_FILE, "weights": WEIGHTS_FILE}}
        here = Path(__file__).parent
        files = {"runner.py": (here / "_eval_runner.py").read_bytes(),
                 "job.json": json.dumps(job).encode(), **dict(self.policy.files)}
        if self.env.is_tictactoe:
            files["tictactoe.py"] = (here / "envs" / "tictactoe.py").read_bytes()
        return files

    async def _make_snapshot(self) -> corral.AsyncSnapshot:
        """The base sandbox: files in, a check run, a snapshot; then it is deleted."""
        for attempt in range(self.retries + 1):
            try:
                spec = {**self.spec, "checkpointable": True} if self.prestart else self.spec
                base = await corral.AsyncSandbox.create(
                    image=self.env.image, tags=[self.tag], client=self.client(), **spec)
            except CorralError as exc:
                if not is_infrastructure_error(exc) or attempt == self.retries:
                    raise
                continue
            self.base_sandboxes += 1
            clean: corral.AsyncSnapshot | None = None
            try:
                for name, content in self._files().items():
                    await base.files.write(f"{EVAL_DIR}/{name}", content)
                # Before any of the policy's code runs: the check imports the policy,
                # which may rewrite the runner next to it (or plant a module), and a
                # snapshot taken after it would give every episode that runner
                # (tests/security/test_eval_check_rewrites_runner.py).
                clean = await base.snapshot()
                check = await self._check(base)
                if check.get("uncached") or self.prestart:
                    # what comes next runs in a copy of the clean files, not in the
                    # checked sandbox (a pre-started runner's policy process loads
                    # after the runner imported all it ever will)
                    await base.delete()
                    base = await corral.AsyncSandbox.create(
                        snapshot=clean, tags=[self.tag], client=self.client(), **spec)
                if check.get("uncached"):
                    # byte-code compiled by a run that makes the env, never the policy
                    self.runner_env = {**RUNNER_ENV, **PYCACHE_ENV}
                    r = await base.exec(["python3", RUNNER, "warm"], env=self.runner_env,
                                        cwd="/workspace", timeout=max(CHECK_TIMEOUT_S, self.timeout))
                    if r.ok:
                        old, clean = clean, await base.snapshot()
                        with contextlib.suppress(CorralError):
                            await old.delete()
                if self.prestart:
                    live = await _eval_live.live_snapshot(
                        base, ["python3", RUNNER, "serve"], self.runner_env, "/workspace")
                    if live is not None:
                        snapshot, self.served = live
                        return snapshot
                    self.prestart = False  # the host cannot: files only
                snapshot, clean = clean, None
                return snapshot
            except CorralError as exc:
                if not is_infrastructure_error(exc) or attempt == self.retries:
                    raise
            finally:
                await base.delete()
                if clean is not None:
                    with contextlib.suppress(CorralError):
                        await clean.delete()
        raise AssertionError("unreachable")

    async def _check(self, base: corral.AsyncSandbox) -> dict[str, Any]:
        """The runner's check in ``base``: its report, or the policy's error raised."""
        r = await base.exec(["python3", RUNNER, "check"], env=self.runner_env,
                            cwd="/workspace", timeout=max(CHECK_TIMEOUT_S, self.timeout))
        try:
            check = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            check = {}
        if not isinstance(check, dict):
            check = {}
        if r.ok and check.get("check") == "ok":
            return check
        self._raise_on_failed_check(r, check)

    def _raise_on_failed_check(self, r: corral.CommandResult, check: dict[str, Any]) -> NoReturn:
        if r.timed_out or r.oom_killed:
            why = "timed out" if r.timed_out else f"ran out of memory ({self.spec['memory_mb']} MB)"
            raise InvalidArgument(f"policy {self.policy.label!r} on {self.env}: loading it "
                                  f"and taking one step {why}")
        where = f" at {check['at']}" if check.get("at") else ""
        error = check.get("error") or (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise InvalidArgument(
            f"policy {self.policy.label!r} cannot run on {self.env} in image "
            f"{self.env.image!r}: {error}{where}. Fix the policy (or the env id/arguments); "
            "nothing was evaluated", details={"error": error, "at": check.get("at")})

    async def _episode(self, sb: corral.AsyncSandbox, keys: tuple[Key, ...]) -> dict[str, Any]:
        """Run ``keys`` in ``sb``: every record printed, and why any is missing."""
        items = [f"{s}:{k}" for s, k in keys]
        if self.served is not None:
            r = await _eval_live.serve(sb, self.served, items, self.timeout * len(keys))
        else:
            r = await sb.exec(["python3", RUNNER, "run", *items], env=self.runner_env,
                              cwd="/workspace", timeout=self.timeout * len(keys))
        records = parse_records(r.stdout)
        missing: tuple[str, str] | None = None
        if len(records) < len(keys):
            if r.timed_out:
                missing = ("timeout", f"the episode ran past its {self.timeout:g} s timeout")
            elif r.oom_killed:
                missing = ("error", f"killed for exceeding memory_mb={self.spec['memory_mb']}")
            else:
                if r.returncode < 0 and (lost := await sandbox_lost(sb)) is not None:
                    raise SandboxLost(lost)  # the machine's doing: the runner retries
                last = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
                if r.returncode == 0:
                    raise EpisodeError(f"the runner printed no record: {last}")
                missing = ("error", f"the runner exited with status {r.returncode}: {last}")
        return {"records": records, "missing": missing}

    def expand(self, res: EpisodeResult) -> list[EvalEpisode]:
        """One runner result (a sandbox's worth of episodes) as episodes."""
        keys: tuple[Key, ...] = res.seed
        extra = {"sandbox_id": res.sandbox_id, "attempts": res.attempts}
        if res.status is not EpisodeStatus.OK:
            return [EvalEpisode(s, k, res.status.value, error=res.error, **extra) for s, k in keys]
        records, missing = res.value["records"], res.value["missing"]
        out = []
        for s, k in keys:
            rec = records.get((s, k))
            if rec is None:
                status, error = missing or ("error", "no record")
                out.append(EvalEpisode(s, k, status, error=error, **extra))
            else:
                out.append(EvalEpisode.from_record(rec, **extra))
        return out

    async def run(self, keys: list[Key], *, verify: bool = False) -> Any:
        """Yield ``(episodes, is_rerun)`` as sandboxes finish: the episodes of ``keys``,
        and with ``verify`` the first key once more in a sandbox of its own (run next to
        its first run, so the check costs a sandbox, not time)."""
        if self._snapshot is None:
            self._snapshot = await self._make_snapshot()
            self._runner = EpisodeRunner(
                self._episode, snapshot=self._snapshot, concurrency=self.concurrency,
                timeout=self.timeout * self.per_sandbox + EXEC_MARGIN_S, retries=self.retries,
                tags=[self.tag], client=self.client())
        assert self._runner is not None
        groups = [tuple(keys[i:i + self.per_sandbox]) for i in range(0, len(keys), self.per_sandbox)]
        if verify:
            groups.insert(1, (keys[0],))
        async for res in self._runner.run(groups):
            yield self.expand(res), verify and res.index == 1

    async def close(self) -> None:
        try:
            if self._snapshot is not None:
                await self._snapshot.delete()
        finally:
            if self._runner is not None:
                await self._runner.aclose()
            if self._client is not None:
                await self._client.aclose()


def _open_cache(cache: bool | str | Path | EpisodeCache | None) -> EpisodeCache | None:
    if cache is None or cache is False:
        return None
    if isinstance(cache, EpisodeCache):
        return cache
    return EpisodeCache(default_cache_path() if cache is True else cache)


async def aevaluate(
    policy: Policy | str | Path, env: EnvSpec | str = "CartPole-v1", **options: Any
) -> EvalResult:
    """:func:`evaluate` for asyncio code (the same arguments; see :class:`EvalOptions`)."""
    opts = EvalOptions.of(options)
    pol = Policy.coerce(policy)
    if opts.label:
        pol = Policy(pol.kind, pol.files, opts.label)
    spec = EnvSpec.coerce(env, kwargs=opts.env_kwargs, image=opts.image, max_steps=opts.max_steps)
    opts = opts.checked(spec.return_bounds)
    mode, error_value = error_scoring(opts.on_error, opts.error_return)
    loop = _EvalLoop(pol, spec, opts, mode, error_value)
    result = await loop.run()
    if opts.png is not None:
        result.save_png(opts.png)
    if opts.wandb:
        _log_to_wandb(result)
    return result


def _log_to_wandb(result: EvalResult) -> None:
    """The statistics of ``result`` to an open W&B run (``corral/eval/<policy>/...``)."""
    prefix = f"corral/eval/{result.policy}/"
    log_metrics({prefix + k: v for k, v in {
        "mean": result.mean, "std": result.std, "stderr": result.stderr,
        "ci_low": result.ci[0], "ci_high": result.ci[1], "episodes": result.n,
        "errors": result.errors, "timeouts": result.timeouts,
        "infra_failures": result.infra_failures,
        "episodes_per_second": result.episodes_per_second,
    }.items()})


class _EvalLoop:
    """One evaluation: batches of episodes, the cache, the live bar, when to stop."""

    def __init__(
        self, pol: Policy, spec: EnvSpec, opts: EvalOptions, mode: str, error_value: float | None
    ) -> None:
        self.pol, self.spec, self.opts = pol, spec, opts
        self.mode, self.error_value = mode, error_value
        self.store = _open_cache(opts.cache)
        self.evaluation = _Evaluation(
            pol, spec, client=opts.client, timeout=opts.timeout, concurrency=opts.concurrency,
            retries=opts.retries, per_sandbox=opts.episodes_per_sandbox,
            sandbox=opts.sandbox or {}, prestart=opts.prestart,
        )
        self.episodes: dict[Key, EvalEpisode] = {}
        self.cache_hits = 0
        self.env_key = spec.key()
        # The cache serves a policy only once a re-run episode showed it deterministic.
        self.verdict_key = policy_key(pol.hash, self.env_key)
        self.deterministic = (
            self.store.verdict(self.verdict_key) if self.store is not None else None
        )
        self.unwritten: list[EvalEpisode] = []
        progress = opts.progress
        self.own_bar = not isinstance(progress, EpisodeProgress)
        self.bar = progress if isinstance(progress, EpisodeProgress) else EpisodeProgress(
            opts.budget_episodes if opts.adaptive else None, label=f"{pol.label} on {spec}",
            enabled=bool(progress))
        self.total = opts.budget_episodes if opts.adaptive else None
        self.final: Summary | None = None  # the run's own statistics, once it ended
        self.reporter = EvalReporter(self.evaluation.client(), name=pol.label, env=str(spec),
                                     enabled=opts.report)

    def stats(self, method: str | None = None) -> Summary:
        error_value = self.error_value
        values = [e.episode_return if e.ok else error_value for e in self.episodes.values()
                  if e.ok or (error_value is not None and e.status in FAILED)]
        return summarize(values, self.opts.confidence, method=method or self.opts.ci_method,  # type: ignore[arg-type]
                         bounds=self.opts.bounds)

    def keep(self, eps: list[EvalEpisode]) -> None:
        if self.store is None or self.deterministic is False:
            return
        self.unwritten.extend(e for e in eps if e.ok)
        if self.deterministic:
            self.store.put_many(
                (episode_key(self.pol.hash, self.env_key, *e.key), _record(e))
                for e in self.unwritten
            )
            self.unwritten.clear()

    def judge(self, rerun: EvalEpisode) -> None:
        same = same_trajectory(self.episodes[rerun.key], rerun)
        if same is not None and self.store is not None:
            self.deterministic = same
            self.store.put_verdict(self.verdict_key, same)
            self.keep([])

    def note(self, eps: list[EvalEpisode], status: str | None = None) -> None:
        for e in eps:
            self.episodes[e.key] = e
        s = self.stats("t")  # the live bar's interval: cheap
        extra = f"mean {s.mean:.4g} ± {s.halfwidth:.3g}" if s.n >= 2 else ""
        for e in eps:
            self.bar.advance(status or e.status, extra=extra)
        self.reporter.update(lambda: self.summary("running"))

    def summary(self, state: str, error: str | None = None) -> dict[str, Any]:
        """The run so far, as the daemon's dashboard shows it (``PUT /v1/evals/{id}``)."""
        s = self.final or self.stats("t")  # the live bar's interval until the end
        returns = [e.episode_return for e in self.episodes.values() if e.ok]
        return {"state": state, "total": self.total, "done": len(self.episodes),
                "counts": {k: v for k, v in self.bar.counts.items() if v}, "n": s.n,
                "mean": s.mean if s.n else None, "ci_low": s.ci_low if s.n >= 2 else None,
                "ci_high": s.ci_high if s.n >= 2 else None, "confidence": s.confidence,
                "histogram": histogram(r for r in returns if r is not None),
                "error": error[:1000] if error else None}

    async def run(self) -> EvalResult:
        started = time.perf_counter()
        state, error = "failed", None
        try:
            if self.own_bar:
                self.bar.__enter__()
            stop_reason = await self._batches(started)
            if stop_reason == "policy_failed":
                failed = sum(e.status in FAILED for e in self.episodes.values())
                error = f"the policy failed in {failed} of {len(self.episodes)} episodes"
            else:
                state, self.final = "done", self.stats()
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.own_bar:
                self.bar.__exit__(None, None, None)
            try:
                with contextlib.suppress(Exception):
                    await self.reporter.finish(self.summary(state, error))
                await self.evaluation.close()
            finally:
                if self.store is not None and not isinstance(self.opts.cache, EpisodeCache):
                    self.store.close()
        ordered = sorted(self.episodes.values(), key=lambda e: e.key)
        if stop_reason == "policy_failed":
            cached = bool(self.store is not None and self.deterministic)
            raise _episode_errors(self.pol, self.spec, ordered, cached=cached)
        opts = self.opts
        assert self.final is not None  # set when the batches ended without policy_failed
        return EvalResult(
            self.pol.label, self.pol.hash, self.spec, ordered, self.final, self.error_value,
            stop_reason, time.perf_counter() - started, self.evaluation.sandboxes_created,
            self.cache_hits, opts.target_halfwidth if opts.adaptive else None,
            on_error=self.mode, deterministic=self.deterministic)

    async def _batches(self, started: float) -> str:
        """Run batches until the plan is done or a stopping rule holds; the reason."""
        opts = self.opts
        plan = _plan(opts.seeds, opts.episodes_per_seed)  # type: ignore[arg-type]
        while True:
            want = None
            if opts.adaptive:
                want = opts.batch_size if opts.budget_episodes is None else min(
                    opts.batch_size, opts.budget_episodes - len(self.episodes))  # type: ignore[type-var]
            batch = list(plan if want is None else itertools.islice(plan, want))
            if not batch:
                return "seeds_exhausted" if opts.adaptive else "complete"
            if not opts.adaptive:
                self.total = len(batch)
                self.bar.set_total(len(batch))
            await self._batch(batch)
            failed = sum(e.status in FAILED for e in self.episodes.values())
            if self.mode == "raise" and failed:
                return "policy_failed"
            if not opts.adaptive:
                return "complete"
            s = self.stats()
            if s.n >= MIN_ADAPTIVE_EPISODES and s.halfwidth <= opts.target_halfwidth:  # type: ignore[operator]
                return "target"
            if opts.budget_episodes is not None and len(self.episodes) >= opts.budget_episodes:
                return "budget_episodes"
            if opts.budget_seconds is not None and time.perf_counter() - started >= opts.budget_seconds:
                return "budget_seconds"

    async def _batch(self, batch: list[Key]) -> None:
        hits: dict[str, dict[str, Any]] = {}
        keyed = {key: episode_key(self.pol.hash, self.env_key, *key) for key in batch}
        if self.store is not None and self.deterministic:
            hits = self.store.get_many(keyed.values())
        cached = [EvalEpisode.from_record(hits[keyed[key]], cached=True)
                  for key in batch if keyed[key] in hits]
        self.cache_hits += len(cached)
        self.note(cached, "cached")
        todo = [key for key in batch if keyed[key] not in hits]
        if not todo:
            return
        verify = self.store is not None and self.deterministic is None
        rerun: EvalEpisode | None = None
        async for eps, is_rerun in self.evaluation.run(todo, verify=verify):
            if is_rerun:
                rerun = eps[0]
                if rerun.key in self.episodes:
                    self.judge(rerun)
                continue
            self.note(eps)
            self.keep(eps)
            if rerun is not None and rerun.key in {e.key for e in eps}:
                self.judge(rerun)


def _episode_errors(pol: Policy, spec: EnvSpec, episodes: list[EvalEpisode], *,
                    cached: bool) -> EpisodeErrors:
    failed = [e for e in episodes if e.status in FAILED]
    errors = sum(e.status == "error" for e in failed)
    first = failed[0]
    kept = ("; the finished episodes are cached, so running again costs only the failed ones"
            if cached else "")
    return EpisodeErrors(
        f"policy {pol.label!r} on {spec} failed in {len(failed)} of {len(episodes)} episodes "
        f"({errors} errors, {len(failed) - errors} timeouts; first: seed {first.seed}: "
        f"{first.error}). No mean is given, since leaving them out would inflate it: choose "
        "how to score them with on_error='zero' (or a return, e.g. -1) or on_error='exclude' "
        f"(CLI: --on-error){kept}",
        details={"episodes": len(episodes), "errors": errors,
                 "timeouts": len(failed) - errors, "first_error": first.error,
                 "first_seed": first.seed},
        episodes=episodes)


def _record(e: EvalEpisode) -> dict[str, Any]:
    return {"seed": e.seed, "k": e.k, "return": e.episode_return, "steps": e.steps,
            "digest": e.digest, "terminated": e.terminated, "truncated": e.truncated}


def evaluate(policy: Policy | str | Path, env: EnvSpec | str = "CartPole-v1", **options: Any) -> EvalResult:
    """Evaluate ``policy`` on ``env`` over seeded episodes, each in a sandbox.

    ``policy``: code (a string defining ``act(obs)`` or ``choose_action(obs)``), a
    file (``.py``, or weights: ``.npy``/``.json``/``.pt``) or a
    :class:`~corral.rl.Policy`. ``env``: a gymnasium id (run in image ``rl``) or
    ``"tictactoe"`` (image ``python``); ``env_kwargs``, ``image``, ``max_steps``
    refine it.

    Options: ``seeds`` (iterable of ints >= 0, or ``"0-99"``; default 0-99),
    ``episodes_per_seed``, ``concurrency`` (sandboxes at once), ``timeout`` (seconds
    per episode), ``retries`` (of infrastructure failures), ``episodes_per_sandbox``,
    ``prestart`` (restore each sandbox with its runner loaded: default for gymnasium
    envs; ``False``: a fresh ``python3`` per sandbox),
    ``sandbox`` (spec overrides: ``memory_mb``, ``cpus``, ...), ``adaptive`` with
    ``target_halfwidth``, ``budget_episodes``, ``budget_seconds``, ``batch_size``;
    ``confidence`` (0.95); ``on_error``, how episodes the policy failed (raised or
    timed out) count: ``"raise"`` (default: :class:`EpisodeErrors`, no mean),
    ``"zero"``, a number (the return to score them as; ``error_return=`` says the
    same), or ``"exclude"``; ``ci_method``: ``"t"`` or ``"bootstrap"`` (BCa, seeded),
    by default bootstrap when the returns' range is known (``bounds=(lo, hi)``, or the
    env's: CartPole, MountainCar, Acrobot, tic-tac-toe) and t otherwise; either is
    clamped to the bounds. ``cache`` (True: the default file; a path; False; used only
    for a policy a re-run episode found deterministic), ``png`` (draw the return
    distribution), ``progress`` (a live bar on stderr), ``label``, ``client``,
    ``report`` (default True: the run's progress is shown on the daemon's dashboard,
    ``/ui``; see :mod:`corral.rl._eval_report`), ``wandb`` (default True: with a W&B
    run open, ``wandb.init()``, the statistics are logged to it as
    ``corral/eval/<policy>/mean``, ``ci_low``...; see :mod:`corral.rl._wandb`).

    >>> r = corral.rl.evaluate(POLICY, "CartPole-v1", seeds=range(200), concurrency=8)
    >>> print(f"{r.mean:.1f} ± {r.halfwidth:.1f}; infra failures: {r.infra_failures}")
    """
    return run_sync(aevaluate(policy, env, **options))
