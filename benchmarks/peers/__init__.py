"""The systems corral is measured against, each in its own module, all timed one way.

Every peer is a :class:`Peer` with four small verbs: ``cycle`` (create a sandbox, run
``true`` in it, destroy it), ``start_idle`` (a sandbox left running, ready for
commands), ``exec_true`` (run ``true`` in a running sandbox and wait for it) and
``stop_idle``. :func:`measure` turns those verbs into the same figures for every peer:

- ``create_ready_ms_p50`` / ``_p95``: create→ready where the peer has a separate ready
  signal (corral), else create→exec ``true``→destroy (``create_ready_is`` says which);
  ``cycle_ms_p50`` / ``_p95`` is always create→exec ``true``→destroy;
- ``exec_rtt_ms_p50`` / ``_p95``: ``true`` in a running sandbox, round trip;
- ``mem_per_idle_sandbox_mb``: host memory (MemTotal - MemAvailable) per idle sandbox
  with ``mem_idle_n`` of them running, and ``pss_per_idle_sandbox_mb``: the PSS of the
  processes started for them (run.py adopts daemonized ones as a subreaper);
- ``create_rate_per_s``: sustained cycles per second with ``RATE_INFLIGHT`` in flight.

A peer that cannot run here raises :class:`Skip` with the reason; ``run.py`` prints
it and records ``{"skipped": reason}``.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_engine import RATE_INFLIGHT, meminfo_used_kb, pct, pss_kb

# Every peer module, in the order they are measured (cheapest first).
PEER_MODULES = ("corral_sdk", "bare", "bwrap", "runc", "podman", "runsc", "ray_sandbox")
SETTLE_S = 1.0  # after starting the idle sandboxes, before reading host memory
SETTLED_KB = 512  # host memory moving less than this in 0.25 s counts as settled
CMD_TIMEOUT_S = 60.0
PR_SET_CHILD_SUBREAPER = 36
CYCLE_IS = "create→exec true→destroy"


class Skip(Exception):
    """This peer cannot run on this host; the message says why and what would fix it."""


@dataclass(frozen=True)
class PeerSizes:
    """How many samples a peer gets; slow peers (~100 ms a start) get fewer."""

    cycles: int
    execs: int
    mem_n: int  # idle sandboxes at once
    mem_rounds: int  # the memory figure is the median of this many rounds
    rate_s: float

    @classmethod
    def pick(cls, quick: bool, slow: bool, smoke: bool = False) -> PeerSizes:
        if smoke:  # every figure once: proves the harness runs, the figures mean nothing
            return cls(cycles=2, execs=2, mem_n=2, mem_rounds=1, rate_s=0.3)
        if quick:
            return cls(cycles=10, execs=10, mem_n=10, mem_rounds=1, rate_s=1.5) if slow else (
                cls(cycles=30, execs=30, mem_n=20, mem_rounds=1, rate_s=1.5))
        return cls(cycles=30, execs=30, mem_n=50, mem_rounds=3, rate_s=5.0) if slow else (
            cls(cycles=100, execs=200, mem_n=50, mem_rounds=3, rate_s=5.0))


@dataclass
class Context:
    """What every peer gets: the image to run and a private scratch directory."""

    rootfs: Path  # the corral default image's root filesystem (read-only: never write)
    workdir: Path  # scratch space, removed after the peer
    quick: bool
    corral_url: str | None = None  # a private corral daemon (for the corral row)


class Peer:
    """One system to compare with. Subclasses fill in the verbs."""

    name = ""
    title = ""
    slow = False  # fewer samples (see PeerSizes)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def check(self) -> None:
        """Raise :class:`Skip` if the peer cannot run here. Cheap, no side effects."""

    def setup(self) -> None:
        """One-off preparation (not timed), e.g. importing an image."""

    def teardown(self) -> None:
        """Undo ``setup`` and anything left behind; must not raise."""

    def version(self) -> str:
        return ""

    def cycle(self) -> float | None:
        """Create a sandbox, run ``true`` in it, destroy it. Returns create→ready in ms
        when the peer has a ready signal of its own (else None)."""
        raise NotImplementedError

    def start_idle(self) -> Any:
        """Start a sandbox that stays up, ready for commands; returns its handle."""
        raise NotImplementedError

    def exec_true(self, handle: Any) -> None:
        """Run ``true`` in a running sandbox and wait for it; raise if it failed."""
        raise NotImplementedError

    def stop_idle(self, handles: list[Any]) -> None:
        """Stop and remove these sandboxes (best effort: never raise half-way)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------- helpers


