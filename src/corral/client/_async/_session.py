"""A session: sandboxes made with shared defaults and tags, deleted together."""

from __future__ import annotations

import builtins
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import Unpack  # typing's since 3.11 only

from corral.client._async._cleanup import AsyncCleanupOnExit
from corral.client._async._client import AsyncClient
from corral.client._async._sandbox import AsyncSandbox
from corral.client._backends import AsyncBackend
from corral.client._models import SpecFields, spec_body
from corral.errors import CorralError, InvalidState
from corral.schema import SandboxState

logger = logging.getLogger("corral")


class AsyncSession(AsyncCleanupOnExit):
    """Creates sandboxes with shared ``defaults`` and ``tags``; closing it deletes every
    sandbox it created, also when the block ends with an exception.

    Each sandbox also gets the tag ``session=<id>`` (:attr:`tag`), so any process can
    find them with ``Sandbox.list(tags=[session.tag])``.

    Example::

        async with corral.AsyncSession(defaults=dict(image="python", memory_mb=512),
                                       tags=["job=42"]) as session:
            sb = await session.create()                  # image python, 512 MB, tagged
            big = await session.create(memory_mb=2048)   # a default overridden
            print(len(session.sandboxes))                # 2
        # both are deleted here
    """

    def __init__(
        self,
        defaults: Mapping[str, Any] | None = None,
        *,
        tags: Sequence[str] = (),
        client: AsyncClient | None = None,
    ) -> None:
        self.id = "ses-" + secrets.token_hex(6)
        self._defaults = dict(defaults or {})
        self._tags = [*tags, f"session={self.id}"]
        spec_body({**self._defaults, "tags": self._tags})  # fail now on a bad default
        self._client = client
        self._sandboxes: builtins.list[AsyncSandbox] = []
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
    def sandboxes(self) -> builtins.list[AsyncSandbox]:
        """The sandboxes this session created and has not deleted yet."""
        return list(self._sandboxes)

    @property
    def closed(self) -> bool:
        return self._closed

    async def create(self, **overrides: Unpack[SpecFields]) -> AsyncSandbox:
        """Create a sandbox from the defaults, updated with ``overrides`` (the keyword
        arguments of :meth:`AsyncSandbox.create`); tags add up rather than replace."""
        if self._closed:
            raise InvalidState(f"session {self.id} is closed: start a new session")
        fields = {**self._defaults, **overrides}
        fields["tags"] = [
            *self._defaults.get("tags", ()), *self._tags, *overrides.get("tags", ())
        ]
        fields.setdefault("client", self._client)
        sandbox = await AsyncSandbox.create(**fields)
        self._sandboxes.append(sandbox)
        return sandbox

    async def list(
        self, *, state: SandboxState | str | Sequence[SandboxState | str] | None = None
    ) -> builtins.list[AsyncSandbox]:
        """Ask the daemon for this session's sandboxes (by the session tag)."""
        return await AsyncSandbox.list(tags=[self.tag], state=state, client=self._client)

    async def close(self) -> None:
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
            found = await AsyncSandbox.list(tags=[self.tag], client=self._client)
        except CorralError as exc:
            found, errors = [], [exc]
        ids = {sb.id for sb in known}
        doomed = known + [sb for sb in found if sb.id not in ids]
        results = await AsyncBackend.gather([sb.delete for sb in doomed])
        errors += [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) > 1:
                logger.warning("session %s: %d deletions failed", self.id, len(errors))
            raise errors[0]

    async def _cleanup(self) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._sandboxes)} sandboxes"
        return f"<{type(self).__name__} {self.id} {state}>"
