"""Wrong credentials are throttled: guessing a token costs time, per address and per name.

Every request that presents a credential over TCP and is refused counts as a failure
against two keys: its **client address**, and the **name** of what it tried (the
admin token; a tenant token, whose value names no tenant before it is checked, so
tenant guesses share one name; a per-sandbox token, by the token that minted it). Past :data:`FREE_FAILURES` failures a key
is blocked for a time that doubles with each further failure (:data:`FIRST_BLOCK_S`,
at most :data:`MAX_BLOCK_S`). Failures leak away (one per :data:`DECAY_S` for an
address, :data:`NAME_DECAY_S` for a name), so an occasional typo never blocks anyone,
and a key with no failure for :data:`FORGET_S` starts over.

While a key is blocked, a request it covers is answered 429 ``too_many_requests``
with ``Retry-After`` *before its credential is checked*, so a blocked guesser learns
nothing, however many connections it opens. Two exceptions keep the owner in:

- the Unix socket is never throttled (its owner is the admin);
- a blocked *name* does not refuse an address that presented that name successfully
  before (remembered :data:`FORGET_S`): a crowd of new addresses guessing the admin
  token is held off, the admin's own machine is not. A blocked *address* refuses
  everything from it.

The dashboard's login form asks the same guard (:mod:`corral.server.ui.gate`), so it is
throttled the same way. :func:`weak_token_warning` is what the daemon logs at start when
its own token is short.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from corral.errors import TooManyRequests

FREE_FAILURES = 20  # per address
NAME_FREE_FAILURES = 50  # per name, all addresses together
DECAY_S = 2.0  # one failure of an address is forgotten every this long
NAME_DECAY_S = 0.5  # ... of a name
FIRST_BLOCK_S = 1.0
MAX_BLOCK_S = 60.0
FORGET_S = 600.0
MAX_KEYS = 65_536  # failure records kept at once (the stalest are dropped first)
MIN_TOKEN_CHARS = 32
TENANT_PREFIX = "crl_"  # corral.server.tenants.TOKEN_PREFIX
ADMIN_NAME, TENANT_NAME = "the admin token", "tenant tokens"
_PINNED = {("name", ADMIN_NAME), ("name", TENANT_NAME)}


@dataclass
class _Record:
    failures: float = 0.0
    last: float = 0.0
    blocked_until: float = 0.0


def name_of(credential: str) -> str:
    """The name a credential's failures count against (see the module docstring): a
    per-sandbox token (``TOKEN_ID.MAC``) names the token that minted it."""
    minter, dot, _ = credential.rpartition(".")
    if dot and minter:
        return f"the sandbox tokens of {minter[:64]}"
    return TENANT_NAME if credential.startswith(TENANT_PREFIX) else ADMIN_NAME


def retry_headers(refusal: TooManyRequests) -> dict[str, str]:
    """The reply headers of a throttled request (its connection is closed)."""
    return {"Retry-After": str(refusal.details.get("retry_after", 1)), "Connection": "close"}


class AuthThrottle:
    """The failure records of one daemon (see the module docstring)."""

    def __init__(self, free: int = FREE_FAILURES, name_free: int = NAME_FREE_FAILURES,
                 first: float = FIRST_BLOCK_S, most: float = MAX_BLOCK_S,
                 forget: float = FORGET_S) -> None:
        self.free, self.name_free = free, name_free
        self.decay, self.name_decay = DECAY_S, NAME_DECAY_S
        self.first, self.most, self.forget = first, most, forget
        self._records: OrderedDict[tuple[str, str], _Record] = OrderedDict()
        self._good: OrderedDict[tuple[str, str], float] = OrderedDict()  # (name, address)
        self.refused = 0

    def refusal(self, address: str, credential: str | None) -> TooManyRequests | None:
        """The 429 for a request from ``address`` presenting ``credential``, if a key it
        falls under is blocked now; None: check it."""
        now = time.monotonic()
        wait = self._blocked(("address", address), now)
        what = f"client {address}"
        if not wait and credential is not None:
            name = name_of(credential)
            if not self._known_good(name, address, now):
                wait = self._blocked(("name", name), now)
                what = f"{name} (from addresses that never used it)"
        if not wait:
            return None
        self.refused += 1
        seconds = max(1, int(wait + 0.999))
        return TooManyRequests(
            f"too many failed authentications for {what}: wait {seconds} s before trying "
            "again (each further failure doubles the wait; the Unix socket is never throttled)",
            details={"limit": "failed_authentications", "retry_after": seconds},
        )

    def failed(self, address: str, credential: str | None) -> None:
        """A request from ``address`` was refused for ``credential`` (None: it carried
        none, which is no guess and not counted)."""
        if credential is None:
            return
        now = time.monotonic()
        self._fail(("address", address), now, self.free, self.decay)
        self._fail(("name", name_of(credential)), now, self.name_free, self.name_decay)

    def succeeded(self, address: str, credential: str | None) -> None:
        """``credential`` opened the daemon from ``address``: remembered, so a blocked
        name does not lock that address out."""
        if credential is None:
            return
        key = (name_of(credential), address)
        self._good[key] = time.monotonic()
        self._good.move_to_end(key)
        while len(self._good) > MAX_KEYS:
            self._good.popitem(last=False)

    def _known_good(self, name: str, address: str, now: float) -> bool:
        seen = self._good.get((name, address))
        return seen is not None and now - seen < self.forget

    def _blocked(self, key: tuple[str, str], now: float) -> float:
        record = self._records.get(key)
        return max(0.0, record.blocked_until - now) if record is not None else 0.0

    def _fail(self, key: tuple[str, str], now: float, free: int, decay: float) -> None:
        record = self._records.pop(key, None)
        if record is None or now - record.last > self.forget:
            record = _Record()
        self._records[key] = record  # the most recent last
        # a leaky bucket: a slow trickle of mistakes never blocks anyone
        record.failures = max(0.0, record.failures - (now - record.last) / decay) + 1
        record.last = now
        over = record.failures - free
        if over > 0:
            # the exponent is capped: 2.0 ** 1024 overflows (then every failure would
            # raise instead of extending the block)
            record.blocked_until = now + min(self.most, self.first * 2 ** min(over - 1, 64))
        while len(self._records) > MAX_KEYS:
            # the admin's and the tenants' names are never pushed out by a crowd of
            # fresh addresses (their block would be lifted): they go to the back
            stale, kept = self._records.popitem(last=False)
            if stale in _PINNED:
                self._records[stale] = kept


def weak_token_warning(token: str | None) -> str | None:
    """What to log when the daemon's token is shorter than :data:`MIN_TOKEN_CHARS`."""
    if token is None or len(token) >= MIN_TOKEN_CHARS:
        return None
    return (f"the daemon's token (--token / CORRAL_TOKEN) is only {len(token)} characters: "
            f"anyone who reaches its TCP port may guess it; use at least {MIN_TOKEN_CHARS} "
            "random characters, e.g. `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`")
