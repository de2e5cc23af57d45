"""Benchmark of the sandbox engine on this host: latency, throughput, density, teardown.

Run as root (the engine needs namespaces, cgroups and mounts)::

    python3 benchmarks/bench_engine.py --quick              # ~20 s
    python3 benchmarks/bench_engine.py --json bench.json    # full run (~2 min), JSON too
    python3 benchmarks/bench_engine.py --only teardown       # 1000 idle sandboxes, then their teardown

Every figure is a median (or a rate) measured in this run and printed next to a
baseline measured in the same run, so a slow machine or a busy neighbour shows up in
both:

- ``bare_exec``   fork+exec of the host's ``/bin/true`` from Python (posix_spawn): the floor.
- ``bwrap_true``  raw ``bwrap`` with the engine's namespaces, flags and seccomp filter,
                  the image's rootfs bound read-only at ``/``, running ``/bin/true``.
- ``bare_python`` the host's real ``python3 -c pass`` (never the pyenv shim).

``launch_bwrap_true`` is the same bwrap started through the agent's launcher (the
sandbox's host uid and rlimit, no cgroups); ``create_ready_spaced`` creates after an
idle pause, ``create_ready_at_density`` creates while the density test's sandboxes
all run. ``benchmarks/profile_engine.py`` shows where a create's time goes.

The issue's targets are printed next to the figures; missing one is reported, never
an error (benchmarks do not gate anything on time). Everything runs on a private
temporary state directory that is removed at the end, sandboxes and cgroups included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

SCHEMA_VERSION = 1
DENSITY_MEMORY_MB = 64
DENSITY_BATCH = 50
RATE_INFLIGHT = 8
SETTLE_S = 1.0  # after the density creates, before reading memory: agents reach idle
# A pause between two creates long enough for the kernel to fall back out of its
# "recent cgroup migration" fast path: a create after a pause is what a job that asks
# for one sandbox now and then sees (back-to-back creates hide a ~10 ms RCU wait).
SPACED_GAP_S = 0.05
MiB = 1 << 20

# The targets: (figure, comparison, bound, unit).
TARGETS = {
    "create_ready_ms_p50": ("<=", 15.0, "ms"),
    "create_ready_spaced_ms_p50": ("<=", 15.0, "ms"),
    "exec_rtt_ms_p50": ("<=", 2.0, "ms"),
    "mem_per_idle_sandbox_mb": ("<=", 8.0, "MB"),
    "teardown_1000_s": ("<=", 1.5, "s"),
}
# ``--only PHASE``: the phases, in the order a full run takes them (``teardown`` is the
# density phase: its sandboxes are what is torn down).
PHASES = ("baselines", "create", "spaced", "exec", "cycle", "rate", "teardown")

# Every key the JSON carries, in order: a figure that was not measured is null.
FIGURES = (
    "bare_exec_ms_p50",
    "bare_python_ms_p50",
    "bwrap_true_ms_p50",
    "launch_bwrap_true_ms_p50",
    "create_ready_ms_p50",
    "create_ready_ms_p95",
    "create_ready_spaced_ms_p50",
    "delete_ms_p50",
    "create_cpu_user_ms",
    "create_cpu_sys_ms",
    "create_cpu_children_ms",
    "exec_rtt_ms_p50",
    "exec_rtt_ms_p95",
    "exec_python_ms_p50",
    "create_exec_destroy_ms_p50",
    "create_rate_per_s",
    "bwrap_rate_per_s",
    "density_n",
    "density_create_s",
    "max_concurrent_sandboxes",
    "create_ready_at_density_ms_p50",
    "mem_per_idle_sandbox_mb",
    "pss_per_idle_sandbox_mb",
    "cgroup_mem_per_idle_sandbox_mb",
    "engine_rss_per_sandbox_kb",
    "teardown_s",
    "teardown_1000_s",
    "teardown_reclaimed_s",
    "teardown_engine_cpu_s",
    "teardown_loop_cpu_s",
)


@dataclass(frozen=True)
class Sizes:
    """How many of each measurement to take."""

    baseline: int
    create: int
    spaced: int
    exec_true: int
    exec_python: int
    cycle: int
    rate_s: float
    density: int

    @classmethod
    def pick(cls, quick: bool, smoke: bool = False) -> "Sizes":
        if smoke:  # every path once; the figures mean nothing
            return cls(baseline=3, create=3, spaced=2, exec_true=3, exec_python=2, cycle=2,
                       rate_s=0.5, density=5)
        if quick:
            return cls(baseline=50, create=30, spaced=15, exec_true=50, exec_python=10, cycle=20,
                       rate_s=3.0, density=200)
        return cls(baseline=200, create=200, spaced=50, exec_true=500, exec_python=50, cycle=100,
                   rate_s=10.0, density=1000)


# ---------------------------------------------------------------------------- helpers


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (nearest rank); the median for ``q=50``."""
    if q == 50:
        return statistics.median(xs)
    ranked = sorted(xs)
    return ranked[min(len(ranked) - 1, max(0, round(q / 100 * len(ranked)) - 1))]


