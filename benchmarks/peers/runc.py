"""runc (Debian ``runc``) with an overlayfs rootfs over the corral image.

Every container gets its own bundle: an overlay (the image's rootfs below, a private
upper dir) and ``runc spec``'s config with the namespaces bwrap uses (user, pid,
net, ipc, uts, mount, cgroup), uid 1000 inside, ids mapped to unprivileged host ids.
The overlay mount and unmount are inside every timed create. A running sandbox is
``runc run -d`` of ``sleep infinity``; exec is ``runc exec``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from corral.runtime import syscalls
from peers import Names, Peer, first_line, need_binary, oci_spec, run_cmd

HOST_ID_BASE = 1_100_000  # container ids 0..65535 map here (unused by corral's sandboxes)


class RuncPeer(Peer):
    name = "runc"
    title = "runc + overlayfs rootfs"

    def check(self) -> None:
        self.runc = need_binary("runc")

    def version(self) -> str:
        return first_line([self.runc, "--version"])

    def setup(self) -> None:
        self.base = self.ctx.workdir / "runc"
        self.state = self.base / "state"
        self.state.mkdir(parents=True)
        # runc's init mounts the rootfs from inside the user namespace, as a mapped
        # uid: every directory above a bundle must be traversable by it.
        for d in (self.ctx.workdir, self.base):
            os.chmod(d, 0o711)
        spec = oci_spec(self.runc, self.base)
        spec["root"] = {"path": "rootfs", "readonly": False}
        spec["linux"]["namespaces"] += [{"type": "user"}, {"type": "cgroup"}]
        ids = [{"containerID": 0, "hostID": HOST_ID_BASE, "size": 65536}]
        spec["linux"]["uidMappings"] = spec["linux"]["gidMappings"] = ids
        self.spec = spec
        self._name = Names("bench")

    def teardown(self) -> None:
        base = getattr(self, "base", None)
        if base is None:
            return
        try:
            out = run_cmd([self.runc, "--root", str(self.state), "list", "-q"])
            for cid in out.split():
                subprocess.run([self.runc, "--root", str(self.state), "delete", "-f", cid],
                               capture_output=True, timeout=30)
        except Exception:
            pass
        for point in syscalls.mounts_under(str(base)):
            syscalls.umount(point, lazy=True)
        shutil.rmtree(base, ignore_errors=True)

    # -- one container -----------------------------------------------------------

    def _bundle(self, args: list[str]) -> tuple[str, Path]:
        cid = self._name()
        bundle = self.base / cid
        for d in ("upper", "work", "rootfs"):
            (bundle / d).mkdir(parents=True)
        spec = dict(self.spec, process=dict(self.spec["process"], args=args))
        (bundle / "config.json").write_text(json.dumps(spec))
        syscalls.mount("overlay", str(bundle / "rootfs"), "overlay", 0,
                       f"lowerdir={self.ctx.rootfs},upperdir={bundle / 'upper'},"
                       f"workdir={bundle / 'work'}")
        return cid, bundle

    def _remove(self, bundle: Path) -> None:
        syscalls.umount(str(bundle / "rootfs"))
        shutil.rmtree(bundle, ignore_errors=True)

    def _runc(self, *args: str) -> list[str]:
        return [self.runc, "--root", str(self.state), *args]

    def cycle(self) -> None:
        cid, bundle = self._bundle(["/bin/true"])
        try:
            run_cmd(self._runc("run", "--bundle", str(bundle), cid))
        finally:
            self._remove(bundle)

    def start_idle(self) -> tuple[str, Path]:
        cid, bundle = self._bundle(["/bin/sleep", "infinity"])
        try:
            run_cmd(self._runc("run", "-d", "--bundle", str(bundle), cid), detach=True)
        except BaseException:
            self._remove(bundle)
            raise
        return cid, bundle

    def exec_true(self, handle: tuple[str, Path]) -> None:
        run_cmd(self._runc("exec", handle[0], "/bin/true"))

    def stop_idle(self, handles: list[Any]) -> None:
        for cid, bundle in handles:
            subprocess.run(self._runc("delete", "-f", cid), capture_output=True, timeout=30)
            self._remove(bundle)


PEER = RuncPeer
