"""Bounds of what the cwsandbox front-end accepts.

Protobuf fields are typed, so nothing is coerced from a string but the two things the
protocol itself sends as text: resource quantities (parsed strictly, see
``cwsandbox_wire.parse_cpu``) and ``page_token``, which ``int()`` read with a sign,
spaces, underscores or other scripts' digits (``"-1"`` paged from the end). Lists a
message may carry are bounded (arguments, environment, files): beyond, the client's
``SandboxValidationError`` (INVALID_ARGUMENT naming the field), before any sandbox is
made or command run.
"""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import requires_root
from tests.server.test_compat_cwsandbox import SMALL, TOKEN, _no_traceback, serving

cwsandbox = pytest.importorskip("cwsandbox")
import grpc  # noqa: E402
from cwsandbox import Sandbox  # noqa: E402
from cwsandbox._proto import sandbox_pb2, sandbox_pb2_grpc  # noqa: E402
from cwsandbox.exceptions import SandboxValidationError  # noqa: E402

pytestmark = [requires_root, pytest.mark.root]


@pytest.fixture(scope="module")
def cw():
    """The daemon's gRPC address; it must log no traceback while these tests run."""
    with serving() as (daemon, url):
        since = daemon.log.stat().st_size
        yield url.removeprefix("http://")
        _no_traceback(daemon, since)


def test_long_lists_are_refused_before_anything_runs(cw):
    tag = f"cwin-{uuid.uuid4().hex[:8]}"
    for kwargs in ({"args": ["a"] * 5000}, {"env": {f"K{i}": "v" for i in range(2000)}}):
        with pytest.raises(SandboxValidationError):
            if "args" in kwargs:
                Sandbox.run("echo", *kwargs["args"], tags=[tag], resources=SMALL)
            else:
                Sandbox.run(tags=[tag], resources=SMALL, environment_variables=kwargs["env"])
    assert Sandbox.list(tags=[tag]).result() == []
    sb = Sandbox.run(tags=[tag], resources=SMALL)
    try:
        with pytest.raises(SandboxValidationError):
            sb.exec(["echo", *["a"] * 5000]).result()
        with grpc.insecure_channel(cw) as channel:  # the client's exec takes no env
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Exec(sandbox_pb2.ExecRequest(
                    sandbox_id=sb.sandbox_id, command=["env"],
                    env={f"K{i}": "v" for i in range(2000)},
                ), metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert sb.exec(["echo", "ok"]).result().stdout == "ok\n"
    finally:
        Sandbox.delete(sb.sandbox_id, missing_ok=True).result()


@pytest.mark.parametrize("token", ["-1", " 1", "1_0", "\u0661", "+1", "9" * 40])
def test_a_page_token_is_the_digits_handed_out(cw, token):
    meta = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(cw) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ListSandboxes(sandbox_pb2.ListSandboxesRequest(page_token=token, page_size=1),
                               metadata=meta)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.ListSandboxes(sandbox_pb2.ListSandboxesRequest(page_token="0", page_size=1),
                           metadata=meta)
