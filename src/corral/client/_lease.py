"""A client lease's heartbeat (``Session(lease=...)``; the daemon's side is
``corral.server.leases``).

The renewals run on a thread of their own with a small blocking HTTP client of their
own, for the asyncio session too: a training step that holds the event loop (or the
GIL in C code that releases it) for longer than the lease must not let the lease
expire while the process lives. When the process dies, so does the thread: the
daemon ends the lease's sandboxes ``ttl`` seconds after the last renewal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import httpx

from corral.api.operations import operation
from corral.client._config import Endpoint
from corral.client._unix import DaemonTransport
from corral.errors import CorralError, LeaseNotFound

logger = logging.getLogger("corral")

RENEWALS_PER_TTL = 3  # renewed every ttl / 3: two renewals may be lost in a row
EXPIRY_MARGIN = 0.8  # not renewed for this part of a ttl: treated as maybe expired


class Heartbeat:
    """Renews lease ``lease_id`` every ``ttl / 3`` seconds until :meth:`stop`."""

    def __init__(self, url: str | None, token: str | None, lease_id: str, ttl: float) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self.lost = False  # the daemon no longer knows the lease (it expired)
        self.renewed = time.monotonic()  # when the daemon last renewed it (or made it)
        self._endpoint = Endpoint.resolve(url, token)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"corral-{lease_id}",
                                        daemon=True)
        self._thread.start()

    def _attempts(self) -> Iterator[tuple[float, float]]:
        """Yield once per renewal to send, with its time limit, until :meth:`stop`.

        Renewals start every ``ttl / 3`` seconds counted from the previous one's start
        (not its end: a slow reply does not push the next one back), at once when one
        took longer than that. A renewal may take until the lease would expire on the
        daemon (at least ``ttl / 3``): on a loaded host a reply slower than the interval
        still renews the lease, where cutting it off would let it lapse."""
        every = self.ttl / RENEWALS_PER_TTL
        due = time.monotonic() + every
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            due = now + every
            yield now, max(every, self.renewed + self.ttl - now)

    def _run(self) -> None:
        if self._endpoint.cluster is not None:
            self._run_on_cluster()
            return
        endpoint = self._endpoint
        renew = operation("renew_lease")
        with httpx.Client(base_url=endpoint.base_url, headers=endpoint.headers(),
                          # on a Unix socket: only to root's or this user's (SO_PEERCRED)
                          transport=DaemonTransport(uds=endpoint.uds, limits=httpx.Limits()),
                          timeout=self.ttl) as http:
            for sent, limit in self._attempts():  # the daemon renews it after ``sent``
                try:
                    reply = http.request(renew.method, renew.url(lease_id=self.lease_id),
                                         timeout=limit)
                except httpx.HTTPError as exc:  # a daemon restarting: the next one may do
                    logger.warning("could not renew lease %s: %s", self.lease_id, exc)
                    continue
                if reply.status_code == 404:
                    self._lose()
                    return
                if reply.status_code < 400:
                    self.renewed = sent
                else:
                    logger.warning("could not renew lease %s: HTTP %d %s", self.lease_id,
                                   reply.status_code, reply.text[:200])

    def _run_on_cluster(self) -> None:
        """On ``ray://``: renewed on every node through a blocking client's router
        (``_leases``), since each node's daemon ends its own sandboxes."""
        from corral.client._sync._client import Client  # (it imports this module)

        with Client(self._endpoint.url, token=self._endpoint.token, timeout=self.ttl) as client:
            for sent, limit in self._attempts():
                try:
                    client.call("renew_lease", {"lease_id": self.lease_id}, timeout=limit)
                    self.renewed = sent
                except LeaseNotFound:
                    self._lose()
                    return
                except CorralError as exc:  # a node restarting: the next renewal may do
                    logger.warning("could not renew lease %s: %s", self.lease_id, exc)

    def _lose(self) -> None:
        self.lost = True
        logger.error("lease %s expired before it was renewed: its sandboxes were stopped",
                     self.lease_id)

    def may_have_expired(self) -> bool:
        """Lost, or not renewed for most of a ttl (this process stood still; the margin
        covers a round trip before the first renewal): what the daemon held under it may
        be gone."""
        return self.lost or time.monotonic() - self.renewed >= EXPIRY_MARGIN * self.ttl

    def stop(self) -> None:
        """Stop renewing (the thread ends within one interval; nothing waits for it)."""
        self._stop.set()
