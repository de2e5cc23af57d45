"""Every public argument is checked before anything is sent: a wrong one raises
``InvalidArgument`` naming it, never a builtin error from deeper down and never a
silent reinterpretation. Timeouts mean one thing everywhere (seconds > 0, at most the
daemon's 30 days, or None for no limit)."""

from __future__ import annotations

import math

import pytest

import corral
from corral.schema import MAX_TIMEOUT_S
from tests.conftest import requires_root

pytestmark = requires_root


def _field(exc: pytest.ExceptionInfo[corral.InvalidArgument]) -> str:
    return exc.value.details["errors"][0]["field"]


@pytest.fixture(scope="module")
def sb(daemon):
    with corral.Client(daemon.url) as c, corral.Sandbox.create(memory_mb=64, client=c) as sb:
        yield sb


@pytest.mark.parametrize("timeout", [1e12, 0, -1, math.nan, math.inf, True, "10", MAX_TIMEOUT_S + 1])
def test_exec_timeouts_out_of_range_are_invalid_arguments(sb, timeout):
    for call in (
        lambda: sb.exec("true", timeout=timeout),
        lambda: list(sb.exec_stream("true", timeout=timeout)),
        lambda: sb.spawn("true", timeout=timeout),
    ):
        with pytest.raises(corral.InvalidArgument, match=r"^timeout: ") as exc:
            call()
        assert _field(exc) == "timeout"
        assert not isinstance(exc.value, (OverflowError, TypeError))


def test_timeout_none_is_no_limit_and_the_maximum_is_allowed(sb):
    assert sb.exec("true", timeout=None).ok
    assert sb.exec("true", timeout=MAX_TIMEOUT_S).ok
    assert sb.exec("true", timeout=5).ok  # an int is seconds too


@pytest.mark.parametrize("field,value", [("timeout", 1e12), ("timeout", 0), ("idle_timeout", 0),
                                         ("idle_timeout", math.inf), ("tags", "abc"),
                                         ("tags", [1]), ("env", ["A=1"]), ("snapshot", "")])
def test_create_refuses_bad_arguments_by_name(client, field, value):
    with pytest.raises(corral.InvalidArgument) as exc:
        corral.Sandbox.create(memory_mb=64, client=client, **{field: value})
    assert _field(exc) == field and exc.value.message.startswith(f"{field}: ")


def test_exec_refuses_commands_and_arguments_of_the_wrong_type(sb):
    for cmd in (None, [], "", b"ls", ["ls", None], 42):
        with pytest.raises(corral.InvalidArgument, match=r"^cmd: "):
            sb.exec(cmd)
    for kwargs in (dict(env=["A=1"]), dict(cwd=3), dict(stdin=7), dict(max_output=-1), dict(output_tail=-1),
                   dict(check="yes")):
        name = next(iter(kwargs))
        with pytest.raises(corral.InvalidArgument, match=rf"^{name}: "):
            sb.exec("true", **kwargs)


def test_connect_and_list_check_their_arguments(client):
    for bad in ("", None, 12):
        with pytest.raises(corral.InvalidArgument, match=r"^sandbox_id: "):
            corral.Sandbox.connect(bad, client=client)
    with pytest.raises(corral.InvalidArgument, match=r"^tags: "):
        corral.Sandbox.list(tags="job=1", client=client)
    with pytest.raises(corral.InvalidArgument, match=r"^state: "):
        corral.Sandbox.list(state="runing", client=client)


def test_files_refuse_what_they_would_misread(sb):
    with pytest.raises(corral.InvalidArgument, match=r"^data: "):
        sb.files.write("/tmp/n", 123)  # would have written 123 NUL bytes
    assert not sb.files.exists("/tmp/n")
    for call, name in ((lambda: sb.files.write("/tmp/n", b"x", mode="644"), "mode"),
                       (lambda: sb.files.write("/tmp/n", b"x", mode=0o17777), "mode"),
                       (lambda: sb.files.read(None), "path"),
                       (lambda: sb.files.mkdir("/tmp/d", parents="no"), "parents"),
                       (lambda: sb.files.remove("", recursive=True), "path")):
        with pytest.raises(corral.InvalidArgument, match=rf"^{name}: "):
            call()


def test_lifecycle_and_process_arguments(sb):
    with pytest.raises(corral.InvalidArgument, match=r"^grace: "):
        sb.stop(grace=-1)
    with pytest.raises(corral.InvalidArgument, match=r"^n: "):
        sb.fork(0)
    with sb.spawn(["cat"]) as proc:
        with pytest.raises(corral.InvalidArgument, match=r"^data: "):
            proc.write(5)
        with pytest.raises(corral.InvalidArgument, match=r"^timeout: "):
            proc.exchange("x\n", timeout=0)
        assert proc.exchange("x\n", timeout=30) == "x\n"
    assert sb.refresh().state is corral.SandboxState.RUNNING


async def test_async_create_works_with_and_without_await(aclient):
    async with corral.AsyncSandbox.create(memory_mb=64, client=aclient) as sb:
        assert isinstance(sb, corral.AsyncSandbox)
        assert (await sb.exec("echo hi")).stdout == "hi\n"
    with pytest.raises(corral.SandboxNotFound):
        await corral.AsyncSandbox.connect(sb.id, client=aclient)
    async with await corral.AsyncSandbox.create(memory_mb=64, client=aclient) as sb2:
        assert sb2.state is corral.SandboxState.RUNNING
    with pytest.raises(corral.SandboxNotFound):
        await corral.AsyncSandbox.connect(sb2.id, client=aclient)


async def test_async_create_checks_arguments_before_awaiting(aclient):
    with pytest.raises(corral.InvalidArgument, match=r"^tags: "):
        corral.AsyncSandbox.create(tags="abc", client=aclient)


def test_pool_takes_a_snapshot_object_like_create(client):
    with corral.Sandbox.create(memory_mb=64, client=client) as base:
        base.files.write("/workspace/marker", b"from the snapshot")
        snap = base.snapshot()
    try:
        with corral.Pool(snapshot=snap, min_ready=0, max_size=2, client=client) as pool:
            with pool.acquire(timeout=60) as sb:
                assert sb.files.read("/workspace/marker") == b"from the snapshot"
        with pytest.raises(corral.InvalidArgument, match=r"^tags: "):
            corral.Pool(tags="abc", client=client)
        with pytest.raises(corral.InvalidArgument, match="no_such_option"):
            corral.Pool(no_such_option=1, client=client)
    finally:
        snap.delete()


@pytest.mark.parametrize("make", [
    lambda: corral.Sandbox.create(memory=512),
    lambda: corral.Session(defaults={"memroy_mb": 64}),
    lambda: corral.Pool(image="python", mem_mb=64),
])
def test_a_misspelt_spec_field_is_named_before_anything_is_sent(make):
    # One definition of the spec's fields (SpecFields) for create, Session and Pool.
    with pytest.raises(corral.InvalidArgument) as exc:
        make()
    assert "Extra inputs are not permitted" in exc.value.message
