"""Ray's own sandboxes (``ray.experimental.sandbox``, ray 2.60) as a baseline for
``bench_cluster.py``, on the same Ray cluster and in the same run as corral.

Two ways Ray offers them, both with the corral ``python`` image as a flat tar, an
explicit ``PATH`` and the same 128 MiB memory limit as corral's sandboxes:

- ``ray_sandbox_*``: the in-process runtime (``SandboxRuntime``, in the driver);
- ``ray_sandbox_actor_*``: ``ray.experimental.sandbox.create``, a Ray actor per sandbox
  (``cpu=0``, so the three one-CPU nodes can hold several), placed by Ray.

Per way: ``create_ready_ms`` (create until it runs; the EROFS image is built once
beforehand: ``ray_sandbox_image_build_ms``), ``exec_rtt_ms`` (``exec(["true"])``) and
``idle_pss_mb``: the proportional set size (``/proc/PID/smaps_rollup``) of each idle
sandbox's processes with several alive at once: the gVisor processes (``runsc`` run,
gofer and sandbox) and, for the actor form, the actor's worker process too.

Ray writes to fixed paths (``/tmp/ray/sandbox``, ``/tmp/runsc``) and can leave
``ray-sandbox-*`` cgroups behind: ``peers.ray_sandbox.RayLeftovers`` notes what was there
before and afterwards removes only what appeared since and is named after this run (its
sandboxes' ids, its image), and kills any runsc process of a sandbox this run made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from peers import descendants
from peers.ray_sandbox import PATH, RayLeftovers, flat_tar, missing_prerequisites

MEMORY = "128Mi"  # corral's sandboxes in bench_cluster.py get memory_mb=128
CREATE_TIMEOUT_S = 60
SETTLE_S = 1.0


def ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1000


def _pss_kb(pids: list[int]) -> int:
    from bench_engine import pss_kb

    return pss_kb(pids)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def cycles(n: int, create: Callable[[], tuple[Any, float]], exec_true: Callable[[Any], Any],
           delete: Callable[[Any], None]) -> tuple[list[float], list[float]]:
    """``n`` times: create (timed by ``create``), ``true`` once to warm, five ``true``
    timed, delete. The create times and the exec round trips."""
    creates, execs = [], []
    for _ in range(n):
        handle, took = create()
        creates.append(took)
        exec_true(handle)
        for _ in range(5):
            t = time.perf_counter()
            r = exec_true(handle)
            execs.append(ms_since(t))
            if r.exit_code != 0:
                raise RuntimeError(f"true failed in a Ray sandbox: {r!r}")
        delete(handle)
    return creates, execs


def in_process(tar: str, leftovers: RayLeftovers, n: int, idle: int) -> dict[str, Any]:
    """The in-process runtime, in this process: every runsc below it is a sandbox's."""
    from ray.experimental.sandbox.runtime import SandboxRuntime

    rt = SandboxRuntime()
    opts = {"image": tar, "env": {"PATH": PATH}, "memory": MEMORY,
            "timeout_seconds": CREATE_TIMEOUT_S}
    made: list[str] = []

    def create() -> tuple[str, float]:
        t = time.perf_counter()
        with leftovers.noting():
            sid = rt.create(**opts)
        took = ms_since(t)
        leftovers.ids.add(sid)
        made.append(sid)
        return sid, took

    def delete(sid: str) -> None:
        made.remove(sid)
        rt.delete(sid)

    res: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        rt.pull_image(tar, timeout_seconds=300)  # builds the EROFS image once
        res["ray_sandbox_image_build_ms"] = ms_since(t)
        creates, execs = cycles(n, create, lambda sid: rt.exec(sid, ["true"], timeout=30),
                                delete)
        res["ray_sandbox_create_ready_ms"] = _median(creates)
        res["ray_sandbox_exec_rtt_ms"] = _median(execs)
        runsc = os.path.realpath(shutil.which("runsc") or "runsc")

        def gvisor_pss() -> int:
            return _pss_kb([p for p in descendants() if _exe(p) == runsc])

        base = gvisor_pss()
        for _ in range(idle):
            create()
        time.sleep(SETTLE_S)
        res["ray_sandbox_idle_pss_mb"] = (gvisor_pss() - base) / idle / 1024
    finally:
        for sid in list(made):
            with contextlib.suppress(Exception):
                delete(sid)
    return res


def _exe(pid: int) -> str:
    try:
        return os.path.realpath(f"/proc/{pid}/exe")
    except OSError:
        return ""


def as_actors(ray: Any, tar: str, leftovers: RayLeftovers, n: int, idle: int) -> dict[str, Any]:
    """``ray.experimental.sandbox.create``: a Ray actor per sandbox, on the cluster."""
    from ray.experimental import sandbox as raysb

    alive: list[Any] = []

    def create() -> tuple[Any, float]:
        t = time.perf_counter()
        handle = raysb.create(image=tar, env={"PATH": PATH}, memory=MEMORY, cpu=0,
                              timeout_seconds=CREATE_TIMEOUT_S)
        alive.append(handle)
        with leftovers.noting():
            sid = ray.get(handle.get_instance_id.remote(), timeout=CREATE_TIMEOUT_S + 60)
        took = ms_since(t)
        leftovers.ids.add(sid)
        return handle, took

    def delete(handle: Any) -> None:
        alive.remove(handle)
        try:
            ray.get(handle.delete.remote(), timeout=60)
        finally:
            ray.kill(handle)

    res: dict[str, Any] = {}
    try:
        creates, execs = cycles(n, create,
                                lambda h: ray.get(h.exec.remote(["true"]), timeout=60), delete)
        res["ray_sandbox_actor_create_ready_ms"] = _median(creates)
        res["ray_sandbox_actor_exec_rtt_ms"] = _median(execs)
        handles = [create()[0] for _ in range(idle)]
        time.sleep(SETTLE_S)
        pids = ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles],
                       timeout=60)
        per = [_pss_kb([pid, *descendants(pid)]) / 1024 for pid in pids]
        res["ray_sandbox_actor_idle_pss_mb"] = _median(per)
    finally:
        for h in list(alive):
            with contextlib.suppress(Exception):
                delete(h)
    return res


def baseline(ray: Any, rootfs: Path, work: Path, n: int, idle: int) -> dict[str, Any]:
    """Both forms, or for each the precise reason it could not run. Cleans up after both."""
    problems = missing_prerequisites()
    if problems:
        return {"ray_sandbox": "not run: " + "; ".join(problems)}
    # a name of this run's own: Ray caches the built image under the tar's name
    tar = work / f"corral-bench-{os.getpid()}.tar"
    leftovers = RayLeftovers(tar.stem)
    res: dict[str, Any] = {}
    try:
        try:
            flat_tar(rootfs, tar)
        except RuntimeError as exc:
            return {"ray_sandbox": f"not run: {exc}"}
        for name, run in (("ray_sandbox", lambda: in_process(str(tar), leftovers, n, idle)),
                          ("ray_sandbox_actor",
                           lambda: as_actors(ray, str(tar), leftovers, n, idle))):
            try:
                res.update(run())
            except Exception as exc:  # say exactly what failed; the run goes on
                res[name] = f"failed: {type(exc).__name__}: {str(exc).strip()[-800:]}"
    finally:
        forced = leftovers.clean()
        tar.unlink(missing_ok=True)
    if forced:
        res["ray_sandbox_leftovers_removed"] = ", ".join(forced)
    return res
