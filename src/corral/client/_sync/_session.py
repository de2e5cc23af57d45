# Generated from _async/_session.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""A session: sandboxes made with shared defaults and tags, deleted together; with a
lease, also ended by the daemon soon after the process that made them dies."""

from __future__ import annotations

import builtins
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import Unpack  # typing's since 3.11 only

from corral.client._sync._cleanup import CleanupOnExit
from corral.client._sync._client import Client
from corral.client._sync._sandbox import Sandbox
from corral.client._backends import SyncBackend
from corral.client._lease import Heartbeat
from corral.client._models import SpecFields, spec_body
from corral.client._validate import check_lease
from corral.errors import CorralError, InvalidState, LeaseNotFound
from corral.schema import SandboxState

logger = logging.getLogger("corral")


class Session(CleanupOnExit):
    """Creates sandboxes with shared ``defaults`` and ``tags``; closing it deletes every
    sandbox it created, also when the block ends with an exception.

    Each sandbox also gets the tag ``session=<id>`` (:attr:`tag`), so any process can
    find them with ``Sandbox.list(tags=[session.tag])``.

    ``lease`` (seconds) ties the session's sandboxes to this process: the session takes
    a lease from the daemon at its first create and renews it every ``lease / 3``
    seconds from a thread; if the process dies (``kill -9``, a crashed trainer) the
    daemon stops them about ``lease`` seconds later, with the reason ``lease expired``,
    instead of at the end of their lifetime. Left out, a session over TCP takes the
    daemon's ``--default-lease`` if it has one; ``lease=0`` takes none.

    Example::

        with corral.Session(defaults=dict(image="python", memory_mb=512),
                                       tags=["job=42"]) as session:
            sb = session.create()                  # image python, 512 MB, tagged
            big = session.create(memory_mb=2048)   # a default overridden
            print(len(session.sandboxes))                # 2
        # both are deleted here
    """

    def __init__(
        self,
        defaults: Mapping[str, Any] | None = None,
        *,
        tags: Sequence[str] = (),
        client: Client | None = None,
        lease: float | None = None,
    ) -> None:
        self.id = "ses-" + secrets.token_hex(6)
        self._lease = check_lease(lease)
        self._lease_lock = SyncBackend.lock()
        self._lease_taken = False
        self._heartbeat: Heartbeat | None = None
        self._defaults = dict(defaults or {})
        self._tags = [*tags, f"session={self.id}"]
        spec_body({**self._defaults, "tags": self._tags})  # fail now on a bad default
        self._client = client
        self._sandboxes: builtins.list[Sandbox] = []
        self._closed = False

    @property
    def tag(self) -> str:
        """``session=<id>``: the tag only this session's sandboxes carry."""
        return self._tags[-1]

    @property
    def tags(self) -> builtins.list[str]:
        """The tags every sandbox of this session gets."""
        return list(self._tags)

    @property
    def lease_id(self) -> str | None:
        """The id of the session's lease (taken at the first create), if it has one."""
        return self._heartbeat.lease_id if self._heartbeat is not None else None

    @property
    def sandboxes(self) -> builtins.list[Sandbox]:
        """The sandboxes this session created and has not deleted yet."""
        return list(self._sandboxes)

    @property
    def closed(self) -> bool:
        return self._closed

    def create(self, **overrides: Unpack[SpecFields]) -> Sandbox:
        """Create a sandbox from the defaults, updated with ``overrides`` (the keyword
        arguments of :meth:`Sandbox.create`); tags add up rather than replace."""
        if self._closed:
            raise InvalidState(f"session {self.id} is closed: start a new session")
        self._take_lease()
        fields = {**self._defaults, **overrides}
        fields["tags"] = [
            *self._defaults.get("tags", ()), *self._tags, *overrides.get("tags", ())
        ]
        fields.setdefault("client", self._client)
        sandbox = Sandbox.create(**fields)
        self._sandboxes.append(sandbox)
        return sandbox

    def _take_lease(self) -> None:
        """At the first create: the session's lease, and its heartbeat."""
        with self._lease_lock:
            if self._lease_taken:
                return
            client = self._client or Client.default()
            ttl = self._lease
            if ttl is None and client.over_tcp:
                ttl = (client.info()).get("default_lease")
            if ttl:
                reply = (client.call("create_lease", json={"ttl": ttl})).json()
                self._tags.insert(-1, reply["tag"])  # (the session tag stays last)
                args = client.connect_args
                self._heartbeat = Heartbeat(args["url"], args["token"], reply["id"], ttl)
            self._lease_taken = True

    def list(
        self, *, state: SandboxState | str | Sequence[SandboxState | str] | None = None
    ) -> builtins.list[Sandbox]:
        """Ask the daemon for this session's sandboxes (by the session tag)."""
        return Sandbox.list(tags=[self.tag], state=state, client=self._client)

    def close(self) -> None:
        """Delete every sandbox of the session, concurrently; closing twice is fine.

        Sandboxes the daemon lists with the session's tag are deleted too (a create
        whose reply was lost still made one). The first error, if any, is raised
        after every deletion has been tried.
        """
        if self._closed:
            return
        self._closed = True
        known, self._sandboxes = self._sandboxes, []
        errors: builtins.list[BaseException] = []
        try:
            found = Sandbox.list(tags=[self.tag], client=self._client)
        except CorralError as exc:
            found, errors = [], [exc]
        ids = {sb.id for sb in known}
        doomed = known + [sb for sb in found if sb.id not in ids]
        results = SyncBackend.gather([sb.delete for sb in doomed])
        errors += [r for r in results if isinstance(r, BaseException)]
        if self._heartbeat is not None:
            self._heartbeat.stop()
            try:
                client = self._client or Client.default()
                client.call("release_lease", {"lease_id": self._heartbeat.lease_id})
            except LeaseNotFound:
                pass
            except CorralError as exc:
                errors.append(exc)
        if errors:
            if len(errors) > 1:
                logger.warning("session %s: %d deletions failed", self.id, len(errors))
            raise errors[0]

    def _cleanup(self) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._sandboxes)} sandboxes"
        return f"<{type(self).__name__} {self.id} {state}>"