def need_binary(name: str, package: str | None = None) -> str:
    """The path of ``name``, or :class:`Skip` naming the Debian package to install."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if not path:
        raise Skip(f"{name} is not installed (apt-get install {package or name}; "
                   "scripts/install-bench.sh does it)")
    return path


def run_cmd(argv: list[str], *, timeout: float = CMD_TIMEOUT_S, detach: bool = False,
            **kw: Any) -> str:
    """Run a command; its stdout, or RuntimeError with its stderr if it failed.

    ``detach``: the command leaves a process behind that inherits its stdio (``runc
    run -d``), so pipes would never reach EOF: stdout is discarded, stderr goes to a
    file.
    """
    if detach:
        with tempfile.TemporaryFile() as err:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=err, timeout=timeout, **kw)
            err.seek(0)
            stdout, stderr = "", err.read().decode(errors="replace")
    else:
        kw.setdefault("stdin", subprocess.DEVNULL)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
        stdout, stderr = r.stdout, r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {r.returncode}: "
                           f"{(stderr or stdout).strip()[-400:]}")
    return stdout


def first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return ((out.stdout or out.stderr).strip().splitlines() or [""])[0]


def oci_spec(runtime: str, scratch: Path) -> dict[str, Any]:
    """``RUNTIME spec``'s default config.json, set up the way a corral sandbox runs:
    no terminal, uid and gid 1000, in ``/``, hostname ``sandbox``."""
    run_cmd([runtime, "spec", "--bundle", str(scratch)])
    path = scratch / "config.json"
    spec = json.loads(path.read_text())
    path.unlink()
    spec["process"].update(terminal=False, cwd="/", user={"uid": 1000, "gid": 1000})
    spec["hostname"] = "sandbox"
    return spec


class Names:
    """Unique container names, safe to take from several threads at once."""

    def __init__(self, prefix: str) -> None:
        self.prefix = f"{prefix}-{os.getpid()}"
        self._count = itertools.count()
        self._lock = threading.Lock()

    def __call__(self) -> str:
        with self._lock:
            return f"{self.prefix}-{next(self._count)}"


def load(name: str, ctx: Context) -> Peer:
    module = importlib.import_module(f"peers.{name}")
    return module.PEER(ctx)


# ---------------------------------------------------------------------------- measure


def settled_used_kb(timeout: float = 5.0) -> tuple[int, int]:
    """Host memory in use once it stops moving (what the last phase freed, the kernel
    releases in the background), as the median of a few readings, and their spread."""
    prev = meminfo_used_kb()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.25)
        cur = meminfo_used_kb()
        if abs(cur - prev) < SETTLED_KB:
            break
        prev = cur
    readings = []
    for _ in range(5):
        readings.append(meminfo_used_kb())
        time.sleep(0.1)
    return int(statistics.median(readings)), max(readings) - min(readings)


def become_subreaper() -> None:
    """Adopt the processes our peers daemonize (conmon, ``runc run -d``'s init), so
    :func:`descendants` finds every process a peer started. Call once, in run.py."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def descendants(root: int | None = None) -> list[int]:
    """Every live process below ``root`` (default: this one)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root or os.getpid()]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _timed(fn: Any, n: int) -> tuple[list[float], list[float]]:
    total, inner = [], []
    for _ in range(n):
        t = time.perf_counter()
        ready = fn()
        total.append((time.perf_counter() - t) * 1e3)
        if ready is not None:
            inner.append(ready)
    return total, inner


def _rate(peer: Peer, seconds: float) -> tuple[float, int]:
    """Cycles per second with RATE_INFLIGHT running at once; and how many failed."""
    done, failed = [0], [0]
    deadline = time.perf_counter() + seconds
    lock = threading.Lock()

    def worker() -> None:
        while time.perf_counter() < deadline:
            try:
                peer.cycle()
                ok = True
            except Exception:  # counted, not fatal: a peer may shed load
                ok = False
            with lock:
                if ok:
                    done[0] += 1
                else:
                    failed[0] += 1

    t = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(RATE_INFLIGHT)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return done[0] / (time.perf_counter() - t), failed[0]


def _memory(peer: Peer, n: int, rounds: int, notes: list[str]) -> dict[str, Any]:
    """Host memory (and PSS of the processes started) per idle sandbox, n at a time.

    The median of ``rounds`` rounds: on a shared host, other work moves MemAvailable
    by megabytes a second, and one round can land on such a swing.
    """
    host, pss, noise, drift, counts, stops = [], [], [], [], [], []
    for _ in range(rounds):
        gc.collect()
        used0, noise0 = settled_used_kb()
        pss0 = pss_kb(descendants())
        handles: list[Any] = []
        try:
            try:
                for _ in range(n):
                    handles.append(peer.start_idle())
            except Exception as exc:  # the count it sustains is a figure too
                notes.append(f"idle sandbox {len(handles) + 1} of {n} failed to start: {exc}")
            time.sleep(SETTLE_S)
            used1, noise1 = settled_used_kb()
            pss1 = pss_kb(descendants())
        finally:
            t = time.perf_counter()
            peer.stop_idle(handles)
            stops.append(time.perf_counter() - t)
        if not handles:
            break
        used2, _ = settled_used_kb()
        k = 1024 * len(handles)
        counts.append(len(handles))
        host.append((used1 - used0) / k)
        pss.append((pss1 - pss0) / k)
        # How far host memory moved by itself: while it was read, and over the round
        # (once the sandboxes are gone it should be back where it started).
        noise.append(max(noise0, noise1) / k)
        drift.append(abs(used2 - used0) / k)
    if not host:
        return {"mem_idle_n": 0, "mem_per_idle_sandbox_mb": None}
    return {
        "mem_idle_n": min(counts),
        "mem_per_idle_sandbox_mb": statistics.median(host),
        "mem_rounds_mb": host,
        "mem_spread_mb": (max(host) - min(host)) / 2,
        "mem_noise_mb": statistics.median(noise),
        "mem_drift_mb": statistics.median(drift),
        "pss_per_idle_sandbox_mb": statistics.median(pss),
        "stop_idle_s": statistics.median(stops),
    }


def measure(peer: Peer, quick: bool, log: Any = print, smoke: bool = False) -> dict[str, Any]:
    """Every figure of one peer (see the module docstring). Raises Skip or errors."""
    sizes = PeerSizes.pick(quick, peer.slow, smoke)
    out: dict[str, Any] = {"title": peer.title, "version": peer.version(),
                           "sizes": sizes.__dict__, "notes": []}
    try:
        t0 = time.perf_counter()
        peer.setup()
        out["setup_s"] = time.perf_counter() - t0
        for _ in range(2):
            peer.cycle()  # warm caches (image files, binaries)
        log(f"  {peer.name}: create→exec→destroy (n={sizes.cycles})")
        cycles, ready = _timed(peer.cycle, sizes.cycles)
        out["cycle_ms_p50"], out["cycle_ms_p95"] = pct(cycles, 50), pct(cycles, 95)
        if ready:
            out["create_ready_ms_p50"], out["create_ready_ms_p95"] = pct(ready, 50), pct(ready, 95)
            out["create_ready_is"] = "create→ready"
        else:
            out["create_ready_ms_p50"], out["create_ready_ms_p95"] = pct(cycles, 50), pct(cycles, 95)
            out["create_ready_is"] = CYCLE_IS

        log(f"  {peer.name}: exec round trip (n={sizes.execs})")
        handle = peer.start_idle()
        try:
            for _ in range(3):
                peer.exec_true(handle)
            rtt, _ = _timed(lambda: peer.exec_true(handle), sizes.execs)
        finally:
            peer.stop_idle([handle])
        out["exec_rtt_ms_p50"], out["exec_rtt_ms_p95"] = pct(rtt, 50), pct(rtt, 95)

        log(f"  {peer.name}: create rate ({sizes.rate_s:g} s, {RATE_INFLIGHT} in flight)")
        out["create_rate_per_s"], failed = _rate(peer, sizes.rate_s)
        if failed:
            out["notes"].append(f"create rate: {failed} cycles failed under load")

        log(f"  {peer.name}: host memory, {sizes.mem_rounds} x {sizes.mem_n} idle sandboxes")
        out.update(_memory(peer, sizes.mem_n, sizes.mem_rounds, out["notes"]))
    finally:
        peer.teardown()
    return out


# ------------------------------------------------------------------- a shell "agent"

# The smallest thing that runs commands in a live sandbox: a shell that runs `true`
# for every line it reads and answers with a line. It is the floor for an agent.
SHELL_LOOP = "echo ready; while read x; do /bin/true; echo; done"


class ShellLoop:
    """A process running :data:`SHELL_LOOP`, talked to over its stdin and stdout."""

    def __init__(self, argv: list[str], **popen: Any) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0, **popen)
        self._expect("ready\n")

    def _expect(self, line: str) -> None:
        got = self.proc.stdout.readline().decode()
        if got != line:
            self.close()
            raise RuntimeError(f"{self.proc.args[0]} answered {got!r}, not {line!r} "
                               f"(exit status {self.proc.poll()})")

    def exec_true(self) -> None:
        self.proc.stdin.write(b"\n")
        self._expect("\n")

    def close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ShellLoopPeer(Peer):
    """A peer whose running sandboxes are :class:`ShellLoop` processes."""

    def exec_true(self, handle: ShellLoop) -> None:
        handle.exec_true()

    def stop_idle(self, handles: list[Any]) -> None:
        for h in handles:
            h.close()
