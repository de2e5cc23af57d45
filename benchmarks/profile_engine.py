"""Where the time of a sandbox's create and delete goes, step by step.

Run as root::

    python3 benchmarks/profile_engine.py [-n 100] [--idle 200] [--gap 0.05] [--smoke]
                                         [--json OUT]

It wraps the engine's steps (mount, cgroup, spawn, waiting for the agent's READY,
registry writes; and on delete: closing the channel, waiting for the exit, killing
and removing the cgroup, unmounting) with timers in this process only, by replacing
module attributes at run time: the engine's code is not changed. A step the engine
no longer has is reported as missing, not an error. Times are medians per sandbox;
nested steps are indented under the step that contains them.

With ``--idle N`` it first creates N idle sandboxes concurrently and keeps them alive
while it profiles (a host with many sandboxes), and at the end tears them down
concurrently, printing how much of that wall time the event loop spent blocked in
each synchronous step (which serialises the "concurrent" deletes). It also decomposes
"spawn -> READY" with raw launches of ``/bin/true`` (bwrap alone, through the agent's
launcher, with the sandbox's cgroups joined).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_engine import (  # noqa: E402
    bare_exec,
    pct,
    raise_nofile,
    reachable,
    remove_engine_cgroup,
    run_bwrap,
    timed_ms,
)


class Steps:
    """Durations of named steps, grouped per operation (one create or one delete)."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self.ops: list[dict[str, float]] = []
        self.blocking: dict[str, float] = defaultdict(float)  # summed, for the teardown
        self.calls: dict[str, int] = defaultdict(int)
        self.missing: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def begin(self) -> None:
        self.current = defaultdict(float)

    def end(self, total_s: float) -> None:
        assert self.current is not None
        self.current["total"] = total_s
        self.ops.append(dict(self.current))
        self.current = None

    def add(self, label: str, seconds: float) -> None:
        self.blocking[label] += seconds
        self.calls[label] += 1
        if self.current is not None:
            self.current[label] += seconds

    def mark(self, label: str, at: float) -> None:
        if self.current is not None:
            self.current.setdefault(label, at)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Time every call of ``owner.name`` (a function, coroutine function or class)."""
        orig = getattr(owner, name, None)
        if orig is None:
            self.missing.append(label)
            return
        steps = self
        if inspect.iscoroutinefunction(orig):
            @functools.wraps(orig)
            async def timed(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await orig(*a, **kw)
                finally:
                    steps.add(label, time.perf_counter() - t)
        else:
            @functools.wraps(orig)
            def timed(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return orig(*a, **kw)
                finally:
                    steps.add(label, time.perf_counter() - t)
        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, orig))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def medians(self, prefix: str) -> dict[str, float]:
        """Median ms per label over the operations with a ``prefix + "total"``."""
        ops = [op for op in self.ops if prefix + "total" in op]
        labels = {k for op in ops for k in op if k.startswith(prefix)}
        return {k: statistics.median(op.get(k, 0.0) for op in ops) * 1e3 for k in labels}


def instrument(steps: Steps) -> None:
    """Wrap the engine's steps. Labels use '/' for nesting."""
    from corral.runtime import cgroups, channel, engine, launcher, registry, rootfs, syscalls
    from corral.schema import SandboxSpec

    # create
    steps.wrap(SandboxSpec, "parse", "create/spec.parse")
    steps.wrap(engine.ImageStore, "get", "create/images.get")
    steps.wrap(registry.Registry, "insert", "create/registry.insert")
    steps.wrap(launcher.SlotPool, "take", "create/slot.take")
    steps.wrap(launcher.Slot, "launch", "create/slot.launch")
    steps.wrap(cgroups.CgroupDriver, "create", "create/cgroup.create")
    steps.wrap(cgroups.CgroupV1Driver, "_set_limits", "create/cgroup.create/set_limits")
    steps.wrap(cgroups.CgroupV2Driver, "_set_limits", "create/cgroup.create/set_limits")
    steps.wrap(engine.Engine, "_launch_args", "create/launch_args")
    steps.wrap(channel.AgentChannel, "start", "create/channel.start")
    steps.wrap(registry.Registry, "set_running", "create/registry.set_running")
    steps.wrap(syscalls, "process_start_time", "create/process_start_time")
    # delete
    steps.wrap(registry.Registry, "set_state", "delete/registry.set_state")
    steps.wrap(registry.Registry, "delete", "delete/registry.delete")
    steps.wrap(channel.AgentChannel, "close", "delete/channel.close")
    steps.wrap(engine, "_wait_exit", "delete/wait_exit")
    steps.wrap(cgroups.Cgroup, "remove", "delete/cgroup.remove")
    steps.wrap(cgroups.Cgroup, "kill_all", "delete/cgroup.remove/kill_all")
    steps.wrap(cgroups.CgroupV1, "freeze", "delete/cgroup.remove/kill_all/freeze")
    steps.wrap(cgroups.CgroupV1, "thaw", "delete/cgroup.remove/kill_all/thaw")
    steps.wrap(cgroups, "_rmdir", "delete/cgroup.remove/rmdir")
    steps.wrap(rootfs, "remove_dirs", "delete/remove_dirs")
    # Popen is a class: wrap it with a subclass so that isinstance checks still hold.
    orig_popen = subprocess.Popen

    class TimedPopen(orig_popen):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            t = time.perf_counter()
            super().__init__(*a, **kw)
            done = time.perf_counter()
            steps.add("create/Popen", done - t)
            steps.mark("@spawned", done)

    subprocess.Popen = TimedPopen  # type: ignore[misc]
    steps._undo.append(lambda: setattr(subprocess, "Popen", orig_popen))
    # The moment the agent's READY frame is dispatched.
    orig_dispatch = channel.AgentChannel._dispatch

    def dispatch(self: Any, msg: int, rid: int, fields: Any) -> None:
        if msg == channel.Msg.READY:
            steps.mark("@ready", time.perf_counter())
        orig_dispatch(self, msg, rid, fields)

    channel.AgentChannel._dispatch = dispatch
    steps._undo.append(lambda: setattr(channel.AgentChannel, "_dispatch", orig_dispatch))


