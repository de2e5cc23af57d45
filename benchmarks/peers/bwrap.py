"""Raw bubblewrap with the namespaces, flags and seccomp filter corral's engine uses.

The corral image's rootfs is bound read-only at ``/`` (no overlay, no cgroups, no
agent): what corral adds on top of bwrap is exactly the difference to this row. A
running sandbox is bwrap running :data:`peers.SHELL_LOOP`.
"""

from __future__ import annotations

import os

from bench_engine import bwrap_argv, run_bwrap

from peers import SHELL_LOOP, ShellLoop, ShellLoopPeer, first_line, need_binary


class BwrapPeer(ShellLoopPeer):
    name = "bwrap"
    title = "raw bwrap, same namespaces"

    def check(self) -> None:
        self.bwrap = need_binary("bwrap", "bubblewrap")

    def setup(self) -> None:
        from corral.runtime import seccomp

        self.bpf = seccomp.build_filter()

    def version(self) -> str:
        return first_line([self.bwrap, "--version"])

    def cycle(self) -> None:
        run_bwrap([], self.bwrap, self.ctx.rootfs, None, self.bpf)

    def start_idle(self) -> ShellLoop:
        r, w = os.pipe()
        try:
            os.write(w, self.bpf)
            os.close(w)
            w = -1
            argv = bwrap_argv(self.bwrap, self.ctx.rootfs, None, r)[:-1]
            return ShellLoop(argv + ["/bin/sh", "-c", SHELL_LOOP], pass_fds=(r,), env={},
                             cwd="/")
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)


PEER = BwrapPeer
