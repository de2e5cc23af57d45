"""The wire contract of the native HTTP API, shared by the daemon and the SDK.

- :mod:`corral.api.operation`: what an endpoint is (:class:`Operation`: method, path,
  models, error codes, :class:`Access`, cluster :class:`Routing`);
- :mod:`corral.api.operations`: every endpoint (:data:`OPERATIONS`), and :func:`url`
  / :func:`match` to go from a name to a path and back;
- :mod:`corral.api.models`: the request and reply bodies of the sandbox endpoints
  (the sandbox itself is in :mod:`corral.schema`).

Only pydantic and the standard library below: the SDK imports it on Python 3.10.
"""

from corral.api.operation import Access, Operation, Query, Routing
from corral.api.operations import COMMON_ERRORS, OPERATIONS, match, operation, url

__all__ = [
    "COMMON_ERRORS",
    "OPERATIONS",
    "Access",
    "Operation",
    "Query",
    "Routing",
    "match",
    "operation",
    "url",
]
