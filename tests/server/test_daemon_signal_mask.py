"""A daemon started with SIGINT blocked (as a Ray worker starts a cluster node's daemon:
a signal mask survives exec) still stops on SIGINT, instead of waiting to be killed."""

from __future__ import annotations

import shutil
import sys

from tests.conftest import Daemon, _base_dir, requires_root

BLOCK_SIGINT = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, "
                "{signal.SIGINT, signal.SIGTERM}); os.execvp(sys.argv[1], sys.argv[1:])")


@requires_root
def test_sigint_stops_a_daemon_whose_parent_blocked_it():
    base = _base_dir()
    d = Daemon(base, wrapper=[sys.executable, "-c", BLOCK_SIGINT]).start()
    try:
        d.stop()  # SIGINT, then SIGKILL if it is still there after 30 s
        assert d.proc is not None and d.proc.returncode == 0, d.log.read_text()[-2000:]
    finally:
        if d.proc and d.proc.poll() is None:
            d.proc.kill()
        shutil.rmtree(base, ignore_errors=True)
