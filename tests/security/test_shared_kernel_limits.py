"""Red-team: kernel limits counted per user, shared by every sandbox (and the host's
user that made their namespaces), are not one sandbox's to use up."""

from __future__ import annotations

import corral

HOLD = ("import ctypes, sys\nl = ctypes.CDLL(None)\nfds = [l.inotify_init() for _ in range(300)]\n"
        "print(sum(f >= 0 for f in fds), flush=True)\nsys.stdin.read()\n")
PROBE = ("import ctypes\nl = ctypes.CDLL(None, use_errno=True)\nfd = l.inotify_init()\n"
         "print(fd >= 0, ctypes.get_errno())\n")


def test_one_sandbox_cannot_use_up_the_inotify_instances_of_the_others(daemon):
    with corral.Client(daemon.url) as client:
        with corral.Sandbox.create(client=client, image="python") as a, \
                corral.Sandbox.create(client=client, image="python") as b:
            assert b.exec(["python3", "-c", PROBE]).stdout.split()[0] == "True"
            with a.spawn(["python3", "-c", HOLD], timeout=60) as hog:
                held = hog.exchange(b"", timeout=30)
                other = b.exec(["python3", "-c", PROBE]).stdout
                hog.kill()
            assert other.split()[0] == "True", (held, other)
