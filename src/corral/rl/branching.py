"""Branching a running episode: live forks for tree search, Tree-GRPO and vine rollouts.

A sandbox created ``checkpointable=True`` can be forked *live* (docs/live.md): its
processes are checkpointed with CRIU and restored into ``n`` new sandboxes that go on
from that instant, memory and open pipes included. This module puts that under the RL
objects:

- :meth:`corral.rl.SandboxEnv.fork` branches a gymnasium environment mid-episode;
- :class:`Episode` is a multi-step agent episode (commands, files, long-lived
  processes such as a Python REPL) that :meth:`Episode.fork` branches.

A copy's processes keep their ids (``copy.process(id)``), so each branch talks to its
own copy of the environment server or REPL. **Reseeding**: by default each branch gets
a fresh seed so the branches do not replay the same randomness
(:func:`branch_seeds`): an environment server reseeds Python's ``random``, NumPy's and
PyTorch's global generators and the environment's own ``np_random``; an
:class:`Episode` reseeds its REPLs the same way, writes the seed to
:data:`SEED_FILE` and passes it as ``CORRAL_SEED`` to the commands it runs.
``reseed=False`` keeps the parent's state exactly (each branch replays it);
``reseed=7`` derives the branches' seeds from 7 (the same every time);
``reseed=[3, 3]`` gives the seeds themselves (equal seeds: identical branches).

::

    env = corral.rl.SandboxEnv("CartPole-v1", sandbox_options={"checkpointable": True})
    env.reset(seed=0)
    for _ in range(10):
        env.step(0)
    branches = env.fork(4)                  # 4 running copies at step 10
    for b, action in zip(branches, [0, 1, 0, 1]):
        b.step(action)

    with corral.rl.Episode.start(image="python") as ep:
        repl = ep.repl()                     # a Python REPL kept across steps
        ep.send("x = 41")
        left, right = ep.fork(2)            # both have x == 41
        left.send("x += 1"); right.send("x -= 1")
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import corral
from corral.errors import CorralError, InvalidArgument

SEED_FILE = "/tmp/.corral-seed"
"""Where a branch of an :class:`Episode` finds its seed (one decimal line)."""
_MAX_SEED = 2**63
_REPL_MARK = "\x00corral-repl-done\x00"
_RESEED_PY = (
    "import random as _r, sys as _s\n"
    "_r.seed({seed})\n"
    "_n = _s.modules.get('numpy')\n"
    "_n is not None and _n.random.seed({seed} % 2**32)\n"
    "_t = _s.modules.get('torch')\n"
    "_t is not None and _t.manual_seed({seed})\n"
    "del _r, _s, _n, _t\n"
)


def branch_seeds(n: int, reseed: bool | int | Sequence[int]) -> list[int | None]:
    """The seed of each of ``n`` branches (``None``: not reseeded); see the module's
    doc. :class:`InvalidArgument` for anything else."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"fork needs n >= 1 copies, got {n!r}")
    if reseed is False:
        return [None] * n
    if reseed is True:
        return [secrets.randbelow(_MAX_SEED) for _ in range(n)]
    if isinstance(reseed, int):
        import numpy as np

        return [int(np.random.SeedSequence([reseed, i]).generate_state(2, np.uint64)[0]
                    % _MAX_SEED) for i in range(n)]
    if isinstance(reseed, Sequence) and not isinstance(reseed, (str, bytes)):
        seeds = list(reseed)
        if len(seeds) == n and all(type(s) is int and 0 <= s < _MAX_SEED for s in seeds):
            return list(seeds)
    raise InvalidArgument(
        f"reseed must be True (fresh seeds), False (keep the parent's randomness), an int "
        f"(seeds derived from it) or {n} ints from 0 to 2**63 - 1, got {reseed!r}")


def fork_sandbox(sandbox: corral.Sandbox, n: int, process_ids: Sequence[str], *,
                 text: bool = True) -> list[tuple[corral.Sandbox, dict[str, corral.Process]]]:
    """``n`` live copies of ``sandbox``, each with its copies of ``process_ids``
    attached; all or nothing (the copies are deleted if one cannot be attached)."""
    copies = sandbox.fork(n, live=True)
    try:
        return [(c, {pid: c.process(pid, text=text) for pid in process_ids}) for c in copies]
    except BaseException:
        for c in copies:
            try:
                c.delete()
            except CorralError:
                pass
        raise


