"""What an engine does before it opens its state directory: makes sure there is room
to start, and sweeps what image builds killed mid-way left in the image store.

A state directory or cache on a full filesystem is refused with
:class:`~corral.errors.StorageFull` naming the path and what is free there, before
anything is written: a daemon that cannot write its registry could neither record the
sandboxes of its dead predecessor as failed nor create new ones, so it does not start
"degraded" (every request would fail) but exits with a message that says what to free.

A build killed with its engine (``kill -9``, power loss) can leave a staged layer of up
to a build sandbox's disk limit under the image store; an import, half an image. The
next start removes them, unless a build of another engine on the host is running
right now (then the next image operation does; see :func:`ImageStore.sweep_debris`).
A CRIU killed mid-way can leave its ``/run/criu.kdat.tmp``: removed too
(:func:`criu.drop_kdat_tmp`, which each CRIU run is followed by anyway).
"""

from __future__ import annotations

import os
from pathlib import Path

from corral.runtime import criu, storage
from corral.runtime.images import ImageStore
from corral.runtime.paths import Layout, default_cache_dir, default_state_dir


def open_layout(state_dir: Path | str | None, cache_dir: Path | str | None) -> Layout:
    """The engine's directories, made if missing, once there is room to start in them."""
    state = Path(state_dir or default_state_dir()).absolute()
    cache = Path(cache_dir or default_cache_dir()).absolute()
    storage.check_room(state, state)
    storage.check_room(cache, state)
    try:
        made = Layout.create(state, cache)
    except OSError as exc:  # filled up between the check and now
        if (full := storage.full_error(exc, state)) is not None:
            raise full from exc
        raise
    ImageStore(made.images_dir).sweep_debris()
    if os.geteuid() == 0:
        criu.drop_kdat_tmp()
    return made
