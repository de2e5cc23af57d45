"""The SandboxFusion front-end's pure parts: the path token, settings, models, statuses."""

from __future__ import annotations

import asyncio
import base64
import contextvars

import pytest
from pydantic import ValidationError

from corral.errors import InvalidArgument
from corral.schema import ExecResult
from corral.server.compat.sandboxfusion import TOKEN_KEY, lift_token
from corral.server.compat.sandboxfusion_model import (
    DEFAULT_IMAGES,
    FusionSettings,
    RunCodeRequest,
    command_result,
    decode_files,
    run_status,
    validation_detail,
)
from corral.server.compat.sandboxfusion_pools import FusionPools


@pytest.mark.parametrize("path,lifted,token,shown", [
    ("/sandboxfusion/s3cret/run_code", True, "s3cret", "/sandboxfusion/TOKEN/run_code"),
    ("/sandboxfusion/s3cret/run_jupyter", True, "s3cret", "/sandboxfusion/TOKEN/run_jupyter"),
    ("/sandboxfusion/s3cret/get_prompts", False, None, "/sandboxfusion/TOKEN/get_prompts"),
    ("/sandboxfusion/s3cret/run_code/x", False, None, "/sandboxfusion/TOKEN/run_code/x"),
    ("/sandboxfusion/s3cret", False, None, "/sandboxfusion/TOKEN"),
    ("/sandboxfusion//run_code", False, None, "/sandboxfusion/TOKEN/run_code"),
    ("/v1/sandboxes", False, None, "/v1/sandboxes"),
])
def test_lift_token_takes_it_out_of_every_prefixed_path(path, lifted, token, shown):
    scope = {"path": path, "raw_path": path.encode()}
    assert lift_token(scope) is lifted
    assert scope.get(TOKEN_KEY) == token
    assert scope["path"] == shown and scope["raw_path"] == shown.encode()


def test_settings_from_env():
    assert FusionSettings.from_env({}).images == DEFAULT_IMAGES
    got = FusionSettings.from_env({"CORRAL_FUSION_IMAGES": " go=my-go , cpp=c ",
                                   "CORRAL_FUSION_WARM": "0"})
    assert got.images["go"] == "my-go" and got.images["cpp"] == "c" and got.warm == 0
    for bad in ({"CORRAL_FUSION_IMAGES": "go"}, {"CORRAL_FUSION_IMAGES": "cobol=x"},
                {"CORRAL_FUSION_WARM": "-1"}, {"CORRAL_FUSION_WARM": "1000"}):
        with pytest.raises(InvalidArgument):
            FusionSettings.from_env(bad)
    assert "CORRAL_FUSION_IMAGES=go=IMAGE" in got.missing("rust").replace("rust", "go")
    assert "does not run" in got.missing("verilog")
    assert "corral.runtime.prepare" in got.not_built("cpp", "fusion")
    assert "corral image build" in got.not_built("go", "my-go")
    assert FusionSettings.from_env({}).pool_idle == 300.0
    assert FusionSettings.from_env({"CORRAL_FUSION_POOL_IDLE": "2.5"}).pool_idle == 2.5
    for idle in ("0", "-3", "nan", "1e9", "soon"):
        with pytest.raises(InvalidArgument, match="CORRAL_FUSION_POOL_IDLE"):
            FusionSettings.from_env({"CORRAL_FUSION_POOL_IDLE": idle})


class _Manager:
    """What FusionPools calls of the PoolManager: delete_owned, recorded, and the
    context its sweeps run in (the daemon's own)."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def detached(self) -> contextvars.Context:
        return contextvars.Context()

    async def delete_owned(self, owner: str | None, name: str) -> bool:
        await asyncio.sleep(0)  # a real delete awaits: another sweep may run meanwhile
        self.deleted.append(name)
        return True


async def test_pools_are_bounded_and_idle_ones_swept_once():
    manager = _Manager()
    pools = FusionPools(idle_s=0.1, max_pools=2)
    pools.add(("python", 64), "p64", manager)
    pools.add(("python", 65), "p65", manager)
    assert not pools.has_room() and pools.get(("python", 64)) == "p64"
    pools.used[("python", 65)] -= 10  # long unused
    # two sweeps at once (a request's and the sweeper's) delete it once, no KeyError
    await asyncio.gather(pools.sweep(manager), pools.sweep(manager))
    assert manager.deleted == ["p65"] and pools.has_room()
    assert pools.get(("python", 65)) is None and pools.get(("python", 64)) == "p64"
    pools.used[("python", 64)] -= 10
    for _ in range(1200):  # the sweeper task takes the last one by itself
        if len(manager.deleted) == 2:
            break
        await asyncio.sleep(0.05)
    assert manager.deleted == ["p65", "p64"] and pools.names == {}


def test_requests_take_verl_fields_and_refuse_bad_ones():
    req = RunCodeRequest.model_validate({"code": "x", "language": "cpp", "memory_limit_MB": 512,
                                         "run_timeout": 3, "unknown": 1, "stdin": None})
    assert (req.memory_limit_MB, req.run_timeout, req.compile_timeout) == (512, 3.0, 10.0)
    with pytest.raises(ValidationError) as info:
        RunCodeRequest.model_validate({"code": 1, "language": "brainfuck", "run_timeout": 0})
    locs = [d["loc"] for d in validation_detail(info.value)]
    assert ["body", "language"] in locs and ["body", "run_timeout"] in locs


def test_decode_files():
    got = decode_files({"a": base64.b64encode(b"\0\1").decode(), "b": None,
                        "IGNORE_THIS_FILE.txt": "!!"})
    assert got == {"a": b"\0\1"}
    for bad in ({"a": "not base64!"}, {"": "YQ=="}, {"a\0b": "YQ=="}):
        with pytest.raises(InvalidArgument):
            decode_files(bad)


def test_statuses_follow_sandboxfusion():
    ok = command_result(ExecResult(0, b"hi\n", b"", duration=0.5))
    assert ok == {"status": "Finished", "execution_time": 0.5, "return_code": 0,
                  "stdout": "hi\n", "stderr": ""}
    tle = command_result(ExecResult(-9, b"\xff", timed_out=True))
    assert tle["status"] == "TimeLimitExceeded" and tle["return_code"] is None
    assert tle["stdout"] == "\ufffd"
    failed = command_result(ExecResult(2))
    assert run_status(None, ok) == "Success"
    assert run_status(ok, failed) == "Failed" and run_status(tle, None) == "Failed"
    assert run_status({"status": "Error", "return_code": None}, ok) == "SandboxError"
