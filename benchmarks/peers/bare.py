"""The floor: bare fork+exec on the host, no isolation at all.

create→ready is a posix_spawn of the host's ``/bin/true`` (what ``bare_exec_ms_p50``
times); a "running sandbox" is a host shell that runs ``true`` per request
(:data:`peers.SHELL_LOOP`), so its exec round trip is one fork+exec plus a pipe.
"""

from __future__ import annotations

import platform

from bench_engine import bare_exec

from peers import SHELL_LOOP, ShellLoop, ShellLoopPeer


class BarePeer(ShellLoopPeer):
    name = "bare_exec"
    title = "bare fork+exec (floor)"

    def version(self) -> str:
        return f"kernel {platform.release()}"

    def cycle(self) -> None:
        bare_exec(["/bin/true"])

    def start_idle(self) -> ShellLoop:
        return ShellLoop(["/bin/sh", "-c", SHELL_LOOP])


PEER = BarePeer
