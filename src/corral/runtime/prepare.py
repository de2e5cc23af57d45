"""Prepare a host for corral: the default image, the agent, and the built-in images.

Run as root once after installing (``scripts/install.sh`` does it)::

    python -m corral.runtime.prepare

Everything is cached under ``CORRAL_CACHE_DIR`` (see :mod:`corral.runtime.paths`), so
running it again is fast. The built-in images are the specs in
``corral/runtime/builtin/*.yaml`` (``rl``: python + gymnasium + numpy; ``fusion``:
g++, nodejs and pytest, installed by ``apt-get`` in a ``user: root`` step, see
:mod:`corral.runtime.rootbuild`; ``judge``: on ``fusion`` (built before it, in name
order), gcc, OpenJDK, Go and Rust for the stdin/stdout code judge; ``code-interpreter``: numpy, pandas and matplotlib for
E2B's Code Interpreter); an image of that name that is not their build (a hand-made
one, or an older ``fusion`` made by debootstrap) is replaced, in one atomic swap.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.errors import CorralError
from corral.image_schema import BuildEvent
from corral.runtime.images import BUILTIN_DIR, ImageStore
from corral.runtime.paths import Layout

# The built-in image with the toolchains of SandboxFusion's cpp, nodejs and pytest
# languages (builtin/fusion.yaml).
FUSION_IMAGE = "fusion"
# The built-in image E2B's Code Interpreter template runs on (builtin/code-interpreter.yaml).
INTERPRETER_IMAGE = "code-interpreter"


def builtin_specs() -> list[Path]:
    """The spec files of the built-in images, by name."""
    return sorted(BUILTIN_DIR.glob("*.yaml"))


def main() -> None:
    layout = Layout.create()
    store = ImageStore(layout.images_dir)
    image = store.ensure_default()
    print(f"image {image.name!r}: {image.rootfs} ({image.size_bytes / 1e6:.0f} MB)")

    # The agent binary that runs inside every sandbox (corral.runtime.agentbuild).
    from corral.runtime.agentbuild import ensure_agent

    ensure_agent(layout)
    try:
        asyncio.run(build_builtin_images(layout))
    except CorralError as exc:  # a failed step says which, with its output
        raise SystemExit(f"prepare: {exc.message}") from None


async def build_builtin_images(layout: Layout, log: Callable[[str], Any] = print) -> None:
    """Build (or find cached) every built-in image, on a throwaway engine: its state
    directory is private, so a daemon running on the default one is no obstacle."""
    from corral.runtime.engine import Engine
    from corral.runtime.image_build import build_image

    def show(event: BuildEvent) -> None:
        if event.type == "step":
            cached = " (cached)" if event.cached else ""
            log(f"  step {event.step}/{event.total}: {event.instruction}{cached}")
        elif event.type == "log":
            log(f"    {event.line}")

    state = Path(tempfile.mkdtemp(prefix="corral-prepare-"))
    os.chmod(state, 0o711)
    engine = await Engine.open(state, layout.cache_dir, warm_slots=0)
    try:
        for spec in builtin_specs():
            log(f"image from {spec.name}:")
            result = await build_image(engine, spec, on_event=show)
            stats = result.stats
            log(f"image {result.image.name!r}: ready in {stats.seconds:.1f} s ({stats.built} "
                f"step(s) run, {stats.cached} cached; {result.image.size_bytes / 1e6:.0f} MB "
                "with its base)")
    finally:
        await engine.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
