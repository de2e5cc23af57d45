"""Templates and the headers every dashboard reply carries.

Every value on the page (tags, names, reasons, error text, eval names) may have been
chosen by a sandbox's code or a hostile client, so templates are rendered with
autoescaping always on, and the Content-Security-Policy lets the page run only the
daemon's own script file (no inline script, no inline handlers, no other origin):
even markup that slipped through escaping could not run.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from typing import Any

from jinja2 import Environment, PackageLoader
from starlette.responses import HTMLResponse

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",  # no-referrer would make forms send Origin: null
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
}


@lru_cache(maxsize=1)
def environment() -> Environment:
    """The templates of ``corral/server/ui/templates``, autoescaped (one per process:
    it holds only compiled templates)."""
    env = Environment(loader=PackageLoader("corral.server.ui", "templates"), autoescape=True)
    env.filters["age"] = age
    env.filters["num"] = num
    env.filters["mb"] = lambda v: "" if v is None else f"{v:.0f} MB"
    return env


def render(name: str, **context: Any) -> str:
    return environment().get_template(name).render(**context)


def page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(render(name, **context), status_code=status)


def age(since: float | None) -> str:
    """``1h 02m`` since a unix time."""
    if not since:
        return ""
    s = max(0, int(time.time() - since))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def num(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}g}"
