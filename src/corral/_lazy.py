"""Names a package exports but imports only when first used (PEP 562).

``import corral`` is paid by every reward worker, rollout process and ``corral`` command
line; most use a sandbox and nothing else. A package lists the rest as ``{name: module}``
and gets a module ``__getattr__`` that imports the module on first access, then keeps
the name in the package's namespace (the next access is a plain attribute read)::

    if TYPE_CHECKING:  # type checkers and the docs see ordinary imports
        from corral.client._sync._pool import Pool
    else:
        __getattr__, __dir__ = attach(__name__, {"Pool": "corral.client._sync._pool"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attach"]


def attach(package: str, lazy: Mapping[str, str]
           ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, which exports each name of
    ``lazy`` from the module its value names."""
    table = dict(lazy)

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *table})

    return __getattr__, __dir__
