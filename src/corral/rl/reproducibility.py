"""Same seed, same trajectory: digests of seeded episodes, compared across sandboxes.

A trajectory here is what a seeded run of an environment produces: ``reset(seed=s)``,
then ``steps`` actions drawn from the action space seeded with ``s``, resetting (without
a seed) whenever an episode ends. Its digest is a SHA-256 over every action,
observation, reward, ``terminated`` and ``truncated``, each in the exact encoding of
:mod:`corral.rl.spaces` (dtype, shape and bytes for arrays: no rounding). ``info`` is
left out, as it may legitimately hold timings.

:func:`verify_reproducible` runs the same seeds in two (or more) distinct sandboxes,
and in this process when it can, and reports per seed whether the digests match, and
if not the first step where they part::

    report = corral.rl.verify_reproducible("CartPole-v1", seeds=[0, 1, 2], steps=200)
    print(report)                 # one line per seed
    assert report.all_match
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

import corral
from corral._bridge import in_parallel
from corral.errors import InvalidArgument
from corral.rl import spaces as wire
from corral.rl.gym_env import DEFAULT_IMAGE, SandboxEnv

IN_PROCESS = "in-process"


def _canonical(value: Any) -> bytes:
    return json.dumps(wire.encode(value), sort_keys=True, separators=(",", ":")).encode()


def trajectory(env: gym.Env, seed: int, steps: int) -> list[str]:
    """The running digest after each of ``steps`` seeded steps of ``env`` (see the
    module docstring); the last one is the trajectory's digest."""
    if steps < 1:
        raise InvalidArgument(f"steps must be >= 1, got {steps}")
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    digest = hashlib.sha256(_canonical(obs))
    running = []
    for _ in range(steps):
        action = env.action_space.sample()
        obs, reward, terminated, truncated, _ = env.step(action)
        digest.update(_canonical([action, obs, reward, terminated, truncated]))
        running.append(digest.hexdigest())
        if terminated or truncated:
            obs, _ = env.reset()
            digest.update(_canonical(obs))
    return running


def trajectory_digest(env: gym.Env, seed: int, steps: int) -> str:
    """The SHA-256 of ``steps`` seeded steps of ``env`` (local or a :class:`SandboxEnv`)."""
    return trajectory(env, seed, steps)[-1]


@dataclass(frozen=True)
class SeedResult:
    """One seed's digests by source (a sandbox's id, or ``"in-process"``)."""

    seed: int
    steps: int
    digests: dict[str, str]
    first_divergence: int | None = None  # the first step (0-based) whose digests differ

    @property
    def match(self) -> bool:
        return len(set(self.digests.values())) == 1


@dataclass(frozen=True)
class ReproReport:
    """What :func:`verify_reproducible` found, seed by seed."""

    env_id: str
    results: list[SeedResult]
    sources: list[str]
    in_process: bool
    note: str | None = None  # why there was no in-process run, if there was none

    @property
    def all_match(self) -> bool:
        return bool(self.results) and all(r.match for r in self.results)

    @property
    def mismatched(self) -> list[int]:
        return [r.seed for r in self.results if not r.match]

    def __str__(self) -> str:
        lines = [f"{self.env_id}: {len(self.results)} seeds over {', '.join(self.sources)}"]
        for r in self.results:
            if r.match:
                digest = next(iter(r.digests.values()))
                lines.append(f"  seed {r.seed}: match  {digest[:16]} ({r.steps} steps)")
            else:
                parts = ", ".join(f"{src} {d[:12]}" for src, d in r.digests.items())
                lines.append(f"  seed {r.seed}: MISMATCH from step {r.first_divergence}: {parts}")
        if self.note:
            lines.append(f"  ({self.note})")
        return "\n".join(lines)


def _first_divergence(runs: list[list[str]]) -> int | None:
    for step, digests in enumerate(zip(*runs, strict=True)):
        if len(set(digests)) > 1:
            return step
    return None


def _local_factory(
    env: str | Callable[[], gym.Env], local: bool | Callable[[], gym.Env] | None,
    kwargs: Mapping[str, Any],
) -> tuple[Callable[[], gym.Env] | None, str | None]:
    """How to build the in-process copy, or why there is none."""
    if callable(local):
        return local, None
    if local is False:
        return None, "in-process run not asked for"
    if not isinstance(env, str):
        if local:
            raise InvalidArgument("local=True needs an env id; pass local=<factory> instead")
        return None, "no in-process run: pass local=<factory> to compare with one"
    try:
        gym.spec(env)
    except gym.error.Error as exc:
        if local:
            raise InvalidArgument(f"cannot build {env} in this process: {exc}") from exc
        return None, f"no in-process run: {env} is not registered in this process's gymnasium"
    return (lambda: gym.make(env, **kwargs)), None


def verify_reproducible(
    env: str | Callable[[], gym.Env],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    steps: int = 200,
    sandboxes: int = 2,
    local: bool | Callable[[], gym.Env] | None = None,
    image: str = DEFAULT_IMAGE,
    client: corral.Client | None = None,
    **env_kwargs: Any,
) -> ReproReport:
    """Run the same seeded trajectories in ``sandboxes`` distinct sandboxes (at the same
    time) and compare their digests, seed by seed.

    ``env`` is an env id for :class:`SandboxEnv` (with ``env_kwargs``, ``image``,
    ``client``) or a factory returning a fresh :class:`SandboxEnv` (it is closed
    afterwards). ``local``: also run in this process — ``None`` does so when ``env`` is
    an id registered in this process's gymnasium, ``True`` insists, ``False`` skips,
    a factory builds the in-process env.
    """
    if sandboxes < 2:
        raise InvalidArgument(f"comparing needs sandboxes >= 2, got {sandboxes}")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise InvalidArgument("seeds is empty: give at least one seed")
    if isinstance(env, str):
        env_id = env

        def factory() -> gym.Env:
            return SandboxEnv(env_id, image=image, client=client, **env_kwargs)
    elif callable(env):
        env_id, factory = getattr(env, "__name__", repr(env)), env
    else:
        raise InvalidArgument(f"env must be an env id or a factory, got {type(env).__name__}")
    local_factory, note = _local_factory(env, local, env_kwargs)

    def run(make: Callable[[], gym.Env], name: str | None) -> tuple[str, list[list[str]]]:
        built = make()
        try:
            source = name or f"sandbox {built.sandbox.id}"  # type: ignore[attr-defined]
            return source, [trajectory(built, seed, steps) for seed in seeds]
        finally:
            built.close()

    jobs = [lambda: run(factory, None) for _ in range(sandboxes)]
    if local_factory is not None:
        jobs.append(lambda: run(local_factory, IN_PROCESS))
    outcomes = in_parallel(jobs)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    if failed:
        raise failed[0]
    results = []
    for k, seed in enumerate(seeds):
        runs = {source: per_seed[k] for source, per_seed in outcomes}
        results.append(SeedResult(
            seed=seed, steps=steps, digests={s: r[-1] for s, r in runs.items()},
            first_divergence=_first_divergence(list(runs.values())),
        ))
    return ReproReport(
        env_id=env_id, results=results, sources=[source for source, _ in outcomes],
        in_process=local_factory is not None, note=note,
    )
