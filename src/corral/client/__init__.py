"""The Python SDK: blocking, asyncio and futures styles over one HTTP client.

Everything public is re-exported by :mod:`corral`; import it from there.
"""

import sys


def _import_httpx_without_its_command_line() -> None:
    """Import httpx without ``httpx._main``, its command line, which its ``__init__``
    imports whenever click, rich and pygments are installed (they are: corral's CLI
    uses rich): about a tenth of ``import corral``'s CPU in every worker, for a
    ``httpx.main`` the SDK never calls. ``None`` in ``sys.modules`` makes that import
    fail, and httpx then binds its own stub (which says the CLI's extras are missing);
    the entry is removed at once, so ``import httpx._main`` still works afterwards.
    Nothing is done when httpx is already imported."""
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        return
    sys.modules["httpx._main"] = None  # type: ignore[assignment]
    try:
        import httpx  # noqa: F401
    finally:
        if sys.modules.get("httpx._main", 0) is None:
            del sys.modules["httpx._main"]


_import_httpx_without_its_command_line()