def timed_ms(fn: Callable[[], Any], n: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


async def atimed_ms(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def meminfo_used_kb() -> int:
    """MemTotal - MemAvailable: what the host cannot hand out right now."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0])
    return fields["MemTotal"] - fields["MemAvailable"]


def self_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def pids_in_cgroup(parent: str) -> list[int]:
    """Processes whose cgroup (in any hierarchy) lies under ``parent``."""
    marker = f"/{parent}/"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if marker in f.read():
                    found.append(int(entry))
        except OSError:
            continue  # exited meanwhile
    return found


def pss_kb(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def mounts_under(prefix: str) -> list[str]:
    prefix = prefix.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if (ln.split()[4] + "/").startswith(prefix)]


def remove_engine_cgroup(engine: Any) -> None:
    """Remove the engine's (now empty) parent cgroup, which ``close`` leaves behind."""
    from corral.errors import CorralError

    try:
        engine.cgroups.open(engine.cgroup_parent).remove()
    except (OSError, CorralError):
        pass


def raise_nofile() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (this host caps it at 20000)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def cpu_ms() -> tuple[float, float, float]:
    """CPU ms of this process (user, system) and of its reaped descendants (both)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime * 1e3, me.ru_stime * 1e3, (kids.ru_utime + kids.ru_stime) * 1e3


# -------------------------------------------------------------------------- baselines


def bare_exec(argv: list[str]) -> None:
    # No redirections, close_fds=False, an absolute path: subprocess uses posix_spawn.
    subprocess.Popen(argv, close_fds=False).wait()


def bwrap_argv(bwrap: str, rootfs: Path, agent: Path, seccomp_fd: int) -> list[str]:
    """The engine's bwrap command line (see ``Engine._launch_args``) running /bin/true,
    with the image's rootfs bound read-only instead of the sandbox's overlay (so
    without the bind of the agent, which needs a mount point in the writable layer)."""
    return [
        bwrap,
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup", "--disable-userns",
        "--uid", "1000", "--gid", "1000", "--hostname", "sandbox",
        "--ro-bind", str(rootfs), "/",
        "--proc", "/proc", "--dev", "/dev",
        "--cap-drop", "ALL", "--new-session", "--die-with-parent", "--as-pid-1",
        "--seccomp", str(seccomp_fd), "--chdir", "/", "--unshare-net",
        "/bin/true",
    ]


@contextlib.contextmanager
def reachable(rootfs: Path):
    """``rootfs`` bound read-only where the sandbox's unprivileged host uid can reach it:
    the image store itself is root's only (0700), and only the engine's launcher, as
    root, mounts from it."""
    d = Path(tempfile.mkdtemp(prefix="corral-bench-root-"))
    os.chmod(d, 0o755)
    subprocess.run(["mount", "--bind", str(rootfs), str(d)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
        d.rmdir()


def run_bwrap(prefix: list[str], bwrap: str, rootfs: Path, agent: Path, bpf: bytes) -> None:
    r, w = os.pipe()
    try:
        os.write(w, bpf)
        os.close(w)
        w = -1
        proc = subprocess.Popen(
            prefix + bwrap_argv(bwrap, rootfs, agent, r), pass_fds=(r,),
            stdin=subprocess.DEVNULL, env={}, cwd="/",
        )
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    if proc.wait() != 0:
        raise RuntimeError(f"raw bwrap failed with exit status {proc.returncode}")


def host_python() -> str:
    """The host's real interpreter: /usr/bin/python3, else this one (never a shim)."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


# --------------------------------------------------------------------- engine phases


async def phase_create(engine: Any, n: int, fig: dict[str, Any]) -> None:
    """Sequential create->ready, each deleted after (delete timed apart)."""
    for _ in range(5):  # warm caches: dentries of the image, the agent binary, sqlite
        await engine.delete((await engine.create()).id)
    gc.collect()
    creates, deletes = [], []
    cpu0 = cpu_ms()
    for _ in range(n):
        t = time.perf_counter()
        info = await engine.create()
        t1 = time.perf_counter()
        await engine.delete(info.id)
        creates.append((t1 - t) * 1e3)
        deletes.append((time.perf_counter() - t1) * 1e3)
    cpu1 = cpu_ms()
    fig["create_ready_ms_p50"] = pct(creates, 50)
    fig["create_ready_ms_p95"] = pct(creates, 95)
    fig["delete_ms_p50"] = pct(deletes, 50)
    # Per create+delete: the engine's own CPU (Python, and the kernel work of its
    # mounts, cgroups and spawns) against that of bwrap and the agent.
    fig["create_cpu_user_ms"] = (cpu1[0] - cpu0[0]) / n
    fig["create_cpu_sys_ms"] = (cpu1[1] - cpu0[1]) / n
    fig["create_cpu_children_ms"] = (cpu1[2] - cpu0[2]) / n


async def phase_create_spaced(engine: Any, n: int, fig: dict[str, Any]) -> None:
    """Sequential create->ready with an idle pause before each."""
    creates = []
    for _ in range(n):
        await asyncio.sleep(SPACED_GAP_S)
        t = time.perf_counter()
        info = await engine.create()
        creates.append((time.perf_counter() - t) * 1e3)
        await engine.delete(info.id)
    fig["create_ready_spaced_ms_p50"] = pct(creates, 50)


async def phase_exec(engine: Any, sizes: Sizes, python: str, fig: dict[str, Any]) -> None:
    info = await engine.create()
    try:
        for _ in range(20):
            await engine.exec(info.id, ["true"])
        rtt = await atimed_ms(lambda: engine.exec(info.id, ["true"]), sizes.exec_true)
        r = await engine.exec(info.id, [python, "-c", "pass"])
        if r.returncode != 0:
            raise RuntimeError(f"{python} -c pass failed in the sandbox: {r.stderr!r}")
        py = await atimed_ms(lambda: engine.exec(info.id, [python, "-c", "pass"]),
                             sizes.exec_python)
    finally:
        await engine.delete(info.id)
    fig["exec_rtt_ms_p50"] = pct(rtt, 50)
    fig["exec_rtt_ms_p95"] = pct(rtt, 95)
    fig["exec_python_ms_p50"] = pct(py, 50)


async def phase_cycle(engine: Any, n: int, fig: dict[str, Any]) -> None:
    async def cycle() -> None:
        info = await engine.create()
        r = await engine.exec(info.id, ["true"])
        await engine.delete(info.id)
        if r.returncode != 0:
            raise RuntimeError(f"true exited {r.returncode} in a sandbox")

    fig["create_exec_destroy_ms_p50"] = pct(await atimed_ms(cycle, n), 50)


async def phase_rate(engine: Any, seconds: float, fig: dict[str, Any]) -> None:
    """Sustained create (+delete) throughput with RATE_INFLIGHT creates in flight."""
    created = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal created
        while time.perf_counter() < deadline:
            info = await engine.create(memory_mb=DENSITY_MEMORY_MB)
            created += 1
            await engine.delete(info.id)

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(RATE_INFLIGHT)))
    fig["create_rate_per_s"] = created / (time.perf_counter() - t)


