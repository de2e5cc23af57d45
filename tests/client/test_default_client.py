"""The default client follows ``CORRAL_URL``/``CORRAL_TOKEN`` as they are now (issue 25,
item 10): before, the first value read in a process stayed, and a later change (a
notebook cell, a second test) was silently ignored."""

from __future__ import annotations

import pytest

import corral
from tests.conftest import requires_root


def test_the_default_client_is_keyed_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CORRAL_URL", f"unix://{tmp_path}/a.sock")
    monkeypatch.delenv("CORRAL_TOKEN", raising=False)
    a = corral.Client.default()
    assert a.url == f"unix://{tmp_path}/a.sock" and corral.Client.default() is a  # shared
    monkeypatch.setenv("CORRAL_URL", f"unix://{tmp_path}/b.sock")
    b = corral.Client.default()
    assert b.url == f"unix://{tmp_path}/b.sock" and b is not a
    monkeypatch.setenv("CORRAL_TOKEN", "t-1")
    assert corral.Client.default().connect_args["token"] == "t-1"
    monkeypatch.setenv("CORRAL_TOKEN", "t-2")
    assert corral.Client.default().connect_args["token"] == "t-2"
    monkeypatch.setenv("CORRAL_URL", f"unix://{tmp_path}/a.sock")
    monkeypatch.delenv("CORRAL_TOKEN")
    assert corral.Client.default() is a  # back to the first: the same client again


async def test_the_async_default_follows_it_too(monkeypatch, tmp_path):
    monkeypatch.setenv("CORRAL_URL", f"unix://{tmp_path}/a.sock")
    a = corral.AsyncClient.default()
    monkeypatch.setenv("CORRAL_URL", f"unix://{tmp_path}/b.sock")
    assert corral.AsyncClient.default().url == f"unix://{tmp_path}/b.sock"
    assert corral.AsyncClient.default() is not a


@requires_root
def test_a_call_given_no_client_goes_where_corral_url_says_now(daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("CORRAL_URL", f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(corral.DaemonUnavailable, match="nothing.sock"):
        corral.Sandbox.list()
    monkeypatch.setenv("CORRAL_URL", daemon.url)
    with corral.Sandbox.create(memory_mb=64, tags=["default-client"]) as sb:
        assert sb.exec("echo hi").stdout == "hi\n"
        assert sb.id in {s.id for s in corral.Sandbox.list(tags=["default-client"])}
