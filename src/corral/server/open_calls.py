"""Every call a credential has open, so that revoking it ends them all at once.

The door (:class:`~corral.server.door.Door`) registers each request and each gRPC
call while it runs, under its caller's keys (:meth:`~corral.server.caller.Caller.keys`:
its token, its dashboard session). :meth:`OpenCalls.close` cancels every call of a key:
a revoked token's exec streams, process output, ``logs?follow=1``, the dashboard's
live stream, envd's streams and gRPC exec calls end at once, and a dashboard logout
ends what that session opened. A cancelled command is killed, as when its client
hangs up.

A key once closed stays closed (a revoked token is final, an ended session too): a
call registered under it later, one that passed the door just before the revoke and
reached :meth:`OpenCalls.holding` just after (a gRPC call's handler runs a loop turn
after its credential was checked), is cancelled as it registers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from corral.server.caller import Caller, session_key, token_key

__all__ = ["OpenCalls"]

Cancel = Callable[[], object]
MAX_CLOSED = 65_536  # closed keys remembered (sessions come and go: the oldest are dropped)


class OpenCalls:
    """Cancel handles of the calls in flight, by caller key (one daemon's, in memory)."""

    def __init__(self) -> None:
        self._by_key: dict[str, dict[int, Cancel]] = {}
        self._next = 0
        self._closed: OrderedDict[str, None] = OrderedDict()

    @contextmanager
    def holding(self, caller: Caller, cancel: Cancel) -> Iterator[None]:
        """Keep ``cancel`` under ``caller``'s keys while the block runs."""
        keys = caller.keys()
        if not keys:  # the admin's own requests: nothing can revoke them
            yield
            return
        self._next += 1
        handle = self._next
        for key in keys:
            self._by_key.setdefault(key, {})[handle] = cancel
        if any(key in self._closed for key in keys):
            cancel()  # revoked between the door and here: it ends at its first wait
        try:
            yield
        finally:
            for key in keys:
                held = self._by_key.get(key)
                if held is not None:
                    held.pop(handle, None)
                    if not held:
                        del self._by_key[key]

    def close(self, key: str) -> int:
        """Cancel every call held under ``key``, and any held under it later; how many."""
        self._closed[key] = None
        self._closed.move_to_end(key)
        while len(self._closed) > MAX_CLOSED:
            self._closed.popitem(last=False)
        held = self._by_key.pop(key, {})
        for cancel in held.values():
            cancel()
        return len(held)

    def close_token(self, token_id: str) -> int:
        """A token was revoked: end every call it (or a token it minted) opened."""
        return self.close(token_key(token_id))

    def close_session(self, session: str) -> int:
        """A dashboard session ended: end every call it opened."""
        return self.close(session_key(session))

    def count(self, key: str) -> int:
        return len(self._by_key.get(key, ()))