class Episode:
    """A multi-step agent episode in one sandbox, which :meth:`fork` branches.

    Made by :meth:`start` (a new checkpointable sandbox, deleted by :meth:`close`) or
    from a sandbox of yours (created with ``checkpointable=True``; left running).
    :meth:`run` runs a command (its output back, the command kept in :attr:`steps`),
    :meth:`repl` starts a Python REPL kept across steps, :meth:`send` runs code in it.
    :attr:`seed` is this branch's seed (``None`` for the root, or ``reseed=False``),
    :attr:`index` its index among its siblings.
    """

    def __init__(self, sandbox: corral.Sandbox, *, own: bool = False, seed: int | None = None,
                 index: int | None = None, steps: Sequence[str] = (),
                 processes: Mapping[str, corral.Process] | None = None,
                 repls: Sequence[str] = ()) -> None:
        self.sandbox = sandbox
        self.own = own
        self.seed = seed
        self.index = index
        self.steps: list[str] = list(steps)
        self.processes: dict[str, corral.Process] = dict(processes or {})
        self._repls = set(repls)

    @classmethod
    def start(cls, *, image: str = "python", client: corral.Client | None = None,
              **options: Any) -> Episode:
        """A new episode in a new checkpointable sandbox (``options``: keyword arguments
        of :meth:`corral.Sandbox.create`)."""
        sb = corral.Sandbox.create(image=image, checkpointable=True, client=client, **options)
        return cls(sb, own=True)

    def run(self, cmd: str | Sequence[str], **kwargs: Any) -> corral.CommandResult:
        """Run one command (``kwargs``: those of :meth:`corral.Sandbox.exec`); a reseeded
        branch's commands get ``CORRAL_SEED``."""
        if self.seed is not None:
            kwargs["env"] = {"CORRAL_SEED": str(self.seed), **(kwargs.get("env") or {})}
        result = self.sandbox.exec(cmd, **kwargs)
        self.steps.append(cmd if isinstance(cmd, str) else " ".join(cmd))
        return result

    def spawn(self, name: str, cmd: str | Sequence[str], **kwargs: Any) -> corral.Process:
        """Start a long-lived process kept as ``processes[name]`` (its copies follow
        the forks)."""
        if name in self.processes:
            raise InvalidArgument(f"episode already has a process named {name!r}")
        proc = self.sandbox.spawn(cmd, **kwargs)
        self.processes[name] = proc
        return proc

    def repl(self, name: str = "python", python: str = "python3") -> corral.Process:
        """A Python REPL kept across steps (code goes in with :meth:`send`); a fork
        reseeds it as the module's doc says."""
        proc = self.spawn(name, [python, "-u", "-q", "-i"])
        self._repls.add(name)
        return proc

    def send(self, code: str, name: str = "python", timeout: float | None = 60.0) -> str:
        """Run ``code`` (one statement or block) in the REPL ``name``; what it printed."""
        proc = self.processes[name]
        mark = repr(_REPL_MARK)
        proc.write(f"{code}\n\nprint({mark})\n")
        out: list[str] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            line = proc.readline(timeout=left)
            if not line or line.rstrip("\n") == _REPL_MARK:
                break
            out.append(line)
        self.steps.append(code)
        return "".join(out)

    def fork(self, n: int, *, reseed: bool | int | Sequence[int] = True) -> list[Episode]:
        """``n`` running copies of this episode from now: files, processes (their
        memory included) and its steps so far; each reseeded (see the module's doc).
        Delete them with :meth:`close`."""
        seeds = branch_seeds(n, reseed)
        names = list(self.processes)
        made = fork_sandbox(self.sandbox, n, [self.processes[k].id for k in names])
        branches = [
            Episode(sb, own=True, seed=seed, index=i, steps=self.steps,
                    processes={k: procs[self.processes[k].id] for k in names},
                    repls=self._repls)
            for i, ((sb, procs), seed) in enumerate(zip(made, seeds, strict=True))]
        try:
            for b in branches:
                if b.seed is not None:
                    b.sandbox.files.write(SEED_FILE, f"{b.seed}\n")
                    for name in b._repls:
                        b.send(_RESEED_PY.format(seed=b.seed), name)
                        b.steps.pop()
        except BaseException:
            for b in branches:
                b.close()
            raise
        return branches

    def close(self) -> None:
        """Delete the sandbox if the episode made it (a fork's copies included)."""
        if self.own:
            self.own = False
            try:
                self.sandbox.delete()
            except CorralError:
                pass

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Episode in {self.sandbox.id} steps={len(self.steps)} seed={self.seed}>"
