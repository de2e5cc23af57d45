"""Named networks (``corral.Network``): egress policies stored per tenant, used by name.

::

    <state>/networks/<owner>/<name>.json    a NetworkInfo (name, policy, created_at)

Written atomically (a temporary file renamed into place); a sandbox created with
``network="NAME"`` gets the policy as it is then (:meth:`Networks.resolve`): changing
or removing the network later changes no running sandbox (``update_network`` does).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from corral.errors import InvalidArgument, InvalidState, NetworkNotFound, QuotaExceeded
from corral.network_schema import NETWORK_NAME_RE, RESERVED_NAMES, NetworkInfo, NetworkPolicy

ADMIN_DIR = "_admin"
MAX_NETWORKS = 256  # per owner


def check_network_name(name: str) -> str:
    if not isinstance(name, str) or not NETWORK_NAME_RE.fullmatch(name) or name in RESERVED_NAMES:
        raise InvalidArgument(
            f"invalid network name {name!r}: use 1-63 lower-case letters, digits, '.', '_' "
            "or '-', starting with a letter or digit; 'none' and 'host' are modes, not names",
            details={"field": "name"})
    return name


class Networks:
    """The named networks of one state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _file(self, owner: str | None, name: str) -> Path:
        return self.root / (ADMIN_DIR if owner is None else owner) / f"{check_network_name(name)}.json"

    def create(self, owner: str | None, name: str, policy: NetworkPolicy, *,
               private: bool = False) -> NetworkInfo:
        path = self._file(owner, name)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.exists():
            raise InvalidState(f"network {name!r} exists: remove it first (corral network rm "
                               f"{name}) or pick another name", details={"network": name})
        if len(self.of(owner)) >= MAX_NETWORKS:
            raise QuotaExceeded(f"at most {MAX_NETWORKS} networks per tenant: remove some "
                                "(corral network rm NAME)", details={"network": name})
        info = NetworkInfo(name=name, policy=policy, created_at=time.time(), private=private)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(info.model_dump_json())
            os.link(tmp, path)  # atomic, and fails if a racing create won
        except FileExistsError:
            raise InvalidState(f"network {name!r} exists", details={"network": name}) from None
        finally:
            os.unlink(tmp)
        return info

    def get(self, owner: str | None, name: str) -> NetworkInfo:
        path = self._file(owner, name)
        try:
            return NetworkInfo.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise NetworkNotFound(f"no network {name!r}: create it with corral network create "
                                  f"{name} --allow RULE (corral.Network.create)",
                                  details={"network": name}) from None

    def of(self, owner: str | None) -> list[NetworkInfo]:
        base = self.root / (ADMIN_DIR if owner is None else owner)
        if not base.is_dir():
            return []
        return [NetworkInfo.model_validate_json(p.read_text())
                for p in sorted(base.glob("*.json")) if not p.name.startswith(".")]

    def remove(self, owner: str | None, name: str) -> None:
        self.get(owner, name)
        self._file(owner, name).unlink(missing_ok=True)
