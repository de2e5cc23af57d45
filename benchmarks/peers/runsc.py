"""gVisor ``runsc`` (Debian ``runsc``), ptrace platform, held in the foreground.

Debian bookworm's runsc runs on the ptrace platform (the newer systrap platform
burns CPU per idle sandbox here). ``runsc run`` is kept in the foreground: a
detached create/delete is far slower on this kind of host. The corral image's
rootfs is the container root with gVisor's in-memory overlay on top (``--overlay``:
writes never reach the image), no network (loopback only). A running sandbox is a
foreground ``runsc run`` of a shell that prints ``ready`` and sleeps; exec is
``runsc exec``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from peers import Names, Peer, first_line, need_binary, oci_spec, run_cmd

IDLE = ["/bin/sh", "-c", "echo ready; exec /bin/sleep infinity"]


class RunscPeer(Peer):
    name = "runsc"
    title = "gVisor runsc (ptrace)"
    slow = True

    def check(self) -> None:
        self.runsc = need_binary("runsc")

    def version(self) -> str:
        return first_line([self.runsc, "--version"])

    def setup(self) -> None:
        self.base = self.ctx.workdir / "runsc"
        self.state = self.base / "state"
        self.state.mkdir(parents=True)
        spec = oci_spec(self.runsc, self.base)
        spec["root"] = {"path": str(self.ctx.rootfs), "readonly": False}
        for name, args in (("true", ["/bin/true"]), ("idle", IDLE)):
            bundle = self.base / name
            bundle.mkdir()
            spec["process"]["args"] = args
            (bundle / "config.json").write_text(json.dumps(spec))
        self._id = Names("bench")

    def teardown(self) -> None:
        base = getattr(self, "base", None)
        if base is None:
            return
        try:
            for cid in run_cmd(self._runsc("list", "-quiet")).split():
                subprocess.run(self._runsc("delete", "-force", cid), capture_output=True,
                               timeout=30)
        except Exception:
            pass
        shutil.rmtree(base, ignore_errors=True)

    def _runsc(self, *args: str) -> list[str]:
        return [self.runsc, "--root", str(self.state), "--platform=ptrace", "--network=none",
                "--overlay", *args]

    def cycle(self) -> None:
        run_cmd(self._runsc("run", "--bundle", str(self.base / "true"), self._id()))

    def start_idle(self) -> tuple[str, subprocess.Popen]:
        cid = self._id()
        proc = subprocess.Popen(self._runsc("run", "--bundle", str(self.base / "idle"), cid),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        line = proc.stdout.readline()
        if line != b"ready\n":
            proc.kill()
            proc.wait()
            raise RuntimeError(f"runsc run {cid}: no ready line (got {line!r}, exit status "
                               f"{proc.returncode})")
        return cid, proc

    def exec_true(self, handle: tuple[str, subprocess.Popen]) -> None:
        run_cmd(self._runsc("exec", handle[0], "/bin/true"))

    def stop_idle(self, handles: list[Any]) -> None:
        for cid, _ in handles:
            subprocess.run(self._runsc("kill", cid, "KILL"), capture_output=True, timeout=30)
        for _, proc in handles:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()


PEER = RunscPeer