async def phase_density(engine: Any, n: int, fig: dict[str, Any], notes: list[str]) -> None:
    """n idle sandboxes at once: host memory each, then a concurrent teardown of all."""
    gc.collect()
    await asyncio.sleep(0.2)
    used0, rss0 = meminfo_used_kb(), self_rss_kb()
    ids: list[str] = []
    errors: list[str] = []
    t = time.perf_counter()
    for start in range(0, n, DENSITY_BATCH):
        batch = min(DENSITY_BATCH, n - start)
        results = await asyncio.gather(
            *(engine.create(memory_mb=DENSITY_MEMORY_MB) for _ in range(batch)),
            return_exceptions=True,
        )
        for res in results:
            if isinstance(res, BaseException):
                errors.append(f"{type(res).__name__}: {res}")
            else:
                ids.append(res.id)
        if len(errors) >= batch and all(isinstance(x, BaseException) for x in results):
            notes.append(f"density: stopped after a batch that failed entirely ({errors[-1]})")
            break
    fig["density_create_s"] = time.perf_counter() - t
    fig["density_n"] = len(ids)
    if errors:
        notes.append(f"density: {len(errors)} of {n} creates failed; first: {errors[0]}")
    await asyncio.sleep(SETTLE_S)

    running = {i.id for i in engine.list(state="running")}
    missing = [i for i in ids if i not in running]
    if missing:
        notes.append(f"density: {len(missing)} created sandboxes are not running")
    pids = pids_in_cgroup(engine.cgroup_parent)
    used1, rss1 = meminfo_used_kb(), self_rss_kb()
    alive = len(running)
    fig["max_concurrent_sandboxes"] = alive
    if alive:
        fig["mem_per_idle_sandbox_mb"] = (used1 - used0) / 1024 / alive
        fig["pss_per_idle_sandbox_mb"] = pss_kb(pids) / 1024 / alive
        cg_mb = sum(engine.usage(i)["memory_mb"] for i in running)
        fig["cgroup_mem_per_idle_sandbox_mb"] = cg_mb / alive
        fig["engine_rss_per_sandbox_kb"] = (rss1 - rss0) / alive
        notes.append(f"density: {alive} running, {len(pids)} processes in their cgroups")
    # One more sandbox while they all run: its bwrap copies the host's mount table,
    # which now holds two mounts per live sandbox.
    extra = []
    for _ in range(20):
        t = time.perf_counter()
        info = await engine.create(memory_mb=DENSITY_MEMORY_MB)
        extra.append((time.perf_counter() - t) * 1e3)
        await engine.delete(info.id)
    fig["create_ready_at_density_ms_p50"] = pct(extra, 50)

    # The daemon's deletes (``wait=False`` where the engine has it): each returns once
    # every process of its sandbox is gone; the empty cgroups, directories and uids
    # follow in the background, done at ``teardown_reclaimed_s``.
    detach = {"wait": False} if "wait" in inspect.signature(engine.delete).parameters else {}
    # CPU as well as wall: on a shared host the wall swings with the neighbours' load,
    # the engine's own CPU (all its threads; the loop's thread alone) much less
    cpu0, loop0 = os.times(), time.thread_time()
    t = time.perf_counter()
    results = await asyncio.gather(*(engine.delete(i, **detach) for i in ids),
                                   return_exceptions=True)
    fig["teardown_s"] = time.perf_counter() - t
    fig["teardown_loop_cpu_s"] = time.thread_time() - loop0
    reclaimed = getattr(engine, "reclaimed", None)
    if reclaimed is not None:
        await reclaimed()
    elif getattr(engine, "_teardowns", None):  # an engine from before reclaimed()
        await asyncio.gather(*list(engine._teardowns), return_exceptions=True)
    fig["teardown_reclaimed_s"] = time.perf_counter() - t
    cpu1 = os.times()
    fig["teardown_engine_cpu_s"] = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    if ids:
        fig["teardown_1000_s"] = fig["teardown_s"] * 1000 / len(ids)
        if len(ids) != 1000:
            notes.append(f"teardown_1000_s is scaled linearly from {len(ids)} sandboxes; "
                         "run without --quick for the real figure")
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        notes.append(f"teardown: {len(failed)} deletes failed; first: {failed[0]!r}")
    left = engine.list(state="running")
    if left or pids_in_cgroup(engine.cgroup_parent):
        notes.append(f"teardown: {len(left)} sandboxes / processes still alive after it")


