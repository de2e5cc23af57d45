"""Image build requests are typed like every other request body: strict and bounded.

Before, a build spec coerced (``"512"`` became 512 MB, ``true`` a 1-second step
timeout, ``{"N": 1}`` the env value ``"1"``), bounded no string, and the ``build.json``
of a build tar was parsed without the depth and size bounds of a request body (deep
nesting: a 500). Now each is a 400 ``invalid_argument`` naming the field; a spec
*file* may still write env values as plain YAML numbers (they mean their text).
"""

from __future__ import annotations

import io
import json
import secrets
import tarfile

import pytest

from corral.errors import InvalidArgument
from corral.image_schema import (
    MAX_COMMAND,
    MAX_ENV,
    MAX_PATH,
    BuildRequest,
    BuildSpec,
    parse_build_yaml,
)
from corral.schema import validate_model
from tests.conftest import requires_root
from tests.server.conftest import assert_error

STEPS = [{"run": "true"}]

BAD_SPECS = [
    ({"steps": STEPS, "memory_mb": "512"}, "memory_mb"),
    ({"steps": STEPS, "memory_mb": 512.0}, "memory_mb"),
    ({"steps": STEPS, "memory_mb": True}, "memory_mb"),
    ({"steps": STEPS, "disk_mb": "1024"}, "disk_mb"),
    ({"steps": STEPS, "step_timeout": "60"}, "step_timeout"),
    ({"steps": STEPS, "step_timeout": True}, "step_timeout"),
    ({"steps": [{"env": {"N": 1}}]}, "steps.0.env.env.N"),
    ({"steps": [{"env": {"DEBUG": True}}]}, "steps.0.env.env.DEBUG"),
    ({"steps": [{"env": {f"K{i}": "v" for i in range(MAX_ENV + 1)}}]}, "steps.0.env.env"),
    ({"steps": [{"run": "x" * (MAX_COMMAND + 1)}]}, "steps.0.run.run"),
    ({"steps": [{"copy": {"src": "a" * (MAX_PATH + 1), "dest": "/a"}}]}, "steps.0.copy.copy.src"),
    ({"steps": [{"workdir": "/" + "a" * MAX_PATH}]}, "steps.0.workdir.workdir"),
]


def _fields(exc: InvalidArgument) -> list[str]:
    return [e["field"] for e in exc.details["errors"]]


@pytest.mark.parametrize(("spec", "field"), BAD_SPECS, ids=[f for _, f in BAD_SPECS])
def test_build_specs_are_strict_and_bounded(spec, field):
    with pytest.raises(InvalidArgument) as caught:
        BuildSpec.parse(spec)
    assert any(f.startswith(field) for f in _fields(caught.value)), caught.value.details


def test_a_spec_file_may_write_env_values_as_yaml_numbers():
    spec = parse_build_yaml("steps:\n  - env: {N: 1, DEBUG: true, RATE: 0.5, NAME: x}\n")
    assert spec.steps[0].env == {"N": "1", "DEBUG": "True", "RATE": "0.5", "NAME": "x"}
    with pytest.raises(InvalidArgument, match="memory_mb"):  # numbers are still numbers
        parse_build_yaml("memory_mb: '512'\nsteps:\n  - run: 'true'\n")


@pytest.mark.parametrize("key", ["x", "true", "1.0", " 1", "0", "-1", ""])
def test_build_request_sources_are_keyed_by_step_numbers(key):
    with pytest.raises(InvalidArgument, match="sources"):
        _validate_request({"spec": {"steps": STEPS}, "sources": {key: "s1"}})


def test_build_request_sources_in_digits_are_step_numbers():
    req = _validate_request({"spec": {"steps": STEPS}, "sources": {"1": "s1", "12": "s12"}})
    assert req.sources == {1: "s1", 12: "s12"}


def _validate_request(data: dict) -> BuildRequest:
    return validate_model(BuildRequest, data, "build request")


# ------------------------------------------------------------- over the API


def _context_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@requires_root
def test_a_mistyped_build_is_refused_before_it_starts(client):
    name = f"t-strict-{secrets.token_hex(4)}"
    try:
        for spec, field in BAD_SPECS[:6]:
            reply = client.post("/v1/images/build", json={"spec": spec, "name": name})
            error = assert_error(reply, 400, "invalid_argument")
            assert field in error["message"], error
        reply = client.post("/v1/images/build",
                            json={"spec": {"steps": STEPS}, "name": name, "sources": {"a": "x"}})
        assert_error(reply, 400, "invalid_argument")
        assert client.get(f"/v1/images/{name}").status_code == 404
    finally:
        client.delete(f"/v1/images/{name}")


@requires_root
def test_the_build_json_of_a_tar_is_bounded_like_a_body(client):
    """Before: ``json.load`` without bounds, a RecursionError and a 500."""
    deep = b"[" * 100_000 + b"]" * 100_000
    for member in (deep, b'{"spec": ' + deep + b"}", json.dumps([1] * 70_000).encode()):
        reply = client.post("/v1/images/build", content=_context_tar({"build.json": member}),
                            headers={"Content-Type": "application/x-tar"})
        assert_error(reply, 400, "invalid_argument")
