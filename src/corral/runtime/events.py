"""What the engine announces: a sandbox started, changed state, ended, was deleted;
a command ended, a pool handed out a sandbox.

Admission control, pools, metrics and the process tables subscribe here instead of
polling the engine for sandboxes that went away. Listeners are called synchronously,
on the engine's event loop, right after the registry records the change; they must
be quick and must not raise (an exception is logged and the others still run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from corral.schema import ExecResult, SandboxState

log = logging.getLogger("corral.runtime")


@dataclass(frozen=True)
class StateChanged:
    sandbox_id: str
    old: SandboxState
    new: SandboxState
    reason: str | None


@dataclass(frozen=True)
class SandboxEnded:
    """The sandbox's processes, mounts and cgroups are gone (``state`` is terminal)."""

    sandbox_id: str
    state: SandboxState
    reason: str


@dataclass(frozen=True)
class SandboxHibernated:
    """The sandbox hibernated: its processes are gone and its memory given back; it
    stays listed, and its resume starts it again (runtime/engine_hibernate.py)."""

    sandbox_id: str


@dataclass(frozen=True)
class SandboxStarted:
    """A create finished: the sandbox is running (``snapshot``: the one it started from;
    ``tenant``: its owner, None the admin's)."""

    sandbox_id: str
    snapshot: str | None
    tenant: str | None = None


@dataclass(frozen=True)
class SandboxDeleted:
    """The sandbox's record was removed (its logs are kept for the retention period,
    readable by its owner ``tenant``; None: the admin's)."""

    sandbox_id: str
    tenant: str | None = None


@dataclass(frozen=True)
class CommandEnded:
    """A command (``exec``/``exec_stream``) ended, however it ended: announced once, with
    what its sandbox's log keeps (tails of a few KiB at most, :mod:`corral.runtime.cmdtap`)
    and, for metrics, its result.

    ``outcome`` is ``exit``, ``timeout``, ``oom`` or ``killed`` (cut short by its caller
    or its sandbox ending; then ``result`` is None); ``exit_code`` is None unless it exited.
    """

    sandbox_id: str
    argv: tuple[str, ...]
    started_at: float
    ended_at: float
    outcome: str
    exit_code: int | None
    stdout_tail: bytes
    stderr_tail: bytes
    result: ExecResult | None = None


@dataclass(frozen=True)
class Forking:
    """A fork of ``source`` starts its copies from ``snapshot`` (``done``: it finished,
    however): a :class:`SandboxStarted` from that snapshot meanwhile is a fork's copy."""

    source: str
    snapshot: str
    done: bool = False


@dataclass(frozen=True)
class PoolAcquired:
    """A warm pool handed out a live sandbox ``seconds`` after the acquire began."""

    pool: str
    sandbox_id: str
    seconds: float


Listener = Callable[[object], None]


class Events:
    """A small synchronous publisher: ``subscribe(SandboxEnded, fn)`` → unsubscribe."""

    def __init__(self) -> None:
        self._listeners: dict[type, list[Callable[..., None]]] = {}

    def subscribe(self, kind: type, listener: Callable[..., None]) -> Callable[[], None]:
        listeners = self._listeners.setdefault(kind, [])
        listeners.append(listener)

        def unsubscribe() -> None:
            if listener in listeners:
                listeners.remove(listener)

        return unsubscribe

    def emit(self, event: object) -> None:
        for listener in list(self._listeners.get(type(event), ())):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - one listener never breaks the engine
                log.exception("a listener of %s failed", type(event).__name__)
