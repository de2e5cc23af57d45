"""What one daemon owns on this host, found by its state directory, cache and cgroup.

The fault suite starts each daemon on a private state directory *and* a private
cache (a hard-linked copy of the default image): then every process, cgroup, mount
and staging directory found here is this daemon's, never another test's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from corral.runtime import cgroups
from corral.runtime.images import DEFAULT_IMAGE
from corral.runtime.paths import Layout, default_cache_dir
from corral.runtime.reconcile import engine_cgroup_parent

STAGING = (".tmp-", ".trash-")  # what a crashed commit, build or removal leaves
START_WAIT_S = 120.0  # only against a hang: a start that never answers


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def alive(pid: int, start: int | None = None) -> bool:
    """``pid`` runs (a zombie does not), and is the process that started at ``start``."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X") and (start is None or st[2] == start)


def describe(pid: int) -> str:
    """``pid``'s parent, command line and cgroup, for a failure message."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        group = Path(f"/proc/{pid}/cgroup").read_text().splitlines()[0]
    except OSError:
        return "gone"
    st = _stat(pid)
    return f"ppid {st[1] if st else '?'}: {argv[:200]} ({group})"


def start_time(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot); -1 if it is gone."""
    st = _stat(pid)
    return st[2] if st else -1


def descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of ``root``'s living descendants (not ``root`` itself)."""
    parent: dict[int, int] = {}
    start: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None and st[0] not in "ZX":
            parent[int(name)], start[int(name)] = st[1], st[2]
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:  # bounded: each pid is visited once
        here = frontier.pop()
        for pid, ppid in parent.items():
            if ppid == here and pid not in found:
                found[pid] = start[pid]
                frontier.append(pid)
    return found


@dataclass
class Host:
    """One daemon's private directories, and how to find what it has on the host."""

    base: Path
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    log_file: Path | None = None

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def cache(self) -> Path:
        return self.base / "cache"

    @property
    def socket(self) -> Path:
        return self.base / "corral.sock"

    @property
    def layout(self) -> Layout:
        return Layout(self.state.absolute(), self.cache.absolute())

    @property
    def cgroup_parent(self) -> str:
        """The engine's group (``corral-<key>``; an older engine's ``corral/<key>``)."""
        return engine_cgroup_parent(cgroups.detect(), self.layout.engine_key)

    @classmethod
    def make(cls, *extra_args: str, base: Path | None = None) -> "Host":
        """A base directory (a new temporary one, or ``base``, made) with a private
        cache holding the default image."""
        if base is None:
            base = Path(tempfile.mkdtemp(prefix="corral-faults-"))
        else:
            base.mkdir(parents=True)
        os.chmod(base, 0o711)  # bwrap, as the sandbox's host uid, traverses it
        host = cls(base, list(extra_args))
        shared = default_cache_dir() / "images" / DEFAULT_IMAGE
        images = host.cache / "images"
        images.mkdir(parents=True, mode=0o700)
        # Hard links: no copy of the bytes, and overlay only ever reads a lower layer.
        done = subprocess.run(["cp", "-al", str(shared), str(images / DEFAULT_IMAGE)],
                              capture_output=True)
        if done.returncode != 0:
            subprocess.run(["cp", "-a", str(shared), str(images / DEFAULT_IMAGE)], check=True)
        return host

    # --------------------------------------------------------------- the daemon

    def start(self) -> float:
        """Start the daemon; returns the seconds until it answered a request."""
        self.log_file = self.base / "daemon.log"
        started = time.monotonic()
        with open(self.log_file, "ab") as log:  # (the daemon keeps its own copy)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "corral.server", "--socket", str(self.socket),
                 "--state-dir", str(self.state), "--cache-dir", str(self.cache),
                 *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = started + START_WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}: "
                                   f"see {self.log_file}")
            if self.answers():
                return time.monotonic() - started
            time.sleep(0.01)
        raise RuntimeError(f"the daemon did not answer within {START_WAIT_S:g} s")

    def answers(self) -> bool:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        try:
            s.connect(str(self.socket))
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: corral\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False
        finally:
            s.close()

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        """SIGINT, as ``corral daemon stop`` would (its sandboxes stop with it; SIGTERM
        would hand them over to a next daemon); returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def remove(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)

    # ------------------------------------------------------ what it has on the host

    def tree(self) -> dict[int, int]:
        """The daemon's processes: its descendants (warden, launchers, sandboxes)."""
        assert self.proc is not None
        return descendants(self.proc.pid)

    def in_cgroups(self) -> dict[int, str]:
        """``{pid: cgroup path}`` of every process in the engine's cgroup subtree."""
        marker = f"/{self.cgroup_parent}"
        found = {}
        for name in os.listdir("/proc"):
            if not name.isdigit() or not alive(int(name)):
                continue
            try:
                lines = Path(f"/proc/{name}/cgroup").read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                path = line.split(":", 2)[-1]
                if path == marker or path.startswith(marker + "/"):
                    found[int(name)] = path
                    break
        return found

    def cgroup_children(self) -> list[str]:
        return cgroups.detect().children(self.cgroup_parent)

    def cgroup_exists(self) -> bool:
        try:
            cgroups.detect().open(self.cgroup_parent)
        except Exception:  # noqa: BLE001 - NotFound: it is gone
            return False
        return True

    def host_mounts(self) -> list[str]:
        """Mount points under the base directory in the host's mount namespace."""
        base = str(self.base.resolve())
        points = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4]
            if point == base or point.startswith(base + "/"):
                points.append(point)
        return points

    def staging(self) -> list[str]:
        """Debris of crashed work: staged layers, half-built images, their trash."""
        images = self.layout.images_dir
        places = [self.layout.layers_dir, images, images / ".layers"]
        found = []
        for d in places:
            try:
                found += [str(d / n) for n in os.listdir(d) if n.startswith(STAGING)]
            except FileNotFoundError:
                continue
        return found

    def sandbox_dirs(self) -> list[str]:
        try:
            return sorted(os.listdir(self.layout.sandboxes_dir))
        except FileNotFoundError:
            return []
