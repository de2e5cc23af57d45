"""Prepare a host for corral: build (or reuse) the default image and the agent.

Run as root once after installing (``scripts/install.sh`` does it)::

    python -m corral.runtime.prepare

Both steps are cached under ``CORRAL_CACHE_DIR`` (see :mod:`corral.runtime.paths`), so
running it again is fast.
"""

from __future__ import annotations

from corral.runtime.images import ImageStore
from corral.runtime.paths import Layout


def main() -> None:
    layout = Layout.create()
    image = ImageStore(layout.images_dir).ensure_default()
    print(f"image {image.name!r}: {image.rootfs} ({image.size_bytes / 1e6:.0f} MB)")

    # The agent binary that runs inside every sandbox (corral.runtime.agentbuild).
    try:
        from corral.runtime.agentbuild import ensure_agent
    except ImportError:
        print("agent: corral.runtime.agentbuild is not available yet; skipped")
    else:
        ensure_agent(layout)


if __name__ == "__main__":
    main()
