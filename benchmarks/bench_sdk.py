"""Exec round trip through the SDK and the daemon, against bare fork+exec.

    python3 benchmarks/bench_sdk.py [--quick] [--json OUT]

Starts a private daemon (``python -m corral.server``) on a temporary socket and state
directory, creates one sandbox and times ``sb.exec(["true"])`` with the blocking and the
asyncio SDK, next to a bare ``subprocess.run(["/bin/true"])`` measured in the same run.
Also times a full ``Sandbox.create`` → ``exec`` → ``delete`` through the SDK, in rounds
alternated with its baseline, raw bwrap's create+exec+destroy (``bench_engine``'s
``bwrap_true``: the engine's namespaces, flags and seccomp filter on the image's rootfs,
running ``/bin/true`` and exiting; also from a CPU cgroup placed as an engine's sandboxes
are, at their CPU share: ``*_in_sandbox_cpu_group``), and ``Sandbox.run_once`` (the
same three steps in one call: ``sdk_run_once_ms``), and an async ``spawn`` → ``wait`` → ``exec`` (a
process read to its exit, then the next call). Where uvloop
is installed, a second daemon runs on its loop (``CORRAL_DAEMON_LOOP=uvloop``) and the
exec round trips of the two daemons are timed in alternating rounds (``*_uvloop`` keys,
and their ratio to asyncio's loop). Needs root.
Targets (issues: daemon and SDK; performance): SDK exec round trip p50 ≤ 2.5 ms; SDK
create+exec+delete ≤ 2× raw bwrap's create+exec+destroy.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import bench_args  # noqa: E402  (a sibling script, not a package)

import corral


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def timed_async(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def start_daemon(base: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    sock = base / "corral.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.server", "--socket", str(sock),
         "--state-dir", str(base / "state"), *args],
        stdout=open(base / "daemon.log", "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(base / 'daemon.log').read_text()[-2000:]}")
        if sock.exists():
            try:
                with corral.Client(f"unix://{sock}") as c:
                    c.health()
                return proc
            except corral.CorralError:
                pass
        time.sleep(0.05)
    raise SystemExit("daemon did not start")


@contextlib.contextmanager
def private_daemon(prefix: str, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A daemon (with options ``args``, extra environment ``env``) on a temporary socket
    and state directory; yields its URL."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o711)  # sandboxes run as an unprivileged uid and must reach it
    proc = start_daemon(base, *args, env=env)
    try:
        yield f"unix://{base / 'corral.sock'}"
    finally:
        proc.send_signal(signal.SIGINT)  # stop; SIGTERM would hand its sandboxes over
        proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)


ROUNDS = 5  # the two loops' daemons take turns, so a change of the host's load hits both


def raw_bwrap_cycle() -> Callable[[], None]:
    """One raw bwrap create+exec+destroy of the default image (``bench_engine``'s
    ``bwrap_true`` baseline); a temporary engine finds bwrap, the image and the filter."""
    from bench_engine import run_bwrap

    from corral.runtime import seccomp
    from corral.runtime.engine import Engine
    from corral.schema import DEFAULT_IMAGE

    async def locate() -> tuple[str, Path, Path]:
        state = Path(tempfile.mkdtemp(prefix="corral-bench-sdk-bwrap-"))
        engine = await Engine.open(state)
        try:
            return engine.bwrap, engine.images.get(DEFAULT_IMAGE).rootfs, engine.agent_path
        finally:
            await engine.close()
            shutil.rmtree(state, ignore_errors=True)

    bwrap, rootfs, agent = asyncio.run(locate())
    bpf = seccomp.build_filter()
    return lambda: run_bwrap([], bwrap, rootfs, agent, bpf)


@contextlib.contextmanager
def in_sandbox_cpu_group() -> Iterator[bool]:
    """This process (and so what it starts) moved into a CPU cgroup placed as an
    engine's sandboxes are — at the top of the hierarchy, beside the engines'
    ``corral-<key>`` groups, their default weight (docs/performance.md, "CPU share") —
    and back after: raw bwrap there competes for the CPU as corral's sandboxes do.
    Yields False, changing nothing, where no such group can be made."""
    v1 = Path("/sys/fs/cgroup/cpu")
    root = v1 if v1.is_dir() else Path("/sys/fs/cgroup")
    group = root / f"corral-bench-sdk-raw-{os.getpid()}"
    try:
        here = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text()
                    .splitlines() if line.split(":")[1] in ("cpu", "cpu,cpuacct", ""))
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except (OSError, StopIteration):
        with contextlib.suppress(OSError):
            group.rmdir()
        yield False
        return
    try:
        yield True
    finally:
        (root / here.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()


def exec_rtts(url: str, n: int) -> tuple[list[float], list[float], list[float]]:
    """``n`` sync and ``n`` async ``exec(["true"])`` round trips on one sandbox each,
    and ``n`` async ``spawn(["true"])`` + ``wait()`` (then one exec: it finds the
    connection the output's reply used, or opens one)."""
    with corral.Client(url) as client:
        with corral.Sandbox.create(memory_mb=128, client=client) as sb:
            sb.exec(["true"])  # warm the connection
            sync = timed(lambda: sb.exec(["true"]), n)

    async def run_async() -> tuple[list[float], list[float]]:
        async with corral.AsyncClient(url) as ac:
            sb = await corral.AsyncSandbox.create(memory_mb=128, client=ac)
            try:
                await sb.exec(["true"])
                rtts = await timed_async(lambda: sb.exec(["true"]), n)

                async def spawn_wait_exec() -> None:
                    await (await sb.spawn(["true"])).wait()
                    await sb.exec(["true"])

                return rtts, await timed_async(spawn_wait_exec, n)
            finally:
                await sb.delete()

    return (sync, *asyncio.run(run_async()))


def main() -> int:
    ap = bench_args.parser(__doc__)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    n = bench_args.pick(args, 500, 100, 8)
    per_round = max(2, n // ROUNDS)
    loops = {"asyncio": {"CORRAL_DAEMON_LOOP": "asyncio"}}
    if importlib.util.find_spec("uvloop") is not None:
        loops["uvloop"] = {"CORRAL_DAEMON_LOOP": "uvloop"}
    res: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        urls = {loop: stack.enter_context(private_daemon(f"corral-bench-sdk-{loop}-", env=env))
                for loop, env in loops.items()}
        bare = timed(lambda: subprocess.run(["/bin/true"]), n)
        sync: dict[str, list[float]] = {loop: [] for loop in loops}
        async_rtt: dict[str, list[float]] = {loop: [] for loop in loops}
        spawns: list[float] = []
        for _ in range(ROUNDS):
            for loop, url in urls.items():
                s, a, w = exec_rtts(url, per_round)
                sync[loop] += s
                async_rtt[loop] += a
                if loop == "asyncio":
                    spawns += w
        url = urls["asyncio"]
        bwrap_cycle = raw_bwrap_cycle()
        full: list[float] = []
        raw: list[float] = []
        raw_grouped: list[float] = []
        once: list[float] = []
        with corral.Client(url) as client:
            def lifecycle() -> None:
                with corral.Sandbox.create(memory_mb=128, client=client) as s:
                    s.exec(["true"])

            def run_once() -> None:
                corral.Sandbox.run_once(["true"], memory_mb=128, client=client)

            lifecycle()  # warm: the image's dentries, the connection
            run_once()
            for _ in range(ROUNDS):  # alternated: a change of the load hits all three
                raw += timed(bwrap_cycle, max(4, n // 10 // ROUNDS))
                with in_sandbox_cpu_group() as grouped:
                    if grouped:
                        raw_grouped += timed(bwrap_cycle, max(4, n // 10 // ROUNDS))
                full += timed(lifecycle, max(4, n // 10 // ROUNDS))
                once += timed(run_once, max(4, n // 10 // ROUNDS))
        res = {
            "bare_exec_ms_p50": statistics.median(bare),
            "sdk_exec_rtt_ms_p50": statistics.median(sync["asyncio"]),
            "sdk_exec_rtt_ms_p95": pct(sync["asyncio"], 0.95),
            "sdk_async_exec_rtt_ms_p50": statistics.median(async_rtt["asyncio"]),
            "sdk_async_spawn_wait_exec_ms_p50": statistics.median(spawns),
            "sdk_create_exec_delete_ms_p50": statistics.median(full),
            "raw_bwrap_create_exec_destroy_ms_p50": statistics.median(raw),
            "sdk_run_once_ms_p50": statistics.median(once),
        }
        res["sdk_create_exec_delete_vs_raw_bwrap"] = (res["sdk_create_exec_delete_ms_p50"]
                                                      / res["raw_bwrap_create_exec_destroy_ms_p50"])
        res["sdk_run_once_vs_raw_bwrap"] = (res["sdk_run_once_ms_p50"]
                                            / res["raw_bwrap_create_exec_destroy_ms_p50"])
        if raw_grouped:  # the same, raw bwrap at the CPU share of corral's sandboxes
            res["raw_bwrap_in_sandbox_cpu_group_ms_p50"] = statistics.median(raw_grouped)
            res["sdk_create_exec_delete_vs_raw_bwrap_in_sandbox_cpu_group"] = (
                res["sdk_create_exec_delete_ms_p50"] / res["raw_bwrap_in_sandbox_cpu_group_ms_p50"])
        if "uvloop" in loops:
            res["sdk_exec_rtt_ms_p50_uvloop"] = statistics.median(sync["uvloop"])
            res["sdk_async_exec_rtt_ms_p50_uvloop"] = statistics.median(async_rtt["uvloop"])
    floor = res["bare_exec_ms_p50"]
    print(f"{'figure':34} {'value':>8}  {'target':>9}  vs bare fork+exec")
    targets = {"sdk_exec_rtt_ms_p50": 2.5}
    for key, value in res.items():
        if key.endswith("_vs_raw_bwrap"):
            print(f"{key:34} {value:8.2f}x (target <= 2x, same run)")
            continue
        if "_vs_raw_bwrap_" in key:
            print(f"{key:34} {value:8.2f}x (raw bwrap at the sandboxes' CPU share)")
            continue
        target = f"<= {targets[key]} ms" if key in targets else ""
        print(f"{key:34} {value:8.2f}  {target:>9}  {value / floor:5.1f}x")
    if "uvloop" in loops:
        res["sdk_exec_rtt_uvloop_ratio"] = (res["sdk_exec_rtt_ms_p50_uvloop"]
                                            / res["sdk_exec_rtt_ms_p50"])
        res["sdk_async_exec_rtt_uvloop_ratio"] = (res["sdk_async_exec_rtt_ms_p50_uvloop"]
                                                  / res["sdk_async_exec_rtt_ms_p50"])
        print(f"daemon on uvloop / on asyncio's loop, same run: sync exec "
              f"{res['sdk_exec_rtt_uvloop_ratio']:.2f}, async exec "
              f"{res['sdk_async_exec_rtt_uvloop_ratio']:.2f}")
    res["loadavg"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
