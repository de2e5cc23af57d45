"""Ray's own sandboxes (``ray.experimental.sandbox``, ray 2.60), in-process runtime.

They need three things bookworm does not have, all checked before anything starts:
``mkfs.erofs`` from erofs-utils 1.7 or later (Ray builds every image into an EROFS
file with ``mkfs.erofs --tar``; bookworm ships 1.5, which has no ``--tar``), a runsc
that can boot an EROFS root filesystem (Ray passes it through the
``dev.gvisor.spec.rootfs.*`` annotations, which bookworm's runsc 20221219 predates),
and the ``ray`` package itself (not in the ``bench`` extra: it cannot run here and
is large). When all three are present, sandboxes are made with
``SandboxRuntime.create`` from a flat tar of the corral image, with an explicit
``PATH`` (a flat tar carries no image config). Ray writes to fixed paths under /tmp
and can leave ``ray-sandbox-*`` cgroups behind; those are removed afterwards.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

from peers import Peer, Skip, first_line

RUNSC_EROFS_MARKER = b"dev.gvisor.spec.rootfs"
PATH = "/usr/local/bin:/usr/bin:/bin"


def binary_contains(path: str, needle: bytes, chunk: int = 1 << 22) -> bool:
    tail = b""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if needle in tail + block:
                return True
            tail = block[-len(needle):]
    return False


def missing_prerequisites() -> list[str]:
    problems = []
    mkfs = shutil.which("mkfs.erofs") or shutil.which("mkfs.erofs", path="/usr/sbin:/sbin")
    if not mkfs:
        problems.append("mkfs.erofs is not installed (Ray needs erofs-utils >= 1.7; "
                        "Debian 12 has 1.5, Debian 13 has a new enough one)")
    else:
        helptext = subprocess.run([mkfs, "--help"], capture_output=True, text=True)
        if "--tar" not in helptext.stdout + helptext.stderr:
            problems.append(f"{mkfs} ({first_line([mkfs, '--version']) or 'old'}) has no "
                            "--tar: Ray needs erofs-utils >= 1.7, Debian 12 has 1.5")
    runsc = shutil.which("runsc")
    if not runsc:
        problems.append("runsc is not installed")
    elif not binary_contains(runsc, RUNSC_EROFS_MARKER):
        problems.append(f"{first_line([runsc, '--version']) or 'this runsc'} cannot boot an "
                        "EROFS root (no dev.gvisor.spec.rootfs annotations): Ray needs a newer "
                        "runsc (bookworm-backports or gVisor's own release)")
    if importlib.util.find_spec("ray") is None:
        problems.append("the ray package is not installed (pip install ray==2.60.0; left "
                        "out of the bench extra because it cannot run here)")
    return problems


class RaySandboxPeer(Peer):
    name = "ray_sandbox"
    title = "Ray sandboxes (in-process runtime)"
    slow = True

    def check(self) -> None:
        problems = missing_prerequisites()
        if problems:
            raise Skip("; ".join(problems))

    def version(self) -> str:
        import ray

        return f"ray {ray.__version__}"

    def setup(self) -> None:
        from ray.experimental.sandbox.runtime import SandboxRuntime

        self.tar = self.ctx.workdir / "ray-rootfs.tar"
        subprocess.run(["tar", "-C", str(self.ctx.rootfs), "-cf", str(self.tar), "."],
                       check=True)
        self.rt = SandboxRuntime()

    def teardown(self) -> None:
        for d in Path("/sys/fs/cgroup").glob("*/ray-sandbox-*"):
            try:
                d.rmdir()
            except OSError:
                pass

    def _create(self) -> str:
        return self.rt.create(image=str(self.tar), env={"PATH": PATH}, timeout_seconds=60)

    def cycle(self) -> None:
        sid = self._create()
        try:
            self.exec_true(sid)
        finally:
            self.rt.delete(sid)

    def start_idle(self) -> str:
        return self._create()

    def exec_true(self, handle: str) -> None:
        r = self.rt.exec(handle, ["true"], timeout=30)
        if r.exit_code != 0:
            raise RuntimeError(f"true failed in Ray sandbox {handle}: {r!r}")

    def stop_idle(self, handles: list[Any]) -> None:
        for sid in handles:
            self.rt.delete(sid)


PEER = RaySandboxPeer
