"""Declarative image builds: real build sandboxes, layers in the image store, the cache."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest

from corral.errors import ImageBuildError, ImageNotFound, InvalidArgument
from corral.image_schema import parse_build_yaml
from corral.runtime import image_build, image_cache
from corral.runtime.image_build import BUILD_TAG, build_image
from corral.schema import SandboxState
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.root, pytest.mark.timeout(600)]

PACKAGE = "six==1.16.0"  # a tiny pure-python wheel, fetched from the package index


@pytest.fixture
def name(engine):
    """A unique image name, removed (with what only it used) after the test."""
    made = f"t-build-{secrets.token_hex(4)}"
    yield made
    if engine.images.exists(made):
        engine.images.remove(made)


async def sh(engine, sid: str, cmd: str, **kw) -> str:
    r = await engine.exec(sid, cmd, **kw)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


def live(engine) -> list[str]:
    return [i.id for i in engine.list(state=[SandboxState.PENDING, SandboxState.RUNNING,
                                             SandboxState.PAUSED, SandboxState.STOPPING])]


def layers_dir(engine) -> Path:
    return engine.images.images_dir / image_cache.LAYERS


def referenced_layers(engine) -> set[str]:
    """Layers some image manifest or build cache entry holds."""
    images_dir = engine.images.images_dir
    held = {x["id"] for m in image_cache.manifests(images_dir).values()
            for x in m.get("layers", [])}
    return held | set(image_cache._cache_entries(images_dir).values())


def make_context(root: Path, token: str) -> Path:
    (root / "pkg/sub").mkdir(parents=True)
    (root / "pkg/data.txt").write_text(f"data {token}\n")
    (root / "pkg/sub/tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    os.chmod(root / "pkg/sub/tool.sh", 0o755)
    os.symlink("data.txt", root / "pkg/link")
    (root / "single.txt").write_text("one file\n")
    return root


def spec_for(token: str, last: str = "echo $MODE > marker.txt") -> dict:
    return {
        "base": "python",
        "steps": [
            {"run": f"pip install {PACKAGE} && echo {token} > /home/sandbox/token"},
            {"copy": "pkg -> /app/pkg"},
            {"copy": "single.txt -> /app/"},
            {"env": {"MODE": f"fast-{token}"}},
            {"workdir": "/app"},
            {"run": last},
        ],
    }


async def test_build_then_sandboxes_see_files_env_workdir_and_package(engine, name, tmp_path):
    token = secrets.token_hex(6)
    context = make_context(tmp_path, token)
    events = []
    result = await build_image(engine, spec_for(token), name=name, context=context,
                               on_event=events.append)
    assert (result.stats.steps, result.stats.built, result.stats.cached) == (6, 4, 0)
    steps = [e for e in events if e.type == "step"]
    assert [e.step for e in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[0].instruction == f"run: pip install {PACKAGE} && echo {token} > /home/sandbox/token"
    assert steps[0].cached is False and steps[3].cached is None  # env: no layer
    assert any("Successfully installed six" in (e.line or "") for e in events if e.type == "log")

    image = result.image
    assert image.kind == "built" and image.base == "python" and len(image.layers) == 4
    assert image.env == {"MODE": f"fast-{token}"} and image.workdir == "/app"
    assert engine.images.get(name) == image
    assert not live(engine)  # the build's sandboxes are gone

    sb = await engine.create(image=name)
    assert sb.spec.workdir == "/app" and sb.spec.env == {"MODE": f"fast-{token}"}
    assert await sh(engine, sb.id, "pwd") == "/app\n"
    assert await sh(engine, sb.id, "cat marker.txt") == f"fast-{token}\n"
    assert await sh(engine, sb.id, "cat /app/pkg/data.txt /app/single.txt") == (
        f"data {token}\none file\n")
    assert await sh(engine, sb.id, "/app/pkg/sub/tool.sh") == "tool ran\n"
    assert await sh(engine, sb.id, "readlink /app/pkg/link") == "data.txt\n"
    assert await sh(engine, sb.id, "cat /home/sandbox/token") == f"{token}\n"
    # pip's user install is importable, and the files are the sandbox user's own
    out = await sh(engine, sb.id, "python3 -c 'import six; print(six.__version__)'")
    assert out == "1.16.0\n"
    assert await sh(engine, sb.id, "echo more >> /app/single.txt && echo ok") == "ok\n"
    # no network in sandboxes made from the image (only build steps had it)
    r = await engine.exec(sb.id, ["python3", "-c", (
        # 192.0.2.1 (TEST-NET-1, RFC 5737): no host answers it; a sandbox has no route to it
        "import socket\ntry:\n socket.create_connection(('192.0.2.1', 443), timeout=5)\n"
        " print('connected')\nexcept OSError as e:\n print('no network', e)")])
    assert r.stdout.startswith(b"no network"), r.stdout
    # the spec's own values win over the image's
    own = await engine.create(image=name, workdir="/workspace", env={"MODE": "mine"})
    assert own.spec.workdir == "/workspace" and own.spec.env == {"MODE": "mine"}
    assert await sh(engine, own.id, "pwd; echo $MODE") == "/workspace\nmine\n"
    for s in (sb, own):
        await engine.delete(s.id)


async def test_rebuild_is_a_cache_hit_and_a_change_rebuilds_from_there(engine, name, tmp_path):
    token = secrets.token_hex(6)
    context = make_context(tmp_path, token)
    first = await build_image(engine, spec_for(token), name=name, context=context)
    assert first.stats.built == 4

    again = await build_image(engine, spec_for(token), name=name, context=context)
    assert (again.stats.built, again.stats.cached) == (0, 4)
    assert again.image.digest == first.image.digest
    assert again.image.created_at == first.image.created_at  # not even republished

    # step 6 changed: only it runs
    changed = await build_image(engine, spec_for(token, last="echo changed > marker.txt"),
                                name=name, context=context)
    assert (changed.stats.built, changed.stats.cached) == (1, 3)
    assert changed.image.layer_ids[1:] == first.image.layer_ids[1:]
    assert changed.image.layer_ids[0] != first.image.layer_ids[0]

    # a copied file's content changed: that copy step and everything after it run
    (context / "pkg/data.txt").write_text("new data\n")
    recopied = await build_image(engine, spec_for(token, last="echo changed > marker.txt"),
                                 name=name, context=context)
    assert (recopied.stats.built, recopied.stats.cached) == (3, 1)
    sb = await engine.create(image=name)
    assert await sh(engine, sb.id, "cat pkg/data.txt marker.txt") == "new data\nchanged\n"
    await engine.delete(sb.id)

    # the superseded layers went (nothing references them); the image's stay. The
    # collection after a build does nothing while another build holds the shared cache's
    # lock (another test's, beside this one): collect again until one ran, bounded.
    for _ in range(240):
        on_disk = {p.name for p in layers_dir(engine).iterdir()}
        if first.image.layer_ids[0] not in on_disk:
            break
        await asyncio.sleep(0.5)
        await asyncio.to_thread(image_cache.collect, engine.images.images_dir)
    assert set(recopied.image.layer_ids) <= on_disk
    assert first.image.layer_ids[0] not in on_disk


async def test_gc_never_frees_a_layer_an_image_references(engine, name):
    token = secrets.token_hex(6)
    result = await build_image(engine, {"steps": [{"run": f"echo {token} > /workspace/t"}]},
                               name=name)
    (layer,) = result.image.layer_ids
    assert await engine.gc_layers() == []  # the engine's snapshot layers: not these
    image_cache.collect(engine.images.images_dir)  # the image store's own collection
    assert (layers_dir(engine) / layer / "tree/workspace/t").is_file()
    sb = await engine.create(image=name)
    assert await sh(engine, sb.id, "cat /workspace/t") == f"{token}\n"
    # a snapshot of a sandbox of the image stacks its layer on the image's
    await sh(engine, sb.id, "echo snap > /workspace/s")
    snap = await engine.snapshot(sb.id)
    await engine.delete(sb.id)
    copy = await engine.create(snapshot=snap.id)
    assert copy.spec.image == name
    assert await sh(engine, copy.id, "cat /workspace/t /workspace/s") == f"{token}\nsnap\n"
    await engine.delete(copy.id)
    await engine.delete_snapshot(snap.id)
    engine.images.remove(name)
    # now nothing holds it: a collection frees it (the one remove ran skips while another
    # engine's build runs in the shared cache, as in a parallel test run: collect again)
    for _ in range(600):
        if not (layers_dir(engine) / layer).exists():
            break
        await asyncio.sleep(0.1)
        image_cache.collect(engine.images.images_dir)
    assert not (layers_dir(engine) / layer).exists()


async def test_a_built_image_can_be_the_base_of_another(engine, name):
    token = secrets.token_hex(6)
    parent = f"{name}-parent"
    try:
        await build_image(engine, {"steps": [{"env": {"A": "1"}},
                                             {"run": f"echo {token} > /workspace/p"}]},
                          name=parent)
        child = await build_image(engine, {"base": parent, "steps": [
            {"env": {"B": "2"}}, {"run": "cat /workspace/p > /workspace/c; echo $A$B >> c"}]},
            name=name)
        assert child.image.base == parent and child.image.root_image == "python"
        assert len(child.image.layers) == 2 and child.image.env == {"A": "1", "B": "2"}
        sb = await engine.create(image=name)
        assert await sh(engine, sb.id, "cat /workspace/c") == f"{token}\n12\n"
        await engine.delete(sb.id)
        engine.images.remove(parent)  # the child keeps the parent's layers
        sb = await engine.create(image=name)
        assert await sh(engine, sb.id, "cat /workspace/p") == f"{token}\n"
        await engine.delete(sb.id)
    finally:
        if engine.images.exists(parent):
            engine.images.remove(parent)


async def test_a_failing_step_is_named_with_its_output_and_leaves_nothing(engine, name):
    token = secrets.token_hex(6)
    spec = {"steps": [
        {"run": f"echo {token} > /workspace/first"},
        {"run": f"echo out-{token}; echo err-{token} >&2; touch /workspace/half; exit 3"},
    ]}
    with pytest.raises(ImageBuildError) as info:
        await build_image(engine, spec, name=name)
    err = info.value
    assert err.step == 2 and err.details["returncode"] == 3
    assert err.details["instruction"] == spec["steps"][1]["run"].join(["run: ", ""])
    assert f"out-{token}" in err.output and f"err-{token}" in err.output
    assert "step 2/2" in err.message and "exit status 3" in err.message
    assert err.code == "image_build_failed" and err.status == 422

    assert not engine.images.exists(name)
    assert not live(engine) and not engine.list(tags=[BUILD_TAG])
    on_disk = {p.name for p in layers_dir(engine).iterdir()}
    assert not [n for n in on_disk if n.startswith(".")]  # no half-made layer
    assert on_disk <= referenced_layers(engine)  # no orphan layer
    assert not [n for n in os.listdir(engine.images.images_dir) if n.startswith(".tmp-")
                and f"-{os.getpid()}-" in n]

    # fixed: the step before is cached, only the fixed one runs
    spec["steps"][1] = {"run": "echo fixed > /workspace/second"}
    fixed = await build_image(engine, spec, name=name)
    assert (fixed.stats.cached, fixed.stats.built) == (1, 1)


async def test_a_failing_step_with_a_long_log_is_named_with_its_last_lines(
    engine, name, monkeypatch
):
    """The error at the end of a step's long output (apt's "E: ...") reaches the
    ImageBuildError: the step's output keeps its tail, and the cut is marked."""
    monkeypatch.setattr(image_build, "MAX_STEP_OUTPUT", 10_000)
    spec = {"steps": [{"run": "seq 1 100000; echo 'E: Unable to locate package nope'; exit 100"}]}
    logged: list[str] = []
    with pytest.raises(ImageBuildError) as info:
        await build_image(engine, spec, name=name, on_event=lambda ev: logged.append(ev.line or ""))
    lines = info.value.output.splitlines()
    assert lines[-1] == "E: Unable to locate package nope" and lines[-2] == "100000"
    marks = [i for i, line in enumerate(logged) if "bytes of stdout left out" in line]
    head = "".join(f"{i}\n" for i in range(1, 2000))[:5000].split("\n")  # ends inside a line
    assert len(marks) == 1 and logged[marks[0] - 2 : marks[0]] == head[-2:] and head[-1]