# ---------------------------------------------------------------------------- report


def fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or value >= 1000:
        return f"{value:.0f}"
    return f"{value:.3g}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:6.1f}x" if a and b else "      -"


def report(fig: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Rows of (figure, value, target, met, comparison)."""
    bare, bw, py = fig["bare_exec_ms_p50"], fig["bwrap_true_ms_p50"], fig["bare_python_ms_p50"]
    vs = {
        "bwrap_true_ms_p50": f"{ratio(bw, bare)} bare exec",
        "launch_bwrap_true_ms_p50": f"{ratio(fig['launch_bwrap_true_ms_p50'], bw)} raw bwrap",
        "create_ready_ms_p50": f"{ratio(fig['create_ready_ms_p50'], bw)} raw bwrap",
        "create_ready_ms_p95": f"{ratio(fig['create_ready_ms_p95'], bw)} raw bwrap",
        "create_ready_spaced_ms_p50": (
            f"{ratio(fig['create_ready_spaced_ms_p50'], bw)} raw bwrap"),
        "create_ready_at_density_ms_p50": (
            f"{ratio(fig['create_ready_at_density_ms_p50'], bw)} raw bwrap"),
        "delete_ms_p50": f"{ratio(fig['delete_ms_p50'], bw)} raw bwrap",
        "exec_rtt_ms_p50": f"{ratio(fig['exec_rtt_ms_p50'], bare)} bare exec",
        "exec_rtt_ms_p95": f"{ratio(fig['exec_rtt_ms_p95'], bare)} bare exec",
        "exec_python_ms_p50": f"{ratio(fig['exec_python_ms_p50'], py)} bare python",
        "create_exec_destroy_ms_p50": f"{ratio(fig['create_exec_destroy_ms_p50'], bw)} raw bwrap",
        "create_rate_per_s": (
            f"{ratio(fig['create_rate_per_s'], fig['bwrap_rate_per_s'])} raw bwrap rate, "
            f"{RATE_INFLIGHT} in flight (target >= 0.8x)"
        ),
        "teardown_1000_s": (
            # 1000 deletes of delete_ms_p50 ms each, one after another, take that many s.
            f"{ratio(fig['teardown_1000_s'], fig['delete_ms_p50'])} 1000 serial deletes"
        ),
    }
    rows = []
    for key in FIGURES:
        value = fig.get(key)
        target, met = "", ""
        if key in TARGETS:
            op, bound, unit = TARGETS[key]
            target = f"{op} {bound:g} {unit}"
            if value is not None:
                met = "yes" if value <= bound else "MISSED"
        rows.append((key, fmt(value), target, met, vs.get(key, "")))
    return rows


def print_table(rows: list[tuple[str, str, str, str, str]]) -> None:
    head = ("figure", "value", "target", "met", "vs baseline (same run)")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) if i != 1 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r[:4], widths, strict=True))) + "  " + r[4])


def count_mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def count_bwrap() -> int:
    """bwrap processes on the host: other engines' sandboxes, which skew every figure."""
    n = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/comm") as f:
                n += f.read().strip() == "bwrap"
        except OSError:
            continue
    return n


def host_facts() -> dict[str, Any]:
    bwrap = shutil.which("bwrap")
    version = None
    if bwrap:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "bwrap": version and version.strip(),
        "loadavg_start": os.getloadavg()[0],
        # Every bwrap start copies the host's mount table (~25 us a mount here), and
        # other engines' sandboxes add two mounts each: a busy neighbour shows up here.
        "mounts_start": count_mounts(),
        "other_bwrap_start": count_bwrap(),
    }