def print_steps(title: str, med: dict[str, float], prefix: str) -> None:
    print(f"\n{title}")
    rows = sorted(k for k in med if k.startswith(prefix))
    for k in rows:
        depth = k.count("/") - 1
        print(f"  {'  ' * depth}{k.rsplit('/', 1)[-1]:<{34 - 2 * depth}} {med[k]:8.3f} ms")


def print_sums(steps: Steps, title: str, prefix: str) -> None:
    print(f"\n{title}; time summed over all calls:")
    for k in sorted(steps.blocking):
        if k.startswith(prefix):
            depth = k.count("/") - 1
            print(f"  {'  ' * depth}{k.rsplit('/', 1)[-1]:<{34 - 2 * depth}} "
                  f"{steps.blocking[k]:8.3f} s  ({steps.calls[k]} calls)")


async def profile_sequential(engine: Any, steps: Steps, n: int, gap: float) -> dict[str, float]:
    for _ in range(n):
        if gap:
            await asyncio.sleep(gap)
        steps.begin()
        t = time.perf_counter()
        info = await engine.create()
        done = time.perf_counter()
        steps.end(done - t)
        op = steps.ops[-1]
        spawned, ready = op.get("@spawned"), op.get("@ready")
        if spawned and ready:
            op["create/spawned->READY"] = ready - spawned
            op["create/READY->returned"] = done - ready
        op["create/total"] = op.pop("total")
        steps.begin()
        t = time.perf_counter()
        await engine.delete(info.id)
        steps.end(time.perf_counter() - t)
        steps.ops[-1]["delete/total"] = steps.ops[-1].pop("total")
    med = {**steps.medians("create/"), **steps.medians("delete/")}
    top = [k for k in med if k.startswith("create/") and k.count("/") == 1 and k != "create/total"]
    print_steps(f"create, sequential (median of {n}; {gap * 1e3:g} ms pause before each; "
                f"top-level steps add up to {sum(med[k] for k in top):.2f} of "
                f"{med['create/total']:.2f} ms)", med, "create/")
    print_steps("delete, sequential", med, "delete/")
    if steps.missing:
        print(f"  (steps not found in the engine: {', '.join(steps.missing)})")
    return med


def other_libc_rows(engine: Any, launch: list[str]) -> dict[str, Callable[[], Any]]:
    """The launcher's start built against the other libc (musl <-> glibc), next to the
    engine's own build: a static glibc start runs its CPUID probes (trapped in a VM)."""
    from corral.runtime import agentbuild

    def is_musl(libc: str | None) -> bool:
        found = agentbuild.compiler(libc)
        return found is not None and found[1] is agentbuild.MUSL_CFLAGS

    other = "glibc" if is_musl(None) else "musl"
    if other == "musl" and not is_musl("musl"):
        return {}  # no musl-gcc here
    path = str(agentbuild.ensure_agent(engine.layout, other))
    return {f"agent launch ({other} build) -- /bin/true":
            lambda: bare_exec([path, *launch[1:], "/bin/true"])}


