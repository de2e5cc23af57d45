"""Where the SDK finds the daemon, and the defaults it uses.

Environment variables (read only here, when a client is built; the default client,
used by calls given none, is looked up by their current values, so changing one takes
effect on the next such call):

- ``CORRAL_URL``: the daemon, as ``unix:///path/to/corral.sock`` or ``http://host:port``
  (``https://`` too), or ``ray://HOST:PORT`` (``ray://auto`` inside a Ray job) for the
  daemons of a Ray cluster that ``corral cluster up`` started (the cluster's token is
  read from the cluster, unless ``CORRAL_TOKEN`` is set: then the directory alone is read
  there and that token is sent, e.g. a tenant's), or ``cluster+http://HOST:PORT`` for
  the same cluster reached through one of its daemons (its ``GET /v1/cluster/nodes``),
  without being a Ray member (needs ``CORRAL_TOKEN``, and ``?key=KEY``: that daemon's
  public key, as ``corral cluster up`` and ``corral token create`` print it; a daemon
  that cannot prove it is never sent the token). Setting it turns the embedded
  daemon off: the SDK then only connects.
- ``CORRAL_TOKEN``: the bearer token sent with every request (needed over TCP).
- ``CORRAL_SOCKET``: the Unix socket used when ``CORRAL_URL`` is unset
  (default ``/run/corral/corral.sock``).
- ``CORRAL_NO_EMBED``: ``1`` stops the SDK from starting a daemon itself when nothing
  answers on ``CORRAL_SOCKET``.
- ``WANDB_RUN_ID`` / ``SLURM_JOB_ID``: each sandbox created is tagged
  ``wandb-run:ID`` / ``slurm-job:ID`` (CoreWeave's convention: ``corral ls --tag
  wandb-run:ID`` finds a training run's sandboxes, ``corral rm --tag`` cleans them up);
  ``CORRAL_AUTO_TAGS=0`` turns that off. Read at each create.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from corral.errors import InvalidArgument

DEFAULT_SOCKET = "/run/corral/corral.sock"
DEFAULT_TIMEOUT = 60.0
"""Seconds an ordinary request (not an ``exec``) may take before the SDK gives up."""
CREATE_TIMEOUT = 600.0
"""Seconds a create may take: the daemon may queue it (admission control) before starting."""
EXEC_TIMEOUT_MARGIN = 30.0
"""Seconds added to a command's own timeout for the HTTP request that runs it."""
CREATE_WAIT_MARGIN = 10.0
"""Seconds of a create's HTTP timeout left to the daemon to answer after it waited for
room or for its tenant's quota (the rest is sent as ``?wait=``)."""
CONNECT_TIMEOUT = 10.0
UDS_BASE_URL = "http://corral"  # the host part means nothing over a Unix socket
CLUSTER_BASE_URL = "http://corral-cluster"  # unused: a cluster's requests name their node

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""Keeps "not passed" apart from ``None`` (for timeouts, ``None`` means "no timeout")."""


_AUTO_TAGS = (("WANDB_RUN_ID", "wandb-run:"), ("SLURM_JOB_ID", "slurm-job:"))
_TAG_VALUE = re.compile(r"[A-Za-z0-9_.:=/@+-]{1,100}")


def auto_tags() -> list[str]:
    """The tags naming the training run or batch job this process belongs to, from
    ``WANDB_RUN_ID`` and ``SLURM_JOB_ID`` (none with ``CORRAL_AUTO_TAGS=0``; a value
    that could not be a tag is left out)."""
    if os.environ.get("CORRAL_AUTO_TAGS", "").strip().lower() in _FALSE:
        return []
    tags = []
    for var, prefix in _AUTO_TAGS:
        value = (os.environ.get(var) or "").strip()
        if _TAG_VALUE.fullmatch(value):
            tags.append(prefix + value)
    return tags


ENV_VARS = ("CORRAL_URL", "CORRAL_TOKEN", "CORRAL_SOCKET", "CORRAL_NO_EMBED")
"""What :meth:`Endpoint.resolve` reads from the environment."""


def env_now() -> tuple[str | None, ...]:
    """The values of :data:`ENV_VARS` now: the default client is keyed by them, so a
    change (a notebook cell, a test) takes effect on the next call given no client."""
    return tuple(os.environ.get(name) for name in ENV_VARS)


def exec_http_timeout(timeout: float | None) -> float | None:
    """The HTTP timeout of a request running a command: always past the command's own."""
    return None if timeout is None else timeout + EXEC_TIMEOUT_MARGIN


