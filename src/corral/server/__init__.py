"""corral.server: the daemon that drives the engine and speaks the HTTP API.

Build the ASGI app with :func:`create_app` (around an open engine), or run a whole
daemon with :func:`serve` (blocking) / ``python -m corral.server``. The API is
described in ``docs/api.md`` and served as ``GET /openapi.json``.
"""

from corral.server.admission import Admission, Limits
from corral.server.app import create_app
from corral.server.daemon import serve
from corral.server.settings import ServerSettings

__all__ = ["Admission", "Limits", "ServerSettings", "create_app", "serve"]
