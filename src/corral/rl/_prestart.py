"""Pre-started judges for the code rewards (``code_reward(..., prestart=N)``).

A pre-started judge is a fresh sandbox in which the Python judge
(:mod:`corral.guest.judge`) has already started: its interpreter is up, its modules
imported, it made itself non-dumpable, stopped every other process, forked the solution
process and printed ``READY``. It waits on its stdin for one completion's request
(solution, tests, limits, nonce) — exactly where a judge started for that completion
would be after its start-up. So a reward that takes one pays neither the sandbox's
create nor Python's start-up; everything after ``READY`` is unchanged
(docs/grading.md).

Each one serves ONE completion and is deleted after it, as a sandbox created for the
completion would be: nothing of a completion runs in a sandbox before its request, and
no sandbox ever sees two completions (``tests/rl/test_prestart.py`` proves no state
crosses: files, environment, processes, imported modules). A judge waits at most
:data:`MAX_IDLE_S`; an older one is deleted unused.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any

from corral.client._async._client import AsyncClient
from corral.client._async._process import AsyncProcess
from corral.client._async._sandbox import AsyncSandbox
from corral.errors import CorralError, ExecTimeout
from corral.rl._grading import READY, judge_argv
from corral.rl.code import TRUSTED_ENV
from corral.schema import SandboxInfo

MAX_IDLE_S = 300.0
"""Seconds a pre-started judge may wait for a completion; an older one is deleted unused
(its sandbox's lifetime is this plus the run's timeout plus the reward's margin, so a
process that died between the two still leaves nothing running for long)."""
START_TIMEOUT_S = 60.0
"""Seconds a judge may take to say ``READY`` while the pool fills (a loaded host)."""
PRESTARTED_TAG = "corral.rl.prestarted"


@dataclass(frozen=True)
class Prestarted:
    """One judge waiting in its own sandbox: plain data, bound to no client or loop."""

    sandbox: SandboxInfo
    process: dict[str, Any]
    ready: str
    born: float

    def bind(self, client: AsyncClient) -> tuple[AsyncSandbox, AsyncProcess]:
        """The sandbox and the judge's process, talked to through ``client``."""
        sb = AsyncSandbox(self.sandbox, client=client)
        proc = AsyncProcess(self.process, client=client, args=judge_argv(warm=True))
        return sb, proc


class JudgePool:
    """Pre-started judges of one reward, each used once (see the module docstring).

    ``spec`` is the create body of the reward's sandboxes; ``run_timeout`` the seconds
    one completion's run may take (its judge's process lives ``MAX_IDLE_S`` plus that).
    Entries are plain data, so a pool filled on one event loop serves another.
    ``delete_first``: whether a judge's reply waits for its sandbox's deletion (by
    default it does not: the deletion, begun by the same request, goes on after the
    verdict is back, so the batch's next completion does not wait for a teardown).
    """

    delete_first = False

    def __init__(self, spec: dict[str, Any], run_timeout: float, lifetime_margin: float) -> None:
        self.run_timeout = run_timeout
        self.spec = {
            **spec, "timeout": MAX_IDLE_S + run_timeout + lifetime_margin,
            "tags": [*spec.get("tags", []), PRESTARTED_TAG],
        }
        self._ready: collections.deque[Prestarted] = collections.deque()
        self._stale: list[SandboxInfo] = []
        self._starting = 0
        self.started = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._ready)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy``, ``pickle``: a reward sent to a worker) starts empty: a
        waiting judge is handed out once, by the pool that started it."""
        return {**self.__dict__, "_ready": collections.deque(), "_stale": [], "_starting": 0}

    def take(self) -> Prestarted | None:
        """The oldest judge still young enough, or ``None``; older ones are set aside
        for deletion (:meth:`fill` deletes them)."""
        self._expire()
        return self._ready.popleft() if self._ready else None

    def _expire(self) -> None:
        """Set aside the judges too old to serve a completion (oldest first)."""
        now = time.monotonic()
        while self._ready and now - self._ready[0].born >= MAX_IDLE_S - self.run_timeout:
            self._stale.append(self._ready.popleft().sandbox)

    async def start_one(self, client: AsyncClient) -> Prestarted | None:
        """A new sandbox with its judge at ``READY``, or ``None`` (and nothing left
        running) when it did not get there."""
        sb = await AsyncSandbox.create(client=client, **self.spec)
        try:
            proc = await sb.spawn(judge_argv(warm=True), timeout=MAX_IDLE_S + self.run_timeout,
                                  env=TRUSTED_ENV)
            ready = await proc.exchange(b"", timeout=START_TIMEOUT_S)
        except (CorralError, ExecTimeout):
            ready = None
        if ready is None or ready.strip() != READY:
            self.failed += 1
            await _delete(sb)
            return None
        self.started += 1
        return Prestarted(sb.info, proc._info, ready, time.monotonic())

    async def fill(self, client: AsyncClient, size: int, concurrency: int) -> int:
        """Start judges until ``size`` wait (at most ``concurrency`` starting at once;
        another fill's starts count); returns how many wait. Gives up after
        ``concurrency`` (at least 3) failed starts. Judges too old to serve are
        replaced, so a fill right before a batch leaves none that would send a
        completion the cold way."""
        self._expire()
        await self.drop_stale(client)
        gate = asyncio.Semaphore(concurrency)
        failures = 0

        async def one() -> None:
            nonlocal failures
            try:
                async with gate:
                    entry = await self.start_one(client)
            except CorralError:
                entry = None
            finally:
                self._starting -= 1
            if entry is None:
                failures += 1
            else:
                self._ready.append(entry)

        while (need := size - len(self._ready) - self._starting) > 0 and failures < max(3, concurrency):
            self._starting += need
            await asyncio.gather(*(one() for _ in range(need)))
        while self._starting > 0:  # another fill's starts, still on their way
            await asyncio.sleep(0.02)
        return len(self._ready)

    async def drop_stale(self, client: AsyncClient) -> None:
        stale, self._stale = self._stale, []
        await asyncio.gather(*(_delete(AsyncSandbox(info, client=client)) for info in stale))

    async def drain(self, client: AsyncClient) -> None:
        """Delete every waiting judge's sandbox."""
        self._stale += [e.sandbox for e in self._ready]
        self._ready.clear()
        await self.drop_stale(client)


async def _delete(sb: AsyncSandbox) -> None:
    try:
        await sb.delete()
    except CorralError:
        pass  # the daemon ends it with its lifetime