async def test_a_step_out_of_time_and_a_copy_to_a_root_dir_fail_clearly(engine, name, tmp_path):
    slow = {"step_timeout": 1, "steps": [{"run": f"sleep 30 # {secrets.token_hex(4)}"}]}
    with pytest.raises(ImageBuildError, match="raise step_timeout"):
        await build_image(engine, slow, name=name)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ImageBuildError, match="writable by it") as info:
        await build_image(engine, {"steps": [{"copy": "f -> /usr/local/bin/"}]}, name=name,
                          context=tmp_path)
    assert info.value.step == 1
    assert not live(engine) and not engine.images.exists(name)


async def test_bad_builds_fail_before_any_work(engine, name, tmp_path):
    before = {p.name for p in layers_dir(engine).iterdir()}
    with pytest.raises(ImageNotFound):
        await build_image(engine, {"base": "no-such-image", "steps": [{"run": "true"}]},
                          name=name)
    with pytest.raises(InvalidArgument, match="does not exist"):
        await build_image(engine, {"steps": [{"copy": "missing -> /app/"}]}, name=name,
                          context=tmp_path)
    with pytest.raises(InvalidArgument, match="build context"):  # the daemon's rule
        await build_image(engine, {"steps": [{"copy": "/etc/hostname -> /app/"}]},
                          name=name, context=tmp_path, context_only=True)
    with pytest.raises(InvalidArgument, match="needs a name"):
        await build_image(engine, {"steps": [{"run": "true"}]})
    with pytest.raises(InvalidArgument, match="invalid image name"):
        await build_image(engine, {"steps": [{"run": "true"}]}, name="Bad Name")
    with pytest.raises(InvalidArgument, match="step 1 must be"):
        await build_image(engine, {"steps": [{"shell": "true"}]}, name=name)
    assert {p.name for p in layers_dir(engine).iterdir()} == before
    assert not live(engine)


