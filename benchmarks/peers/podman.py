"""``podman run --rm`` (Debian ``podman``, rootful, runc) on the corral image imported.

Podman runs with a private store (``--root``, ``--runroot``, ``--tmpdir`` in the
scratch dir), so the host's own containers and images are never touched, and with
the settings this kind of host needs (see shared PEERS notes): a containers.conf that
raises ``default_ulimits`` to what the host allows (the host caps RLIMIT_NOFILE below
podman's default, and containers then fail in setrlimit), runc (Debian's crun
refuses a cgroup v1 hybrid layout), the cgroupfs manager, the file events backend.
Containers get ``--network none`` (a network namespace with loopback only: corral's
default). The image is ``tar -C ROOTFS -c . | podman import``: not timed.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Any

from corral.runtime import syscalls
from peers import Names, Peer, first_line, need_binary, run_cmd

IMAGE = "corral-bench-python"
NPROC = 32768


def containers_conf() -> str:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if nofile == resource.RLIM_INFINITY:
        nofile = 1 << 20
    return (
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={NPROC}:{NPROC}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
    )


class PodmanPeer(Peer):
    name = "podman"
    title = "podman run --rm (runc)"
    slow = True

    def check(self) -> None:
        self.podman = need_binary("podman")
        for tool in ("conmon", "runc"):
            need_binary(tool)

    def version(self) -> str:
        return first_line([self.podman, "--version"])

    def setup(self) -> None:
        self.base = self.ctx.workdir / "podman"
        self.base.mkdir()
        conf = self.base / "containers.conf"
        conf.write_text(containers_conf())
        self.env = dict(os.environ, CONTAINERS_CONF=str(conf))
        self.argv = [
            self.podman, "--root", str(self.base / "root"), "--runroot", str(self.base / "run"),
            "--tmpdir", str(self.base / "tmp"), "--storage-driver", "overlay",
            "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
        ]
        self._name = Names("corral-bench")
        tar = subprocess.Popen(["tar", "-C", str(self.ctx.rootfs), "-c", "."],
                               stdout=subprocess.PIPE)
        try:
            run_cmd(self.argv + ["import", "-q", "-", IMAGE], stdin=tar.stdout, env=self.env,
                    timeout=300)
        finally:
            tar.stdout.close()
            tar.wait()

    def teardown(self) -> None:
        base = getattr(self, "base", None)
        if base is None:
            return
        for cmd in (["rm", "-a", "-f", "-t", "0"], ["rmi", "-a", "-f"]):
            subprocess.run(self.argv + cmd, env=self.env, capture_output=True, timeout=120)
        for point in syscalls.mounts_under(str(base)):
            syscalls.umount(point, lazy=True)
        shutil.rmtree(base, ignore_errors=True)
        # podman's cgroupfs manager leaves its (empty) parent cgroups behind.
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            for d in (hierarchy / "libpod_parent" / "conmon", hierarchy / "libpod_parent"):
                try:
                    d.rmdir()
                except OSError:
                    pass  # absent, or in use

    def _podman(self, *args: str) -> list[str]:
        return self.argv + list(args)

    def cycle(self) -> None:
        run_cmd(self._podman("run", "--rm", "--network", "none", IMAGE, "/bin/true"),
                env=self.env)

    def start_idle(self) -> str:
        name = self._name()
        run_cmd(self._podman("run", "-d", "--network", "none", "--name", name, IMAGE,
                             "/bin/sleep", "infinity"), env=self.env)
        return name

    def exec_true(self, handle: str) -> None:
        run_cmd(self._podman("exec", handle, "/bin/true"), env=self.env)

    def stop_idle(self, handles: list[Any]) -> None:
        if handles:
            subprocess.run(self._podman("rm", "-f", "-t", "0", *handles), env=self.env,
                           capture_output=True, timeout=300)


PEER = PodmanPeer
