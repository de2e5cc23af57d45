"""The asyncio API end to end (the same code as the blocking one, before unasync)."""

from __future__ import annotations

import asyncio

import pytest

import corral


async def test_async_create_exec_stream_files(aclient, tmp_path):
    async with await corral.AsyncSandbox.create(image="python", memory_mb=256, tags=["async"], client=aclient) as sb:
        r = await sb.exec(["python3", "-c", "print(6*7)"], timeout=10)
        assert (r.returncode, r.stdout) == (0, "42\n")

        chunks = []
        async with sb.exec_stream("echo one; sleep 0.1; echo two >&2; sleep 0.1; echo three", timeout=10) as run:
            async for chunk in run:
                chunks.append((chunk.stream, chunk.text))
        assert chunks == [("stdout", "one\n"), ("stderr", "two\n"), ("stdout", "three\n")]
        assert run.result.returncode == 0 and run.result.stdout == "one\nthree\n"

        await sb.files.write("/app/x.txt", b"data")
        assert await sb.files.read("/app/x.txt") == b"data"
        assert [e.name for e in await sb.files.list("/app")] == ["x.txt"]
        assert await sb.files.exists("/app/x.txt")
        local = tmp_path / "up.txt"
        local.write_text("uploaded")
        await sb.files.upload(local, "/app/up.txt")
        assert (await sb.files.download("/app/up.txt", tmp_path / "down.txt")).read_text() == "uploaded"

        assert (await sb.pause()).state is corral.SandboxState.PAUSED
        assert (await sb.resume()).state is corral.SandboxState.RUNNING
        ids = [s.id for s in await corral.AsyncSandbox.list(tags=["async"], state="running", client=aclient)]
        assert sb.id in ids
    with pytest.raises(corral.SandboxNotFound):
        await corral.AsyncSandbox.connect(sb.id, client=aclient)


async def test_async_fan_out_with_gather(aclient):
    sandboxes = await asyncio.gather(*(corral.AsyncSandbox.create(client=aclient) for _ in range(4)))
    try:
        results = await asyncio.gather(
            *(sb.exec(["python3", "-c", f"print({i} * {i})"]) for i, sb in enumerate(sandboxes))
        )
        assert [r.stdout for r in results] == ["0\n", "1\n", "4\n", "9\n"]
    finally:
        await asyncio.gather(*(sb.delete() for sb in sandboxes))


async def test_async_errors_and_cleanup_after_an_exception(aclient):
    with pytest.raises(corral.SandboxNotFound):
        await corral.AsyncSandbox.connect("sb-nope", client=aclient)
    with pytest.raises(corral.InvalidArgument):
        await corral.AsyncSandbox.create(cpus=0, client=aclient)
    with pytest.raises(ZeroDivisionError):
        async with await corral.AsyncSandbox.create(client=aclient) as sb:
            r = await sb.exec("sleep 5", timeout=0.3)
            assert r.timed_out
            with pytest.raises(corral.ExecTimeout):
                await sb.exec("sleep 5", timeout=0.3, check=True)
            with pytest.raises(corral.FileNotFound):
                await sb.files.read("/missing")
            raise ZeroDivisionError
    assert sb.id not in [s.id for s in await corral.AsyncSandbox.list(client=aclient)]


async def test_async_session_cleans_up_after_an_exception(aclient):
    with pytest.raises(KeyError):
        async with corral.AsyncSession(defaults={"memory_mb": 128}, tags=["job=async"], client=aclient) as s:
            a = await s.create()
            b = await s.create(tags=["extra"])
            assert a.info.spec.memory_mb == 128
            assert set(b.tags) == {"job=async", s.tag, "extra"}
            assert {x.id for x in await s.list()} == {a.id, b.id}
            raise KeyError("boom")
    assert s.closed and s.sandboxes == []
    assert await corral.AsyncSandbox.list(tags=[s.tag], client=aclient) == []