def test_spec_files_parse_and_name_their_problems(tmp_path):
    spec = parse_build_yaml(
        "name: demo\nbase: python\nsteps:\n  - run: pip install six\n"
        "  - copy: a -> /app/a\n  - copy: {src: b, dest: /app/}\n  - env: {N: 1}\n"
        "  - workdir: /app/\n")
    assert [s.describe() for s in spec.steps] == [
        "run: pip install six", "copy: a -> /app/a", "copy: b -> /app/", "env: N=1",
        "workdir: /app"]
    assert spec.model_dump(mode="json")["steps"][1] == {"copy": {"src": "a", "dest": "/app/a"}}
    for bad, hint in [("steps: [{copy: a}]", "SRC -> DEST"), ("steps: []", "at least 1"),
                      ("steps: [{workdir: rel}]", "absolute"), ("- a\n- b", "mapping"),
                      ("steps: [{run: x, env: {}}]", "exactly one"), ("{a: [", "YAML")]:
        with pytest.raises(InvalidArgument, match=hint):
            parse_build_yaml(bad)


def test_the_builtin_rl_spec_is_a_build_of_python_with_gymnasium():
    from corral.runtime.prepare import builtin_specs

    (path,) = [p for p in builtin_specs() if p.stem == "rl"]
    spec = parse_build_yaml(path.read_text())
    assert spec.name == "rl" and spec.base == "python"
    assert json.dumps(spec.model_dump(mode="json")["steps"]) == json.dumps(
        [{"run": "pip install gymnasium==1.4.0 numpy==2.4.6"}])


async def test_the_rl_image_is_built_and_imports_gymnasium(engine):
    image = engine.images.get("rl")
    assert image.kind == "built" and image.base == "python"
    sb = await engine.create(image="rl")
    out = await sh(engine, sb.id, "python3 -c 'import gymnasium, numpy; "
                   "print(gymnasium.__version__, numpy.__version__)'")
    assert out == "1.4.0 2.4.6\n"
    await engine.delete(sb.id)
