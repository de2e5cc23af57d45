"""A state directory after its engine died: what the registry thinks alive is lost.

Run once when an engine opens the state directory (:meth:`Engine.open`), before any
sandbox starts: nothing else touches these cgroups, mounts or slots meanwhile.
"""

from __future__ import annotations

import os
import signal

from corral.errors import CorralError
from corral.runtime import rootfs, syscalls
from corral.runtime.cgroups import CgroupDriver
from corral.runtime.paths import Layout
from corral.runtime.registry import Registry
from corral.schema import SandboxState


def reconcile(
    layout: Layout, registry: Registry, cgroups: CgroupDriver, cgroup_parent: str,
    keep: dict[str, str] | None = None,
) -> list[str]:
    """Every sandbox the registry thinks is alive is lost, but those in ``keep`` (id
    to cgroup path: adopted, :mod:`corral.runtime.restore`): kill what remains of it,
    unmount, remove its cgroups, and mark it failed with the reason. Then remove
    leftovers the registry never knew of (a crash in the middle of a create). Returns
    the ids marked failed.
    """
    keep = keep or {}
    kept_cgroups = {path.rsplit("/", 1)[-1] for path in keep.values()}
    lost = []
    for sid, state, pid, pid_start, cg_path in registry.live_rows():
        if sid in keep:
            continue
        if pid and pid_start and syscalls.process_start_time(pid) == pid_start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if cg_path:
            remove_cgroup(cgroups, cg_path)  # kills what is left, frozen or not
        rootfs.unmount_root(layout.sandbox_dir(sid))
        registry.set_state(
            sid,
            SandboxState.FAILED,
            f"lost: the engine that ran it stopped unexpectedly while it was {state} and its "
            "agent could not be taken over (see docs/restart.md); its processes, mounts "
            "and cgroups were cleaned up when the engine restarted",
        )
        lost.append(sid)
    for name in cgroups.children(cgroup_parent):
        if name not in kept_cgroups:
            remove_cgroup(cgroups, f"{cgroup_parent}/{name}")
    for d in layout.sandboxes_dir.iterdir():
        if d.name not in keep:  # (an adopted one's mounts are in its own namespace)
            rootfs.unmount_root(d)
    for f in layout.slots_dir.iterdir():
        f.unlink(missing_ok=True)
    return lost


def engine_cgroup_parent(cgroups: CgroupDriver, engine_key: str) -> str:
    """The group an engine's sandboxes' groups go under: ``corral-<key>``, one of its own
    at the top of each hierarchy, so that each engine weighs as one task group against
    the host's others (a session's autogroup, a systemd slice) rather than every engine
    of the host sharing one (docs/performance.md: "CPU share"). ``corral/<key>`` where
    that exists still: an older engine's, whose sandboxes and leftovers are adopted or
    cleaned up there; it goes when this engine closes."""
    legacy = f"corral/{engine_key}"
    try:
        cgroups.open(legacy)
    except CorralError:
        return f"corral-{engine_key}"
    return legacy


def remove_cgroup(cgroups: CgroupDriver, path: str) -> None:
    """Remove a cgroup, killing what is left in it; one already gone is no error."""
    try:
        cgroups.open(path).remove()
    except (OSError, CorralError):
        pass