@dataclass(frozen=True)
class Endpoint:
    """A resolved daemon address.

    >>> Endpoint.resolve("unix:///tmp/c.sock").uds
    '/tmp/c.sock'
    >>> Endpoint.resolve("http://10.0.0.5:7070", token="s3cret").base_url
    'http://10.0.0.5:7070'
    """

    url: str
    base_url: str
    uds: str | None = None
    token: str | None = None
    embed: bool = False  # may start a daemon on ``uds`` when nothing answers there
    # ``ray://ADDR``: the Ray cluster's address (or "auto"); ``cluster+http://``: the
    # URL of the daemon whose directory the client starts from
    cluster: str | None = None

    @classmethod
    def resolve(cls, url: str | None = None, token: str | None = None) -> Endpoint:
        """An explicit ``url`` wins over ``CORRAL_URL``, which wins over ``CORRAL_SOCKET``."""
        token = token if token is not None else (os.environ.get("CORRAL_TOKEN") or None)
        url = url or os.environ.get("CORRAL_URL") or None
        if url is None:
            sock = os.environ.get("CORRAL_SOCKET") or DEFAULT_SOCKET
            embed = os.environ.get("CORRAL_NO_EMBED", "").strip().lower() not in _TRUE
            return cls(f"unix://{sock}", UDS_BASE_URL, sock, token, embed)
        parts = urlsplit(url)
        if parts.scheme == "unix":
            path = unquote(parts.netloc + parts.path)
            if not path.startswith("/"):
                raise InvalidArgument(
                    f"invalid daemon URL {url!r}: write a Unix socket as unix:///abs/path.sock"
                )
            return cls(url, UDS_BASE_URL, path, token)
        if parts.scheme in ("http", "https") and parts.netloc:
            return cls(url, url.rstrip("/"), None, token)
        if parts.scheme == "ray" and parts.netloc and parts.path in ("", "/"):
            return cls(url, CLUSTER_BASE_URL, None, token, cluster=parts.netloc)
        if parts.scheme == "cluster+https":
            raise InvalidArgument(
                f"{url}: a cluster's daemons serve plain HTTP, so after the first daemon "
                "a tenant token would cross the network in clear; reach the cluster from "
                "its private network with cluster+http://HOST:PORT (or ray://HOST:PORT)")
        if parts.scheme == "cluster+http" and parts.netloc:
            if not token:
                raise InvalidArgument(
                    f"{url} reaches a cluster through one of its daemons, which needs a "
                    "token: set CORRAL_TOKEN (a tenant token from `corral token create`)")
            key = parse_qs(parts.query).get("key", [""])[0]
            if not key:
                raise InvalidArgument(
                    f"{url} names no key: write cluster+http://{parts.netloc}?key=KEY with "
                    "the key `corral cluster up` or `corral token create` printed (the "
                    "daemon proves it holds it before the token is sent)")
            daemon = f"{parts.scheme.removeprefix('cluster+')}://{parts.netloc}?key={key}"
            return cls(url, CLUSTER_BASE_URL, None, token, cluster=daemon)
        raise InvalidArgument(
            f"invalid daemon URL {url!r}: use unix:///path/to/corral.sock, http://host:port, "
            "ray://HOST:PORT (a Ray cluster, see `corral cluster up`) or "
            "cluster+http://HOST:PORT (a cluster, through one of its daemons)"
        )

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}
