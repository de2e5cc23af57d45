"""``secrets=``: commands see them; the registry, the API, listings, snapshots and the
daemon's log never hold them in clear (issue 12)."""

from __future__ import annotations

import secrets as random

import httpx
import pytest

import corral
from tests.conftest import requires_root, stored_bytes

pytestmark = requires_root


def _state_bytes(daemon) -> bytes:
    stored = stored_bytes(daemon.state_dir, "registry.db*")
    return b"".join(data for _path, data in stored) + daemon.log.read_bytes()


def test_secrets_reach_commands_and_nothing_else(daemon):
    value = "s3cret-" + random.token_hex(12)
    with corral.Client(daemon.url) as client:
        with corral.Sandbox.create(secrets={"API_KEY": value}, env={"PLAIN": "p"},
                                   tags=["secret-test"], client=client) as sb:
            assert sb.exec("echo $API_KEY $PLAIN").stdout == f"{value} p\n"
            assert sb.info.spec.secrets["API_KEY"].get_secret_value() == "**********"
            listed = corral.Sandbox.list(tags=["secret-test"], client=client)[0]
            assert listed.info.spec.secrets["API_KEY"].get_secret_value() == "**********"
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket))) as http:
                raw = http.get("http://corral/v1/sandboxes/" + sb.id).text
            assert value not in raw and "**********" in raw
            # A fork keeps them (from memory); a sandbox from a snapshot does not.
            (twin,) = sb.fork(1)
            with twin:
                assert twin.exec("echo $API_KEY").stdout == f"{value}\n"
            snap = sb.snapshot()
            with corral.Sandbox.create(snapshot=snap, client=client) as child:
                assert child.exec("echo x${API_KEY}x").stdout == "xx\n"
            snap.delete()
            assert value.encode() not in _state_bytes(daemon)  # never stored in clear
    assert value.encode() not in _state_bytes(daemon)


def test_secrets_are_validated(daemon):
    with corral.Client(daemon.url) as client:
        with pytest.raises(corral.InvalidArgument, match="secret"):
            corral.Sandbox.create(secrets={"BAD NAME": "x"}, client=client)
        with pytest.raises(corral.InvalidArgument, match="secrets"):
            corral.Sandbox.create(secrets={"K": 5}, client=client)
