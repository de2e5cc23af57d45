"""An explicit caller that fails closed, at the engine (issue 23, must-do 2).

The owner a call acts for is never ambient: every engine, snapshot, pool, volume,
network and image-build call that looks something up names it (``owner=``; None: the
admin, on purpose), and the service layer's verbs take the :class:`Caller`.

- In the daemon (``Owners.require_caller``) every such engine call that names no owner
  raises :class:`~corral.errors.InternalError` before it reads or changes anything; the
  list of calls is taken from the engine's own signatures, so a new one is covered.
- A service verb without a caller is refused by its signature.
- For tenant bob, each path of tenant alice's things is an unknown id: her sandbox
  (get, usage, exec, files, processes, pause, stop, set_timeout, snapshot, ports,
  network, delete), snapshot, pool, volume, named network, and the sandbox her image
  build runs its step in. (Over HTTP: test_tenants.py, test_network_tenants.py,
  test_volumes.py.)
"""

from __future__ import annotations

import inspect
import io
import secrets
import tarfile
from pathlib import Path

import pytest

from corral.errors import (
    InternalError,
    NetworkNotFound,
    NotFound,
    SandboxNotFound,
    SnapshotNotFound,
    VolumeNotFound,
)
from corral.network_schema import NetworkPolicy
from corral.runtime.dockerfile_build import build_dockerfile
from corral.runtime.engine import Engine
from corral.runtime.image_build import BUILD_TAG, ImageBuild, build_image
from corral.runtime.ownership import UNSET
from corral.runtime.pools import PoolManager
from corral.schema import SandboxSpec, SandboxState
from corral.server.service import SandboxService


def _owner_methods(cls: type) -> list[str]:
    """The public methods that look things up for an owner they may be told (those
    that take one they must always be given, like ``delete_owned``, are left out)."""
    found = []
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        param = inspect.signature(fn).parameters.get("owner")
        if not name.startswith("_") and param is not None and param.default is UNSET:
            found.append(name)
    return sorted(found)


async def _pieces():
    yield b"x"


def _args(sid: str, tmp: Path) -> dict[str, object]:
    """A valid value for each parameter name an owner-taking call has."""
    return {
        "sandbox_id": sid, "path": "/tmp/x", "cmd": ["true"], "data": b"x",
        "pieces": _pieces(), "process_id": "p-1", "seconds": 60.0, "n": 1, "port": 8080,
        "name": "x", "id_or_name": "snap-000000000000", "snapshot_id": "snap-000000000000",
        "snapshot": "snap-000000000000", "ref": "snap-000000000000",
        "spec": SandboxSpec(memory_mb=64), "archive": tmp / "none.tar",
        "policy": NetworkPolicy(allow=["example.com"]), "network": {"allow": ["example.com"]},
        "timeout": 1.0, "desc": {"name": "x"}, "open_layer": None, "fetcher": None,
        "node": "n", "size": 1, "source": tmp / "none", "mode": 0o644,
        "new": "y", "count": 1, "lease": "lease-1", "max_output": 1,
    }


async def _call(fn, args: dict[str, object]) -> None:
    params = inspect.signature(fn).parameters
    given = {n: args[n] for n, p in params.items()
             if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD}
    result = fn(**given)
    if inspect.isasyncgen(result):
        async for _ in result:
            pass
    elif inspect.isawaitable(result):
        await result


async def test_engine_calls_naming_no_owner_fail_closed(engine, tmp_path):
    info = await engine.create(SandboxSpec(memory_mb=64, tenant="alice"))
    pools = PoolManager(engine)
    engine.owners.require_caller()  # what the daemon does at its start
    try:
        methods = _owner_methods(Engine)
        assert {"get", "list", "counts", "usage", "exec", "exec_stream", "spawn", "pause",
                "resume", "stop", "delete", "read_file", "write_file", "snapshot", "fork",
                "list_snapshots", "get_snapshot", "resolve_spec", "list_volumes",
                "create_network", "connect_port", "update_network", "describe_volume",
                "pull_volume", "check_volume_upload", "write_volume_file",
                "snapshot_volume"} <= set(methods)
        args = _args(info.id, tmp_path)
        for name in methods:
            with pytest.raises(InternalError, match="no caller"):
                await _call(getattr(engine, name), args)
        for name in _owner_methods(PoolManager):
            with pytest.raises(InternalError, match="no caller"):
                await _call(getattr(pools, name), {**args, "min_ready": 0, "max_size": 1})
        with pytest.raises(InternalError, match="no caller"):
            ImageBuild(engine, {"base": "python", "steps": [{"run": "true"}]}, name="x")
        with pytest.raises(InternalError, match="no caller"):
            await build_dockerfile(engine, tmp_path, name="x", text="FROM python\n")
        # nothing was read or changed: the sandbox is as it was, for its owner
        assert engine.get(info.id, owner="alice").state == SandboxState.RUNNING
        assert (await engine.exec(info.id, ["true"], owner="alice")).returncode == 0
    finally:
        await pools.close()
        assert await engine.delete(info.id, owner=None) is True  # the daemon's own work


