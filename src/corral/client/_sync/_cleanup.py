# Generated from _async/_cleanup.py by scripts/gen_sync.py: edit that file, not this one.
# ruff: noqa: I001  (the imports keep the source's order, sorted for _async)
"""``with`` support for objects that own something on the daemon."""

from __future__ import annotations

import logging

from typing_extensions import Self  # typing's since 3.11 only

logger = logging.getLogger("corral")


class CleanupOnExit:
    """Run :meth:`_cleanup` when an ``with`` block ends, however it ends.

    A cleanup that fails after the block raised is logged, not raised: the error
    that ended the block is the one the caller needs to see.
    """

    def _cleanup(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self._cleanup()
            return
        try:
            self._cleanup()
        except Exception as exc:
            logger.warning("%r: cleanup after %s failed: %s", self, exc_type.__name__, exc)
