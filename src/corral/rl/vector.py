"""A gymnasium vector environment over many sandboxes, one sub-environment in each.

:class:`SandboxVectorEnv` follows gymnasium 1.4's :class:`~gymnasium.vector.VectorEnv`
(batched spaces, ``info`` dicts with ``_key`` masks, ``reset_mask``, the three
autoreset modes) like :class:`~gymnasium.vector.SyncVectorEnv` does, but its
sub-environments are :class:`~corral.rl.SandboxEnv` servers in separate sandboxes.
Each step writes every action first, then reads every reply, so the sub-environments
step at the same time, each on its own sandbox's CPU share: over each server's port
socket (see :class:`~corral.rl.SandboxEnv`), else in one request to the daemon for all
of them (``Process.exchange_all``). :meth:`step_async` sends that request from a worker thread and returns at once;
:meth:`step_wait` waits for it::

    envs = corral.rl.SandboxVectorEnv("CartPole-v1", num_envs=8)
    obs, infos = envs.reset(seed=0)                      # seeds 0..7
    obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
    envs.close()                                         # deletes the 8 sandboxes

Autoreset (``metadata["autoreset_mode"]``): ``NEXT_STEP`` (gymnasium's default) resets
a sub-environment on the step after it ended, returning its first observation with
reward 0; ``SAME_STEP`` resets it in the same step, inside the sandbox, with
``infos["final_obs"]``/``infos["final_info"]``; ``DISABLED`` leaves it to you
(``reset(options={"reset_mask": mask})``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from copy import deepcopy
from typing import Any

import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

import corral
from corral._bridge import in_parallel, submit_blocking
from corral.errors import InvalidArgument, InvalidState
from corral.rl import spaces as wire
from corral.rl.gym_env import DEFAULT_IMAGE, _Remote

MAX_PARALLEL_STARTS = 16  # sandboxes started at once when the vector env is built


class SandboxVectorEnv(VectorEnv):
    """``num_envs`` copies of ``env_id``, each in a sandbox of its own.

    ``env_id`` and ``kwargs`` are those of :class:`~corral.rl.SandboxEnv`, as are
    ``image``, ``snapshot``, ``pool``, ``client``, ``sandbox_options``, ``python`` and ``port_channel``
    (every sandbox is made the same way). ``copy``: return copies of the batched
    observations (as gymnasium's vector envs do). The sandboxes start in parallel; if
    one fails, the others are deleted and the error is raised.
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        image: str = DEFAULT_IMAGE,
        snapshot: corral.Snapshot | str | None = None,
        pool: corral.Pool | None = None,
        client: corral.Client | str | None = None,
        sandbox_options: Mapping[str, Any] | None = None,
        python: str = "python3",
        port_channel: bool = True,
        **kwargs: Any,
    ) -> None:
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise InvalidArgument(f"num_envs must be an int >= 1, got {num_envs!r}")
        self.env_id = env_id
        self.num_envs = num_envs
        self.copy = copy
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self._remotes: list[_Remote] = []
        self._pending: Future[list[tuple[int, str, dict[str, Any]]]] | None = None
        # A daemon's URL: one client of this env's own (exchange_all needs one client).
        self._own_client = corral.Client(client) if isinstance(client, str) else None
        client = self._own_client or client
        started = in_parallel(limit=MAX_PARALLEL_STARTS, calls=[
            lambda: _Remote.start(
                env_id, kwargs, image=image, snapshot=snapshot, pool=pool, client=client,
                sandbox_options=sandbox_options, python=python, streamed=False,
                port_channel=port_channel,
            )
        ] * num_envs)
        self._remotes = [r for r in started if isinstance(r, _Remote)]
        errors = [r for r in started if isinstance(r, BaseException)]
        if errors:
            self._close_remotes()
            raise errors[0]

        hello = self._remotes[0].hello
        self.single_observation_space = wire.space_from_dict(hello["observation_space"])
        self.single_action_space = wire.space_from_dict(hello["action_space"])
        for remote in self._remotes[1:]:
            if (remote.hello["observation_space"], remote.hello["action_space"]) != (
                hello["observation_space"], hello["action_space"]
            ):
                self._close_remotes()
                raise InvalidState(
                    f"the sub-environments of {env_id} have different spaces (sandbox "
                    f"{remote.sandbox.id}): a vector env needs identical ones"
                )
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.metadata = {**hello["metadata"], "autoreset_mode": self.autoreset_mode}
        self.render_mode = hello["render_mode"]
        self.spec = None

        self._state = AsyncState.DEFAULT
        self._env_obs: list[Any] = [None] * num_envs
        self._observations = create_empty_array(
            self.single_observation_space, n=num_envs, fn=np.zeros
        )
        self._rewards = np.zeros((num_envs,), dtype=np.float64)
        self._terminations = np.zeros((num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((num_envs,), dtype=np.bool_)
        self._autoreset_envs = np.zeros((num_envs,), dtype=np.bool_)
        self._reset_mask: np.ndarray | None = None

    @property
    def sandboxes(self) -> list[corral.Sandbox]:
        """The sandboxes of the sub-environments, in order."""
        return [r.sandbox for r in self._remotes]

    # ---------------------------------------------------------------- reset

    def reset(
        self, *, seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every sub-environment (or those in ``options["reset_mask"]``); an int
        ``seed`` gives sub-environment ``i`` the seed ``seed + i``."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self, *, seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self._check_state(AsyncState.DEFAULT, "reset_async")
        if seed is None:
            seeds: list[int | None] = [None] * self.num_envs
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise InvalidArgument(
                f"reset got {len(seeds)} seeds for {self.num_envs} sub-environments"
            )
        options = dict(options) if options is not None else None
        mask = options.pop("reset_mask", None) if options is not None else None
        if mask is None:
            mask = np.ones((self.num_envs,), dtype=np.bool_)
        elif not (isinstance(mask, np.ndarray) and mask.dtype == np.bool_
                  and mask.shape == (self.num_envs,) and mask.any()):
            raise InvalidArgument(
                f"options['reset_mask'] must be a bool array of shape ({self.num_envs},) "
                "with at least one True"
            )
        self._reset_mask = mask
        self._start([
            (i, "reset", {"seed": seeds[i], "options": options})
            for i in range(self.num_envs) if mask[i]
        ])
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self) -> tuple[Any, dict[str, Any]]:
        self._check_state(AsyncState.WAITING_RESET, "reset_wait")
        replies = self._finish()
        mask = self._reset_mask
        assert mask is not None
        self._terminations[mask] = False
        self._truncations[mask] = False
        self._autoreset_envs[mask] = False
        infos: dict[str, Any] = {}
        for i, _, reply in replies:
            self._env_obs[i] = reply["obs"]
            infos = self._add_info(infos, reply["info"], i)
        return self._batched_obs(), infos

    # ----------------------------------------------------------------- step

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        self._check_state(AsyncState.DEFAULT, "step")
        return self._step_result(self._exchange(self._step_requests(actions)))

    def step_async(self, actions: Any) -> None:
        """Send each sub-environment its action (or, in ``NEXT_STEP`` mode, its reset
        after an episode ended) and return without waiting for the replies."""
        self._check_state(AsyncState.DEFAULT, "step_async")
        self._start(self._step_requests(actions))
        self._state = AsyncState.WAITING_STEP

    def step_wait(self) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Wait for every sub-environment's reply; the batched step."""
        self._check_state(AsyncState.WAITING_STEP, "step_wait")
        return self._step_result(self._finish())

    def _step_requests(self, actions: Any) -> list[tuple[int, str, dict[str, Any]]]:
        requests: list[tuple[int, str, dict[str, Any]]] = []
        for i, action in enumerate(iterate(self.action_space, actions)):
            if self._autoreset_envs[i]:
                if self.autoreset_mode == AutoresetMode.NEXT_STEP:
                    requests.append((i, "reset", {}))
                    continue
                if self.autoreset_mode == AutoresetMode.DISABLED:
                    raise InvalidState(
                        f"sub-environment {i} ended and autoreset is disabled: reset it "
                        "with reset(options={'reset_mask': mask}) before stepping"
                    )
            same_step = self.autoreset_mode == AutoresetMode.SAME_STEP
            requests.append((i, "step", {"action": action, "autoreset": same_step}))
        if len(requests) != self.num_envs:
            raise InvalidArgument(
                f"got {len(requests)} actions for {self.num_envs} sub-environments"
            )
        return requests

    def _step_result(
        self, replies: list[tuple[int, str, dict[str, Any]]]
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        infos: dict[str, Any] = {}
        for i, op, reply in replies:
            if op == "reset":  # NEXT_STEP autoreset
                self._env_obs[i] = reply["obs"]
                self._rewards[i], self._terminations[i], self._truncations[i] = 0.0, False, False
            else:
                self._env_obs[i] = reply["obs"]
                self._rewards[i] = reply["reward"]
                self._terminations[i] = reply["terminated"]
                self._truncations[i] = reply["truncated"]
                if "final_obs" in reply:  # SAME_STEP: reset in the sandbox already
                    infos = self._add_info(
                        infos, {"final_obs": reply["final_obs"],
                                "final_info": reply["final_info"]}, i,
                    )
            infos = self._add_info(infos, reply["info"], i)
        self._autoreset_envs = np.logical_or(self._terminations, self._truncations)
        return (
            self._batched_obs(), np.copy(self._rewards), np.copy(self._terminations),
            np.copy(self._truncations), infos,
        )

    # ---------------------------------------------------------------- other

    def render(self) -> tuple[Any, ...]:
        """Each sub-environment's ``render()``."""
        return tuple(reply["frame"] for _, _, reply in self._to_all("render", {}))

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Each sub-environment's attribute ``name``, called with the arguments if it is
        a method (see :meth:`SandboxEnv.call`)."""
        fields = {"name": name, "args": list(args), "kwargs": kwargs}
        return tuple(reply["value"] for _, _, reply in self._to_all("call", fields))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set ``name`` in every sub-environment: one value each (a list or tuple of
        ``num_envs``), or the same value for all."""
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise InvalidArgument(f"set_attr needs {self.num_envs} values, got {len(values)}")
        self._check_state(AsyncState.DEFAULT, "set_attr")
        self._exchange([(i, "set_attr", {"name": name, "value": v}) for i, v in enumerate(values)])

    def fork(self, n: int, *, reseed: bool | int | Sequence[int] = True) -> list[SandboxVectorEnv]:
        """``n`` running copies of this vector env as it is now, mid-episode: sub-env
        ``i`` of each copy is a live fork of sub-env ``i`` (its memory, its server), as
        :meth:`SandboxEnv.fork <corral.rl.SandboxEnv.fork>` makes them (docs/rl.md,
        "Branching"); each copy a :class:`SandboxVectorEnv` of its own whose
        :meth:`close` deletes its sandboxes. Only sandboxes created checkpointable
        (``sandbox_options={"checkpointable": True}``).

        ``reseed`` (:func:`~corral.rl.branching.branch_seeds`) gives copy ``j`` a seed
        ``s``; its sub-env ``i`` is reseeded with ``s + i`` (as ``reset(seed=s)``
        seeds them). ``False`` keeps the parent's randomness. All or nothing."""
        from corral.rl.branching import branch_seeds

        self._check_state(AsyncState.DEFAULT, "fork")
        seeds = branch_seeds(n, reseed)
        own = self._own_client
        clients = [corral.Client(**own.connect_args) for _ in range(n)] if own else None
        forked = in_parallel(limit=MAX_PARALLEL_STARTS, calls=[
            functools.partial(remote.fork, [None if s is None else (s + i) % 2**63
                                            for s in seeds], clients)
            for i, remote in enumerate(self._remotes)])
        errors = [r for r in forked if isinstance(r, BaseException)]
        if errors:
            in_parallel([c.close for r in forked if not isinstance(r, BaseException)
                         for c in r])
            for client in clients or ():
                client.close()
            raise errors[0]
        copies: list[SandboxVectorEnv] = []
        for j, seed in enumerate(seeds):
            branch = object.__new__(type(self))
            branch.__dict__.update({k: deepcopy(v) if isinstance(v, (np.ndarray, list)) else v
                                    for k, v in self.__dict__.items()
                                    if k not in ("_remotes", "_np_random")})
            branch._remotes = [remotes[j] for remotes in forked]
            branch._own_client = clients[j] if clients else None
            if seed is not None:
                branch._np_random, branch._np_random_seed = seeding.np_random(seed)
            else:
                branch._np_random = deepcopy(self._np_random)
            copies.append(branch)
        return copies

    def close_extras(self, **kwargs: Any) -> None:
        """Delete every sandbox (in parallel)."""
        self._close_remotes()

    # -------------------------------------------------------------- helpers

    def _to_all(self, op: str, fields: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
        self._check_state(AsyncState.DEFAULT, op)
        return self._exchange([(i, op, fields) for i in range(self.num_envs)])

    def _exchange(
        self, requests: list[tuple[int, str, dict[str, Any]]]
    ) -> list[tuple[int, str, dict[str, Any]]]:
        """One ``exchange_all`` for ``(env index, op, fields)`` requests; the replies
        as ``(env index, op, fields)``. The first error is raised once every reply was
        read, so none is left behind to be taken for the answer to a later request."""
        calls = [self._remotes[i].request(op, **fields) for i, op, fields in requests]
        channels = [c for i, _, _ in requests if (c := self._remotes[i].channel) is not None]
        if len(channels) == len(requests):  # all on port sockets: all written, then all read
            for channel, (_, line) in zip(channels, calls, strict=True):
                channel.write(line)
            lines = [channel.readline() for channel in channels]
        else:
            lines = corral.Process.exchange_all(calls, timeout=None)  # a step takes what it takes
        replies: list[tuple[int, str, dict[str, Any]]] = []
        error: Exception | None = None
        for (i, op, _), line in zip(requests, lines, strict=True):
            try:
                replies.append((i, op, self._remotes[i].reply(line)))
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return replies

    def _start(self, requests: list[tuple[int, str, dict[str, Any]]]) -> None:
        self._pending = submit_blocking(functools.partial(self._exchange, requests), bounded=False)

    def _finish(self) -> list[tuple[int, str, dict[str, Any]]]:
        pending, self._pending = self._pending, None
        self._state = AsyncState.DEFAULT
        assert pending is not None
        return pending.result()

    def _batched_obs(self) -> Any:
        self._observations = concatenate(
            self.single_observation_space, self._env_obs, self._observations
        )
        return deepcopy(self._observations) if self.copy else self._observations

    def _check_state(self, expected: AsyncState, call: str) -> None:
        if self.closed:
            raise InvalidState(f"{call}: this SandboxVectorEnv is closed")
        if self._state != expected:
            waiting = {AsyncState.WAITING_STEP: "step_wait", AsyncState.WAITING_RESET: "reset_wait"}
            if expected == AsyncState.DEFAULT:
                todo = f"call {waiting[self._state]}() first"
            else:
                todo = f"call {waiting[expected].replace('_wait', '_async')}() first"
            raise InvalidState(f"{call}: {todo} (each *_async is paired with its *_wait)")

    def _close_remotes(self) -> None:
        if self._pending is not None:
            self._pending.exception()  # let a request in flight end first
            self._pending = None
        remotes, self._remotes = self._remotes, []
        in_parallel([r.close for r in remotes])
        own_client, self._own_client = getattr(self, "_own_client", None), None
        if own_client is not None:
            own_client.close()

    def __repr__(self) -> str:
        return f"SandboxVectorEnv({self.env_id}, num_envs={self.num_envs})"