def profile_launch_chain(engine: Any, n: int) -> None:
    """Decompose spawn -> READY with launches of /bin/true."""
    from corral.runtime import seccomp
    from corral.runtime.engine import SANDBOX_HOST_UID

    image = engine.images.get("python")
    bpf = seccomp.build_filter()
    group = engine.cgroups.create(f"{engine.cgroup_parent}/profile-launch",
                                  cpus=1.0, memory_mb=512, pids=256)
    try:
        launch = [str(engine.agent_path), "launch", "--uid", str(SANDBOX_HOST_UID),
                  "--gid", str(SANDBOX_HOST_UID), "--nofile", "1024", "--"]
        joined = [str(engine.agent_path), "launch"]
        for procs in group.procs_files():
            joined += ["--cgroup", procs]
        joined += launch[2:]
        rows = {
            "bare /bin/true (posix_spawn)": lambda: bare_exec(["/bin/true"]),
            "agent launch -- /bin/true": lambda: bare_exec(launch + ["/bin/true"]),
            **other_libc_rows(engine, launch),
            f"agent launch (join {len(group.procs_files())} cgroups) -- /bin/true":
                lambda: bare_exec(joined + ["/bin/true"]),
            "bwrap (as root) /bin/true": lambda: run_bwrap(
                [], engine.bwrap, image.rootfs, engine.agent_path, bpf),
            "agent launch -- bwrap /bin/true": lambda: run_bwrap(
                launch, engine.bwrap, reachable_root, engine.agent_path, bpf),
            "agent launch (cgroups) -- bwrap /bin/true": lambda: run_bwrap(
                joined, engine.bwrap, reachable_root, engine.agent_path, bpf),
        }
        with open("/proc/self/mountinfo") as f:
            mounts = sum(1 for _ in f)
        print(f"\nspawn -> exit of /bin/true, the engine's launch chain piece by piece "
              f"(back to back; {mounts} mounts on the host)")
        with reachable(image.rootfs) as reachable_root:
            for label, fn in rows.items():
                print(f"  {label:<48} {pct(timed_ms(fn, n), 50):8.3f} ms")
    finally:
        group.remove()


async def profile(args: argparse.Namespace) -> dict[str, float]:
    from corral.runtime.engine import Engine

    raise_nofile()
    state_dir = Path(tempfile.mkdtemp(prefix="corral-profile-"))
    os.chmod(state_dir, 0o711)  # sandboxes run as an unprivileged uid and must reach it
    engine = await Engine.open(state_dir)
    steps = Steps()
    idle: list[str] = []
    try:
        for _ in range(5):
            await engine.delete((await engine.create()).id)
        instrument(steps)
        if args.idle:
            t = time.perf_counter()
            for start in range(0, args.idle, 50):
                infos = await asyncio.gather(
                    *(engine.create(memory_mb=64) for _ in range(min(50, args.idle - start))))
                idle += [i.id for i in infos]
            wall = time.perf_counter() - t
            print_sums(steps, f"concurrent create of {len(idle)} idle sandboxes (batches of "
                       f"50): {wall:.3f} s wall", "create/")
            print("  (channel.start is awaited, so its sum overlaps the others; the other "
                  "steps block the event loop)")
            await asyncio.sleep(1.0)
            steps.blocking.clear()
            steps.calls.clear()
        med = await profile_sequential(engine, steps, args.n, args.gap)
        profile_launch_chain(engine, args.n)
        if idle:
            steps.blocking.clear()
            steps.calls.clear()
            t = time.perf_counter()
            await asyncio.gather(*(engine.delete(i) for i in idle))
            wall = time.perf_counter() - t
            print_sums(steps, f"concurrent teardown of {len(idle)}: {wall:.3f} s wall "
                       f"({wall / len(idle) * 1e3:.2f} ms per sandbox)", "delete/")
            print("  (channel.close and wait_exit are awaited, so their sums overlap; the "
                  "other steps block the event loop)")
            med["teardown_ms_per_sandbox"] = wall / len(idle) * 1e3
        return {f"profile_{k.replace('/', '_').replace(' ', '_')}_ms": v for k, v in med.items()}
    finally:
        steps.restore()
        await engine.close()
        remove_engine_cgroup(engine)
        shutil.rmtree(state_dir, ignore_errors=True)


def main() -> int:
    parser = bench_args.parser(__doc__)
    parser.add_argument("-n", type=int, default=None, help="sequential creates to time "
                        "(default 100; --quick 30, --smoke 2)")
    parser.add_argument("--idle", type=int, default=None, metavar="N",
                        help="idle sandboxes kept alive during the profile, then torn down "
                        "concurrently (0: none; default 200, --quick 50, --smoke 2)")
    parser.add_argument("--gap", type=float, default=0.0, metavar="S",
                        help="pause before each sequential create (try 0.05)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("profile_engine: needs root", file=sys.stderr)
        return 2
    args.n = args.n if args.n is not None else bench_args.pick(args, 100, 30, 2)
    args.idle = args.idle if args.idle is not None else bench_args.pick(args, 200, 50, 2)
    figures = asyncio.run(profile(args))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
