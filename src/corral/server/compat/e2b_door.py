"""Who an E2B request is, for the daemon's door: E2B's SDK sends its control API's key
(``X-API-KEY``) or, to envd and the Code Interpreter, a sandbox's access token
(``E2b-Sandbox-Id`` + ``X-Access-Token``); :func:`credentials` reads them from the
headers alone (nothing is read before) and marks the request for
:class:`~corral.server.compat.e2b_api.Dispatch`; :func:`refusal` words a refused one
as the SDK expects (``AuthenticationException``); :func:`traffic_target` finds the
sandbox and port of a request to ``get_host(port)``'s address.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from corral.errors import Unauthorized
from corral.server.caller import Caller
from corral.server.compat import e2b_interpreter
from corral.server.door import ENVD, TRAFFIC, Credential, Kind

MARK = "corral.e2b"  # scope key the guard sets: "api", "envd" or "jupyter"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


WRONG_KEY = ("wrong API key: set E2B_API_KEY to the token the corral daemon was started "
             "with (--token or CORRAL_TOKEN) or to a tenant token (corral token create)")
WRONG_ACCESS = ("wrong, missing or revoked X-Access-Token for this sandbox: connect to it "
                "with Sandbox.connect(sandbox_id) using a live token as E2B_API_KEY")


def credentials(scope: Scope) -> tuple[Credential, ...] | None:
    """For the door: None if the request is not E2B's; else the credentials it
    carries (the scope is marked for :class:`Dispatch`): the control API's key, or
    envd's per-sandbox access token (the Code Interpreter's ``/contexts`` calls may
    send only the traffic token)."""
    sandbox_id = _header(scope, b"e2b-sandbox-id")
    key = _header(scope, b"x-api-key")
    if sandbox_id is None and key is None:
        return None
    jupyter = _header(scope, b"e2b-sandbox-port") == e2b_interpreter.PORT
    scope[MARK] = "api" if sandbox_id is None else "jupyter" if jupyter else "envd"
    if sandbox_id is None:  # the control API: the daemon's token or a tenant's
        return (Credential(key or "", wrong=WRONG_KEY),)
    found = [Credential(_header(scope, b"x-access-token"), Kind.SANDBOX, sandbox_id, ENVD,
                        wrong=WRONG_ACCESS)]
    if jupyter:
        found.append(Credential(_header(scope, b"e2b-traffic-access-token"), Kind.SANDBOX,
                                sandbox_id, TRAFFIC, wrong=WRONG_ACCESS))
    return tuple(found)


_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9-]{1,64})\.")


def traffic_target(
    scope: Scope, opens: Callable[[str, str], Caller | None]
) -> tuple[str, int, str] | None:
    """``(sandbox id, port, minting token's id)`` of a request to ``get_host(port)``'s
    address (Host ``PORT-ID.domain``) carrying that sandbox's traffic access token
    (``e2b-traffic-access-token``, from the create reply; ``opens`` is the door's
    check, so a revoked tenant's token opens nothing, and the relay is held under the
    token that minted it: its revoke ends the relay); None for any other."""
    host, traffic = _header(scope, b"host"), _header(scope, b"e2b-traffic-access-token")
    if host is None or traffic is None or _header(scope, b"e2b-sandbox-id"):
        return None
    m = _HOST_RE.match(host.lower())
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        return None
    sandbox_id = m.group(2)
    minter = opens(sandbox_id, traffic)
    if minter is None:
        return None
    return sandbox_id, int(m.group(1)), minter.token_id


def refusal(scope: Scope, err: Unauthorized, headers: dict[str, str]) -> Response | None:
    """The reply to an E2B request :func:`authenticate` refused, in the shape its
    client turns into ``AuthenticationException``; None for any other request."""
    kind = scope.get(MARK)
    if kind == "api":
        body: dict[str, Any] = {"code": err.status, "message": err.message}
    elif kind == "jupyter":
        body = {"code": err.status, "message": err.message}
    elif kind == "envd":
        body = {"code": "unauthenticated", "message": err.message}
    else:
        return None
    return JSONResponse(body, status_code=err.status, headers=headers)
