"""corral.Image / corral.AsyncImage against the shared test daemon."""

from __future__ import annotations

import inspect
import secrets

import pytest

import corral
from tests.conftest import requires_root

pytestmark = [requires_root, pytest.mark.timeout(300)]


def test_sync_and_async_images_have_the_same_methods():
    public = {n for n in dir(corral.AsyncImage) if not n.startswith("_")}
    assert public <= {n for n in dir(corral.Image) if not n.startswith("_")}
    assert {"build", "import_archive", "list", "get", "delete"} <= public
    assert inspect.iscoroutinefunction(corral.AsyncImage.build)
    assert not inspect.iscoroutinefunction(corral.Image.build)


async def test_async_build_with_a_context_then_list_get_delete(aclient, tmp_path):
    token = secrets.token_hex(6)
    name = f"t-sdk-{secrets.token_hex(4)}"
    (tmp_path / "data.txt").write_text(token)
    spec = {"steps": [{"copy": "data.txt -> /app/"}, {"env": {"K": token}},
                      {"run": "cp /app/data.txt /app/copy.txt"}]}
    events: list[corral.BuildEvent] = []
    img = await corral.AsyncImage.build(spec, name=name, context=tmp_path,
                                        on_event=events.append, client=aclient)
    try:
        assert img.name == name and img.kind == "built" and img.env == {"K": token}
        assert img.build_stats is not None and img.build_stats.built == 2
        assert [e.step for e in events if e.type == "step"] == [1, 2, 3]
        assert name in [i.name for i in await corral.AsyncImage.list(client=aclient)]
        got = await corral.AsyncImage.get(name, client=aclient)
        assert got.digest == img.digest and got.build_stats is None
        sb = await corral.AsyncSandbox.create(image=name, memory_mb=64, client=aclient)
        try:
            r = await sb.exec("cat /app/copy.txt; echo $K")
            assert r.stdout == f"{token}{token}\n"
            with pytest.raises(corral.ImageInUse):
                await img.delete()
        finally:
            await sb.delete()
        with pytest.raises(corral.ImageBuildError) as info:
            await corral.AsyncImage.build({"steps": [{"run": "exit 4"}]}, name=name,
                                          client=aclient)
        assert info.value.step == 1 and info.value.details["returncode"] == 4
    finally:
        await img.delete()
    with pytest.raises(corral.ImageNotFound):
        await corral.AsyncImage.get(name, client=aclient)
