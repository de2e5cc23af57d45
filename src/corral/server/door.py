"""The door: every credential of every front-end is checked here, once.

A request (HTTP, on either listener) or a gRPC call comes in with some credential;
:meth:`Door.authenticate` (HTTP) or :meth:`Door.bearer` (gRPC) turns it into a
:class:`~corral.server.caller.Caller` or a refusal, and nothing else in the daemon
decides who a caller is. Front-ends only say where their clients put the credential
(:data:`Extract` functions: E2B's ``X-API-KEY`` and per-sandbox access tokens,
SandboxFusion's token in the path), in the order given; then:

- a request on the daemon's own Unix socket (mode 0600) is the admin;
- ``Authorization: Bearer TOKEN``: the daemon's token (the admin), a tenant's token,
  or the cluster's peer credential (the read-only peer routes only);
- anything else is refused before its body is read.

Per-sandbox tokens (:meth:`Door.mint`) name the token that minted them and the sandbox
they open: ``<token id>.<HMAC>``. One opens its sandbox only, acting as its minter's
tenant, and only while the minting token is alive: a revoked tenant's access tokens
die with it.

The door also keeps every call in flight by caller (:class:`OpenCalls`): revoking a
token (:meth:`revoke`) or ending a dashboard session (:meth:`end_session`) cancels
them all.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.types import Scope as AsgiScope

from corral.errors import CorralError, Forbidden, Unauthorized
from corral.server.caller import ADMIN, CALLER_KEY, PEER, UNIDENTIFIED, Caller, Scope
from corral.server.open_calls import OpenCalls
from corral.server.peer_auth import PeerCredential
from corral.server.tenant_model import ADMIN_NAME
from corral.server.tenants import Tenants

__all__ = ["Credential", "Door", "Extract", "Kind", "SESSION_KEY"]

SESSION_KEY = "corral.ui_session"  # the dashboard's gate puts a session's id here
_FOUND_KEY = "corral.credentials"  # what the front-ends' extractors found, once per request
ENVD = b"e2b-envd:"  # labels of per-sandbox tokens: what each one opens
TRAFFIC = b"e2b-traffic:"


class Kind(enum.Enum):
    """How a credential is checked."""

    BEARER = "bearer"  # the daemon's or a tenant's token, refused if wrong
    LENIENT = "lenient"  # the same, but a wrong one is let in as UNIDENTIFIED (the
    # endpoint refuses it in its own dialect: SandboxFusion's path token)
    SANDBOX = "sandbox"  # a per-sandbox token minted by :meth:`Door.mint`


@dataclass(frozen=True)
class Credential:
    """One credential a front-end found in a request."""

    secret: str | None
    kind: Kind = Kind.BEARER
    sandbox_id: str | None = None  # Kind.SANDBOX: the sandbox it must open
    label: bytes = ENVD  # Kind.SANDBOX: which of the sandbox's tokens
    wrong: str = ""  # what a wrong one is told, in the front-end's words


Extract = Callable[[AsgiScope], Sequence[Credential] | None]
"""A front-end's credential finder: None if the request is not that front-end's, else
the credentials it carries (any one that is right lets it in)."""


def _same(given: str, expected: str) -> bool:
    digest = lambda s: hashlib.sha256(s.encode("utf-8", "surrogatepass")).digest()  # noqa: E731
    return hmac.compare_digest(digest(given), digest(expected))


class Door:
    """Who a request is, and what it has open (see the module docstring)."""

    def __init__(
        self, tenants: Tenants, *, token: str | None, unix_socket: str,
        peer: PeerCredential, extractors: Sequence[Extract] = (),
    ) -> None:
        self.tenants = tenants
        self.token = token
        self.unix_socket = unix_socket
        self.peer = peer
        self.extractors = list(extractors)
        self.calls = OpenCalls()
        # per-sandbox tokens are keyed on the daemon's token, so they outlive a restart;
        # without one, on a key of this process's own
        self._mint_key = (token.encode() if token else secrets.token_bytes(32))

    # ------------------------------------------------------------------ HTTP

    def on_socket(self, scope: AsgiScope) -> bool:
        # uvicorn reports a Unix socket's listener as (its path, None)
        return scope.get("server") == (self.unix_socket, None)

    def authenticate(self, scope: AsgiScope) -> Caller | CorralError:
        """The caller of an HTTP request (also put in ``scope[CALLER_KEY]``), or the
        refusal to answer: from its headers and path alone, nothing read."""
        found = self._identify(scope)
        if isinstance(found, Caller):
            session = scope.get(SESSION_KEY)
            if isinstance(session, str):
                found = found.in_session(session)
            scope[CALLER_KEY] = found
        else:
            scope[CALLER_KEY] = UNIDENTIFIED
        return found

    def presented(self, scope: AsgiScope) -> str | None:
        """The secret :meth:`authenticate` will weigh for this request, found as it finds
        it (a front-end's credential, else the bearer token), without checking it: what
        the failed-auth throttle counts a guess by (auth_throttle.py), so no decoy header
        makes a guess count against another name. None: it carries none."""
        found = self._extracted(scope)
        if found is not None:
            return next((cred.secret for cred in found if cred.secret), None)
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.decode("latin-1").partition(" ")
                return (credentials.strip() or None) if scheme.lower() == "bearer" else None
        return None

    def _extracted(self, scope: AsgiScope) -> Sequence[Credential] | None:
        """The first front-end's credentials for this request (extractors may rewrite
        the scope, e.g. lift a token out of the path: each runs once per request)."""
        if _FOUND_KEY not in scope:
            found = None
            for extract in self.extractors:
                found = extract(scope)
                if found is not None:
                    break
            scope[_FOUND_KEY] = found
        return scope[_FOUND_KEY]  # type: ignore[no-any-return]

    def _identify(self, scope: AsgiScope) -> Caller | CorralError:
        presented = self._extracted(scope)
        if presented is not None:
            return self._check(scope, presented)
        if self.on_socket(scope):
            return ADMIN  # our own socket file: only its owner can connect
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return self.tenants.refusal()
                secret = credentials.strip()
                caller = self.bearer(secret)
                if caller is not None:
                    return caller
                if self.peer.matches(secret):
                    refused = self.peer.refusal(scope)
                    return PEER if refused is None else refused
                return self.tenants.refusal()
        if not self.token:
            return Unauthorized("this daemon accepts requests only on its Unix socket")
        return Unauthorized(
            "missing credentials: TCP clients must send 'Authorization: Bearer TOKEN' "
            "(the daemon's --token or CORRAL_TOKEN)"
        )

    def _check(self, scope: AsgiScope, presented: Sequence[Credential]) -> Caller | CorralError:
        wrong = ""
        for cred in presented:
            wrong = wrong or cred.wrong
            if cred.kind is Kind.SANDBOX:
                caller = self._sandbox_token(cred)
            else:
                caller = self.bearer(cred.secret or "")
                if caller is None and cred.kind is Kind.LENIENT:
                    return UNIDENTIFIED
            if caller is not None:
                return caller
        return Unauthorized(wrong) if wrong else self.tenants.refusal()

    # ------------------------------------------------------------ credentials

    def bearer(self, secret: str | None) -> Caller | None:
        """The admin or the tenant whose token ``secret`` is; None if it is neither."""
        return self.tenants.identify(secret)

    def by_token_id(self, token_id: str) -> Caller | None:
        """The caller a live token of this id is; None once it is revoked."""
        if token_id == ADMIN_NAME:
            return ADMIN
        tenant = self.tenants.quota_of(token_id) if token_id else None
        return None if tenant is None else Caller.of_tenant(tenant)

    def mint(self, caller: Caller, sandbox_id: str, label: bytes = ENVD) -> str:
        """A per-sandbox token: opens ``sandbox_id`` for ``caller``'s token, and no other."""
        if caller.scope not in (Scope.ADMIN, Scope.TENANT, Scope.SANDBOX):
            raise Forbidden("only the admin or a tenant may be given a sandbox's token")
        return f"{caller.token_id}.{self._mac(caller.token_id, sandbox_id, label)}"

    def _mac(self, token_id: str, sandbox_id: str, label: bytes) -> str:
        message = label + token_id.encode() + b"\0" + sandbox_id.encode()
        return hmac.new(self._mint_key, message, hashlib.sha256).hexdigest()

    def opens(self, sandbox_id: str, secret: str, label: bytes = TRAFFIC) -> Caller | None:
        """Who ``secret`` is, if it is a live per-sandbox token of ``sandbox_id`` (E2B's
        ``get_host`` addresses carry the traffic token): its minter's token, under which
        what it opens is held (:attr:`calls`), so that its revoke ends it; else None."""
        return self._sandbox_token(Credential(secret, Kind.SANDBOX, sandbox_id, label))

    def _sandbox_token(self, cred: Credential) -> Caller | None:
        if not cred.secret or not cred.sandbox_id:
            return None
        token_id, _, _ = cred.secret.rpartition(".")
        expected = f"{token_id}.{self._mac(token_id, cred.sandbox_id, cred.label)}"
        if not token_id or not _same(cred.secret, expected):
            return None
        minter = self.by_token_id(token_id)  # None: revoked since
        if minter is None:
            return None
        return Caller(minter.tenant, token_id, Scope.SANDBOX, cred.sandbox_id)

    # ------------------------------------------------------------- revocation

    def revoke(self, token_id: str) -> int:
        """``token_id`` was revoked: end every call it, or a token it minted, opened."""
        return self.calls.close_token(token_id)

    def end_session(self, session: str) -> int:
        """A dashboard session ended (logout, or its token refused): end its calls."""
        return self.calls.close_session(session)
