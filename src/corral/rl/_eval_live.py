"""Pre-started episode runners for :func:`corral.rl.evaluate` (``prestart``).

Without them, every episode's sandbox starts ``python3 runner.py run SEED:K`` and pays
Python's start-up, gymnasium's and numpy's import, the policy's load and ``make`` before
its first step: ~150 ms of CPU a CartPole sandbox, most of what it costs. With them, the
base sandbox (created checkpointable) starts ``runner.py serve`` after the check; that
process loads everything, says ``READY`` and waits on its stdin. corral then takes a
**live** snapshot (CRIU) of the base instead of a files-only one, and every episode's
sandbox is restored from it with that process already at ``READY``: the episode's keys
go to its stdin, its records come back on stdout, and it exits.

Isolation is unchanged: each episode's sandbox is still a new sandbox restored from the
evaluation's snapshot, deleted after its episodes, and no two see each other. The copy
of the runner in it has run nothing of any episode (seeds arrive after the restore), and
it answers one line and ends: never reused (``tests/rl/test_eval_prestart.py`` proves no
state crosses). Episodes are seeded in the copy exactly as in a fresh runner, so the
records and digests are the same either way.

Where the host cannot checkpoint (no CRIU, or CRIU refuses the process) the evaluation
falls back to the files-only snapshot and fresh runners. ``prestart=False`` never
pre-starts; the default (``None``) does for gymnasium envs, not for tic-tac-toe, whose
runner starts in less CPU than a restore costs (``prestart=True`` still may: a restored
tic-tac-toe sandbox cost 155 ms of CPU in all against a fresh one's 84 ms).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import corral
from corral.errors import CorralError, ExecTimeout

logger = logging.getLogger("corral.rl")

READY = "READY"
START_TIMEOUT_S = 180.0
"""Seconds the base's runner may take to load everything (a loaded host)."""
MAX_STDOUT = 1 << 20
STDOUT_TAIL = 256 << 10


async def live_snapshot(base: corral.AsyncSandbox, argv: list[str], env: dict[str, str],
                        cwd: str) -> tuple[corral.AsyncSnapshot, str] | None:
    """Start the runner's ``serve`` in ``base``, and once it is ``READY`` checkpoint the
    sandbox: ``(live snapshot, the runner's process id)``, or ``None`` when the host
    cannot (then ``base`` is as before, the runner ended)."""
    proc = await base.spawn(argv, env=env, cwd=cwd, timeout=None)
    try:
        line = await proc.exchange(b"", timeout=START_TIMEOUT_S)
    except ExecTimeout:
        line = ""
    if line.strip() != READY:
        await _end(proc)
        return None
    try:
        return await base.checkpoint(), proc.id
    except CorralError as exc:  # no CRIU (Unsupported), or it refused what the policy made
        logger.info("evaluation: no live snapshot of sandbox %s (%s): fresh runners", base.id, exc)
        await _end(proc)
        return None


async def serve(sb: corral.AsyncSandbox, process_id: str, items: list[str],
                timeout: float) -> corral.CommandResult:
    """Send ``items`` to the restored runner in ``sb`` and wait for its end: how it
    ended, like ``sb.exec`` (``timed_out`` once past ``timeout`` seconds: killed).
    Of its stdout the first :data:`MAX_STDOUT` and the last :data:`STDOUT_TAIL` bytes are
    kept, as ``exec`` keeps its default ``max_output``: the policy shares the runner's
    stdout, and one printing without end must not fill this process's memory."""
    proc = await sb.process(process_id)
    await proc.write(" ".join(items) + "\n")
    deadline = time.monotonic() + timeout
    head, tail = bytearray(), bytearray()
    timed_out = False
    try:
        # the process's own reader: wait() would keep every byte it printed
        while (chunk := await proc._next_chunk(deadline, "its records")) is not None:
            if chunk.stream != "stdout":
                continue
            room = MAX_STDOUT - len(head)
            head += chunk.data[:room]
            tail += chunk.data[room:]
            del tail[:-STDOUT_TAIL]
    except ExecTimeout:
        timed_out = True
        with contextlib.suppress(CorralError):  # it may have ended meanwhile
            await proc.signal("SIGKILL")
        while (chunk := await proc._next_chunk(None)) is not None:
            pass  # what it printed after its time is not its record
    assert proc.result is not None
    return dataclasses.replace(proc.result, stdout_bytes=bytes(head + b"\n" + tail),
                               timed_out=timed_out or proc.result.timed_out)


async def _end(proc: corral.AsyncProcess) -> None:
    try:
        await proc.kill()
    except CorralError:
        pass  # already gone
