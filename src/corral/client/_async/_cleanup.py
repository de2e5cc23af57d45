"""``async with`` support for objects that own something on the daemon."""

from __future__ import annotations

import logging

from typing_extensions import Self  # typing's since 3.11 only

logger = logging.getLogger("corral")


class AsyncCleanupOnExit:
    """Run :meth:`_cleanup` when an ``async with`` block ends, however it ends.

    A cleanup that fails after the block raised is logged, not raised: the error
    that ended the block is the one the caller needs to see.
    """

    async def _cleanup(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            await self._cleanup()
            return
        try:
            await self._cleanup()
        except Exception as exc:
            logger.warning("%r: cleanup after %s failed: %s", self, exc_type.__name__, exc)
