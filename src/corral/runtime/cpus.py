"""The CPUs a sandbox runs on, and the thread counts its programs are told.

A sandbox of ``cpus=0.5`` gets half a CPU of time (a CFS quota, :mod:`.cgroups`), but
without more, ``nproc``, ``os.cpu_count()`` and every thread pool inside it would see
the whole host: numpy, torch or a build on a 64-core node start 64 threads that then
share half a core. So each sandbox also gets ``ceil(cpus)`` CPUs of its own (the
launcher sets its affinity and shows them in its ``/sys``; ``agent/launch.c``), picked
where the fewest of this engine's sandboxes run, and every command's environment says
how many threads to use (:func:`thread_env`; a sandbox's own ``env`` wins).

Where the host offers a cpuset controller the engine also confines the sandbox's cgroup
to those CPUs (:meth:`~corral.runtime.cgroups.CgroupDriver.set_cpus`): sandbox code
cannot move itself elsewhere. Without one the affinity is placement and an honest
count, not a limit (CPU time is bounded by the quota either way).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

__all__ = ["CpuPicker", "THREAD_VARIABLES", "cpu_list", "thread_count", "thread_env"]

THREAD_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS",
    "RAYON_NUM_THREADS", "GOMAXPROCS", "PYTHON_CPU_COUNT",
)
"""Read by OpenMP, MKL, OpenBLAS, BLIS, Accelerate, numexpr, numba, Rust's rayon, Go and
Python 3.13+ (``os.cpu_count()``): each set to the sandbox's :func:`thread_count`."""


def host_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity: a container's or a cpuset's)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def thread_count(cpus: float, available: int) -> int:
    """Threads for a sandbox of ``cpus``: ``ceil(cpus)``, at least 1, at most the host's."""
    return max(1, min(available, math.ceil(cpus - 1e-9)))


def thread_env(cpus: float, available: int) -> dict[str, str]:
    """The thread variables (:data:`THREAD_VARIABLES`) for a sandbox of ``cpus``."""
    n = str(thread_count(cpus, available))
    return dict.fromkeys(THREAD_VARIABLES, n)


def cpu_list(cpus: Sequence[int]) -> str:
    """``(0, 3)`` -> ``"0,3"``: the launcher's ``--cpus``."""
    return ",".join(str(c) for c in cpus)


class CpuPicker:
    """Hands each sandbox the CPUs where the fewest of this engine's sandboxes run."""

    def __init__(self, cpus: Sequence[int] | None = None) -> None:
        self.cpus = tuple(cpus) if cpus is not None else host_cpus()
        self._load = dict.fromkeys(self.cpus, 0)

    def peek(self, cpus: float) -> tuple[int, ...]:
        """What :meth:`take` would hand out now, not counted (a warm slot's guess)."""
        n = thread_count(cpus, len(self.cpus))
        return tuple(sorted(sorted(self.cpus, key=lambda c: (self._load[c], c))[:n]))

    def take(self, cpus: float, prefer: Sequence[int] = ()) -> tuple[int, ...]:
        """``ceil(cpus)`` CPUs, the least used first (ties: the lowest number, or
        ``prefer`` where it is as little used: a warm slot's cpuset holds it)."""
        chosen = self.peek(cpus)
        if (len(set(prefer)) == len(chosen) and all(c in self._load for c in prefer)
                and sorted(self._load[c] for c in set(prefer))
                == sorted(self._load[c] for c in chosen)):
            chosen = tuple(sorted(set(prefer)))
        for c in chosen:
            self._load[c] += 1
        return chosen

    def hold(self, running: Sequence[int]) -> tuple[int, ...]:
        """Count a sandbox that already runs on ``running`` (adopted after a restart:
        :mod:`corral.runtime.restore`); the CPUs of this picker's among them."""
        chosen = tuple(sorted(c for c in set(running) if c in self._load))
        for c in chosen:
            self._load[c] += 1
        return chosen

    def give_back(self, chosen: Sequence[int]) -> None:
        for c in chosen:
            if c in self._load and self._load[c] > 0:
                self._load[c] -= 1
