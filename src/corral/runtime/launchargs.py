"""The command line that turns a warm launcher into a sandbox (``agent/launch.c``).

What a slot (:mod:`corral.runtime.launcher`) still needs once a sandbox is asked for:
its mounts (the writable tmpfs and its limits, the lower layers, the directories the
sandbox user owns, files put read-only under ``/.corral``) and bubblewrap's argv. The
uid is not here: a slot has its own from the start (:mod:`corral.runtime.uids`).

Nothing here names a host path inside the sandbox's mount table: the layers (the
agent's included: it is the topmost, :func:`~corral.runtime.agentbuild.agent_layer`)
are idmapped clones under relative names, and the read-only files are copies in the
sandbox's own tmpfs, not bind mounts of the host's.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import TYPE_CHECKING

from corral.runtime import rootbuild, rootfs, users
from corral.runtime.agentbuild import agent_layer
from corral.runtime.cpus import cpu_list
from corral.runtime.diskimage import IMAGE_NAME
from corral.runtime.uids import SANDBOX_HOME
from corral.schema import NetworkMode, Storage

if TYPE_CHECKING:
    from corral.runtime.launcher import Slot
    from corral.runtime.live import Live

RESOLV_CONF = "/etc/resolv.conf"
RESTORE_NOFILE = 1 << 16  # CRIU's descriptor limit while it restores, at most
# (launch_args; the daemon's own hard limit where lower: without CAP_SYS_RESOURCE,
# which some hosts drop, the launcher cannot go above it)


def launch_args(live: Live, slot: Slot, lowers: list[Path], *, bwrap: str,
                agent: Path) -> list[str]:
    """The options for ``slot`` to become the sandbox ``live``
    on ``lowers`` (top first), with the agent binary ``agent``: bubblewrap's, or the
    restore of a live checkpoint (``live.program``, run as root: docs/live.md)."""
    argv = mount_args(live, lowers, agent=agent)
    if slot.own_netns and not live.netns and not in_prepared_netns(live, slot):
        argv += ["--host-net", "1"]  # leave the slot's namespace (agent/netns.c)
    if live.program:
        # CRIU puts its own descriptors above every descriptor number of the tasks it
        # restores, under its own RLIMIT_NOFILE; a busy daemon's agents hold numbers
        # past a sandbox's open_files (the launcher keeps the daemon's), which failed
        # the restore ("Can't chose service_fd_base"). Each restored task gets its own
        # limits back from the checkpoint.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        top = RESTORE_NOFILE if hard == resource.RLIM_INFINITY else min(hard, RESTORE_NOFILE)
        argv[argv.index("--nofile") + 1] = str(max(live.spec.open_files, top))
        kdat = ["--kdat", live.kdat] if live.kdat else []
        return [*argv, "--exec-root", "1", *kdat, "--", *live.program]
    return argv + bwrap_args(live, slot, bwrap=bwrap)


def in_prepared_netns(live: Live, slot: Slot) -> bool:
    """Whether the sandbox runs in the empty network namespace its slot's launcher made
    while it waited (``agent/netns.c``), that launcher's alone: a sandbox without a
    network, unless bwrap is to make its namespace as before (a checkpointable one,
    whose namespaces CRIU dumps; a restore, which CRIU makes)."""
    return (slot.own_netns and not live.netns and not live.program
            and not live.spec.checkpointable and live.spec.network != NetworkMode.HOST)


def mount_args(live: Live, lowers: list[Path], *, agent: Path) -> list[str]:
    """The launcher's own options: the sandbox's root, its limits, its mounts."""
    spec = live.spec
    lowers = [agent_layer(agent), *lowers]
    argv = [
        "--nofile", str(spec.open_files), "--rootdir", str(live.sandbox_dir),
        "--lower", ":".join(str(p) for p in lowers), "--disk-mb", str(spec.disk_mb),
        *rootfs.inode_args(spec.inodes),
    ]
    if spec.storage == Storage.DISK:  # corral.runtime.diskimage
        argv += ["--disk-image", str(live.sandbox_dir / IMAGE_NAME)]
    if live.cpus:  # its affinity, and the /sys that shows its CPUs (corral.runtime.cpus)
        argv += ["--cpus", cpu_list(live.cpus)]
    # the sandbox user's own directories, made in its writable layer (a build step as
    # root makes none: it would commit them as root's)
    if live.build_root:
        argv += ["--root-build", "1"]
    else:
        for d in sorted({SANDBOX_HOME, spec.workdir} - {"/"}):
            argv += ["--owned", d]
    for src, dest in live.ro_binds:
        argv += ["--copy", f"{src}:{dest}"]
    for mode, src, dest in live.volumes:  # mounted on the root before bwrap starts
        argv += ["--volume", f"{mode}:{src}:{dest}"]
    if live.netns:  # a policy's namespace (runtime/net), joined before bwrap starts
        argv += ["--netns", live.netns]
    for path in live.gpus.mount_points() if live.gpus else ():
        argv += ["--stub", path]
    return argv


def bwrap_args(live: Live, slot: Slot, *, bwrap: str) -> list[str]:
    """``-- bwrap ...``: the program the launcher becomes, and its options."""
    spec = live.spec
    argv = [
        "--", bwrap,
        # a build step as root: bwrap's own user namespace, root mapped to the slot's
        # uid; a sandbox: the launcher's, which maps its user and its root (docs/users.md)
        *(["--unshare-user", "--disable-userns", *rootbuild.bwrap_identity()]
          if live.build_root else users.bwrap_identity()),
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
        "--hostname", "sandbox",
        "--bind", str(live.sandbox_dir / "root"), "/",
        "--proc", "/proc", "--dev", "/dev",
        # its own devpts (capped; launch.c), over the one --dev made
        "--dev-bind", str(live.sandbox_dir / "rw" / "pts"), "/dev/pts",
        # its GPUs' device nodes and the driver's files, if it holds any (runtime.gpus)
        *(live.gpus.bwrap_args() if live.gpus else []),
        # /dev/shm is a directory of the writable layer (its disk_mb and inodes bound
        # it), and the tmpfs --dev made (host-sized, the sandbox user's) is read-only
        # once every node is bound in: nothing the sandbox writes escapes its limits
        "--bind", str(live.sandbox_dir / "rw" / "shm"), "/dev/shm",
        "--remount-ro", "/dev",
        *(["--ro-bind", str(live.sandbox_dir / "rw" / "sys"), "/sys"] if live.cpus else []),
        # No --die-with-parent: a sandbox outlives its daemon (a restart, an upgrade)
        # while the warden keeps its reattach socket (runtime/restore.py)
        "--new-session", "--as-pid-1",
        "--seccomp", str(slot.seccomp_fd), "--chdir", "/",
    ]
    if live.netns:  # a policy's link (joined by the launcher)
        argv += ["--ro-bind", str(live.sandbox_dir / "resolv.conf"), RESOLV_CONF]
    elif in_prepared_netns(live, slot):  # "none": the slot's own, made while it waited
        pass
    elif spec.network != NetworkMode.HOST:  # "none", or anything else: no network
        argv.append("--unshare-net")
    elif Path(RESOLV_CONF).exists():
        argv += ["--ro-bind", RESOLV_CONF, RESOLV_CONF]
    argv += [f"/{rootfs.AGENT_DIR}/agent", "serve", str(slot.ctl_fd), str(slot.reattach_fd)]
    if spec.checkpointable:  # its channels made in its own namespaces (agent.c)
        argv.append("local")
    return argv