# ------------------------------------------------------------------------------ main


def bwrap_rate(seconds: float, run_one: Callable[[], None]) -> float:
    """Raw bwrap ``true`` runs per second with RATE_INFLIGHT in flight: the baseline of
    ``create_rate_per_s`` (each run is a whole sandbox lifetime, start to end)."""
    import threading

    done = 0
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            run_one()
            with lock:
                done += 1

    t = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(RATE_INFLIGHT)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return done / (time.perf_counter() - t)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from corral.runtime import seccomp
    from corral.runtime.engine import SANDBOX_HOST_UID, Engine

    sizes = Sizes.pick(args.quick, args.smoke)
    if args.density is not None:
        sizes = Sizes(**{**sizes.__dict__, "density": args.density})
    fig: dict[str, Any] = dict.fromkeys(FIGURES)
    notes: list[str] = []
    out: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "quick": args.quick, "host": host_facts(),
        "sizes": sizes.__dict__, "nofile": raise_nofile(),
        "targets": {k: {"op": op, "bound": b, "unit": u} for k, (op, b, u) in TARGETS.items()},
        "figures": fig, "notes": notes,
    }
    if out["host"]["other_bwrap_start"] or out["host"]["mounts_start"] > 100:
        notes.append(
            f"the host was not quiet: {out['host']['other_bwrap_start']} bwrap processes of "
            f"other sandboxes and {out['host']['mounts_start']} mounts at the start")
    state_dir = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    engine = await Engine.open(state_dir)
    try:
        image = engine.images.get(args.image)
        python = image.python or "/usr/bin/python3"
        bpf = seccomp.build_filter()

        def step(msg: str) -> None:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

        only = set(args.only or PHASES)
        if "baselines" in only:
            step(f"baselines (n={sizes.baseline})")
            fig["bare_exec_ms_p50"] = pct(
                timed_ms(lambda: bare_exec(["/bin/true"]), sizes.baseline), 50)
            fig["bare_python_ms_p50"] = pct(timed_ms(
                lambda: bare_exec([host_python(), "-c", "pass"]), sizes.exec_python), 50)
            fig["bwrap_true_ms_p50"] = pct(timed_ms(
                lambda: run_bwrap([], engine.bwrap, image.rootfs, engine.agent_path, bpf),
                sizes.baseline), 50)
            # The same bwrap, started the engine's way: by the agent's launcher, which sets
            # the sandbox's rlimit and drops to its host uid (no cgroups joined here).
            launch = [str(engine.agent_path), "launch", "--uid", str(SANDBOX_HOST_UID),
                      "--gid", str(SANDBOX_HOST_UID), "--nofile", "1024", "--"]
            with reachable(image.rootfs) as rootfs:
                fig["launch_bwrap_true_ms_p50"] = pct(timed_ms(
                    lambda: run_bwrap(launch, engine.bwrap, rootfs, engine.agent_path, bpf),
                    sizes.baseline), 50)
        if "create" in only:
            step(f"create->ready, sequential (n={sizes.create})")
            await phase_create(engine, sizes.create, fig)
        if "spaced" in only:
            step(f"create->ready after {SPACED_GAP_S * 1e3:g} ms idle (n={sizes.spaced})")
            await phase_create_spaced(engine, sizes.spaced, fig)
        if "exec" in only:
            step(f"exec RTT (n={sizes.exec_true}, python n={sizes.exec_python})")
            await phase_exec(engine, sizes, python, fig)
        if "cycle" in only:
            step(f"create+exec+destroy (n={sizes.cycle})")
            await phase_cycle(engine, sizes.cycle, fig)
        if "rate" in only:
            # The rate and its baseline alternate (bwrap, engine, bwrap), each a third of
            # the time: a neighbour's burst hits both; the baseline is their mean.
            step(f"create rate vs raw bwrap ({sizes.rate_s:g} s each, {RATE_INFLIGHT} in flight)")
            raw = [bwrap_rate(sizes.rate_s / 2, lambda: run_bwrap(
                [], engine.bwrap, image.rootfs, engine.agent_path, bpf))]
            await phase_rate(engine, sizes.rate_s, fig)
            raw.append(bwrap_rate(sizes.rate_s / 2, lambda: run_bwrap(
                [], engine.bwrap, image.rootfs, engine.agent_path, bpf)))
            fig["bwrap_rate_per_s"] = statistics.mean(raw)
        if sizes.density and "teardown" in only:
            step(f"density ({sizes.density} idle sandboxes, memory_mb={DENSITY_MEMORY_MB})")
            await phase_density(engine, sizes.density, fig, notes)
    finally:
        await engine.close()
        leftovers = mounts_under(str(state_dir)) + [
            f"cgroup process {p}" for p in pids_in_cgroup(engine.cgroup_parent)]
        if leftovers:
            notes.append(f"cleanup: left behind {leftovers[:5]}")
        else:
            remove_engine_cgroup(engine)
            shutil.rmtree(state_dir, ignore_errors=True)
    out["host"]["loadavg_end"] = os.getloadavg()[0]
    out["host"]["other_bwrap_end"] = count_bwrap()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (~20 s)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: proves the benchmark runs; the figures mean nothing")
    parser.add_argument("--json", metavar="OUT", help="also write the figures here as JSON")
    parser.add_argument("--image", default="python", help="image to start (default: python)")
    parser.add_argument("--density", type=int, metavar="N",
                        help="idle sandboxes for the density test (0 skips it)")
    parser.add_argument("--only", action="append", choices=PHASES, metavar="PHASE",
                        help="run only this phase (repeatable): " + ", ".join(PHASES))
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_engine: needs root (namespaces, cgroups, mounts)", file=sys.stderr)
        return 2
    out = asyncio.run(run(args))
    print(f"\ncorral engine benchmark ({'quick' if args.quick else 'full'}; "
          f"{out['host']['cpus']} CPUs, kernel {out['host']['kernel']}, "
          f"load {out['host']['loadavg_start']:.2f} -> {out['host']['loadavg_end']:.2f})")
    print_table(report(out["figures"]))
    for note in out["notes"]:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
