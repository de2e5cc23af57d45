"""An unknown image is answered with names and what to do, never a path of the host
(issue 25, item 9): a tenant on TCP used to read the daemon's image cache directory
(and every image name on the host) in the message; ``pyhton`` got no "did you mean"."""

from __future__ import annotations

import httpx
import pytest

import corral
from tests.security.tenants_helpers import team_daemon


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        yield t


def _no_host_paths(message: str, team) -> None:
    for secret in ("/var/cache", "/var/lib", str(team.daemon.base), "corral/images", "/run/"):
        assert secret not in message, message


def test_a_tenant_gets_did_you_mean_and_no_host_path(team):
    token = team.tokens["alice"]
    with corral.Client(team.url, token=token) as client:
        with pytest.raises(corral.ImageNotFound) as caught:
            corral.Sandbox.create(image="pyhton", client=client)
    message = str(caught.value)
    assert "did you mean 'python'" in message, message
    assert caught.value.details["did_you_mean"][0] == "python"
    _no_host_paths(message, team)
    _no_host_paths(repr(caught.value.details), team)


def test_an_unknown_name_says_how_to_list_and_build(team):
    with httpx.Client(base_url=team.url, timeout=60,
                      headers={"Authorization": f"Bearer {team.tokens['bob']}"}) as c:
        reply = c.post("/v1/sandboxes", json={"image": "zzzz-nothing-like-it"})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "image_not_found"
    assert "corral image ls" in error["message"] and "corral image build" in error["message"]
    _no_host_paths(error["message"], team)
    _no_host_paths(repr(error["details"]), team)