def test_service_verbs_take_the_caller():
    """Every verb of the service layer that touches a tenant's things takes the Caller,
    with no default: a call without one is refused before it runs."""
    verbs = ("create", "delete", "stop", "set_timeout", "fork", "plan", "with_image",
             "list_sandboxes", "list_snapshots", "list_pools", "update_network",
             "create_network")
    for name in verbs:
        param = inspect.signature(getattr(SandboxService, name)).parameters["caller"]
        assert param.default is inspect.Parameter.empty, name


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"alice's data"
        member = tarfile.TarInfo("secret")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return buf.getvalue()


async def test_a_tenant_reaches_none_of_another_tenants_things(engine, tmp_path):
    alice, bob = {"owner": "alice"}, {"owner": "bob"}
    # the image store is the host's; a step never built before (no cached layer: it runs)
    image = f"alices-image-{secrets.token_hex(4)}"
    info = await engine.create(SandboxSpec(memory_mb=64, tenant="alice"))
    snap = await engine.snapshot(info.id, name="alices-snap", **alice)
    (tmp_path / "v.tar").write_bytes(_tar())
    await engine.create_volume("alices-vol", tmp_path / "v.tar", **alice)
    engine.create_network("alices-net", NetworkPolicy(allow=["example.com"]), **alice)
    pools = PoolManager(engine)
    try:
        pools.create_pool("alices-pool", SandboxSpec(memory_mb=64), min_ready=0, max_size=1,
                          **alice)
        sid = info.id
        for call in (lambda: engine.get(sid, **bob), lambda: engine.usage(sid, **bob),
                     lambda: engine.list_processes(sid, **bob),
                     lambda: engine.network_events(sid, **bob)):
            with pytest.raises(SandboxNotFound):
                call()
        for coro in (lambda: engine.exec(sid, ["true"], **bob),
                     lambda: engine.write_file(sid, "/tmp/pwned", b"x", **bob),
                     lambda: engine.stat(sid, "/tmp", **bob),
                     lambda: engine.list_dir(sid, "/tmp", **bob),
                     lambda: engine.spawn(sid, ["sleep", "9"], **bob),
                     lambda: engine.kill_processes(sid, **bob),
                     lambda: engine.pause(sid, **bob), lambda: engine.resume(sid, **bob),
                     lambda: engine.set_timeout(sid, 1, **bob),
                     lambda: engine.snapshot(sid, **bob), lambda: engine.fork(sid, 1, **bob),
                     lambda: engine.connect_port(sid, 8080, **bob),
                     lambda: engine.update_network(sid, {"allow": []}, **bob),
                     lambda: engine.stop(sid, **bob)):
            with pytest.raises(SandboxNotFound):
                await coro()
        assert await engine.delete(sid, **bob) is False
        assert engine.list(**bob) == [] and engine.counts(**bob) == {}
        for ref in (snap.id, "alices-snap"):
            with pytest.raises(SnapshotNotFound):
                engine.get_snapshot(ref, **bob)
            with pytest.raises(SnapshotNotFound):
                engine.resolve_spec(SandboxSpec(snapshot=ref), **bob)
            assert await engine.delete_snapshot(ref, **bob) is False
        assert engine.list_snapshots(**bob) == []
        assert pools.list_pools(**bob) == [] and pools.details(**bob) == []
        with pytest.raises(NotFound):
            pools.get_pool("alices-pool", **bob)
        with pytest.raises(NotFound):
            await pools.acquire("alices-pool", 1.0, **bob)
        assert await pools.delete_pool("alices-pool", **bob) is False
        assert engine.list_volumes(**bob) == []
        with pytest.raises(VolumeNotFound):
            engine.get_volume("alices-vol", **bob)
        with pytest.raises(VolumeNotFound):
            await engine.remove_volume("alices-vol", **bob)
        assert engine.list_networks(**bob) == []
        with pytest.raises(NetworkNotFound):
            engine.get_network("alices-net", **bob)
        with pytest.raises(NetworkNotFound):
            engine.resolve_network(SandboxSpec(network="alices-net"), **bob)

        # alice's image build runs its step in a sandbox of hers: bob never sees it
        seen: list[tuple[int, int]] = []

        def on_event(event) -> None:
            if event.type == "log" and not seen:  # while the step's sandbox runs
                seen.append((len(engine.list(tags=[BUILD_TAG], **alice)),
                             len(engine.list(tags=[BUILD_TAG], **bob))))

        built = await build_image(engine, {"base": "python", "steps": [
            {"run": f"echo alice-was-here-{image}"}]}, name=image, on_event=on_event,
            **alice)
        assert seen == [(1, 0)]
        assert built.image.name == image

        # alice's own: all still there and hers
        assert engine.get(sid, **alice).state == SandboxState.RUNNING
        assert [s.id for s in engine.list_snapshots(**alice)] == [snap.id]
        assert [p.name for p in pools.list_pools(**alice)] == ["alices-pool"]
        assert [v.name for v in engine.list_volumes(**alice)] == ["alices-vol"]
        assert [n.name for n in engine.list_networks(**alice)] == ["alices-net"]
    finally:
        await pools.close()
        await engine.delete(info.id, owner=None)
        await engine.delete_snapshot(snap.id, owner=None)
        await engine.remove_volume("alices-vol", owner="alice")
        await engine.remove_network("alices-net", owner="alice")
        if engine.images.exists(image):
            engine.images.remove(image)
