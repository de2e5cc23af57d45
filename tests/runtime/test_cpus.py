"""A sandbox's CPU count agrees with its ``cpus``: nproc, os.cpu_count(), sysconf and the
thread variables numpy/torch/OpenMP read (issue 25, item 8). Unit tests of the picker,
then real sandboxes."""

from __future__ import annotations

import asyncio
import json

import pytest

from corral.runtime.cpus import THREAD_VARIABLES, CpuPicker, host_cpus, thread_count, thread_env
from tests.conftest import requires_root


def test_thread_count_is_ceil_of_cpus_within_the_host():
    assert [thread_count(c, 8) for c in (0.01, 0.5, 1, 1.0000000001, 1.5, 2, 7.2, 64)] == [
        1, 1, 1, 1, 2, 2, 8, 8]
    env = thread_env(0.5, 64)
    assert set(env) == set(THREAD_VARIABLES) and set(env.values()) == {"1"}
    assert {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"} <= set(env)


def test_the_picker_spreads_sandboxes_and_takes_cpus_back():
    picker = CpuPicker([0, 1, 2, 3])
    a, b, c = picker.take(1), picker.take(0.5), picker.take(2)
    assert (a, b, c) == ((0,), (1,), (2, 3))
    assert picker.take(1) == (0,)  # all equally used: the lowest
    picker.give_back(b)
    assert picker.take(1) == (1,)
    assert picker.take(100) == (0, 1, 2, 3)  # never more than the host has
    picker.give_back((7,))  # not ours: ignored
    assert CpuPicker().cpus == host_cpus()


def test_the_picker_takes_a_preferred_set_only_when_it_is_as_free():
    picker = CpuPicker([0, 1, 2])
    assert picker.take(1, prefer=(2,)) == (2,)  # all free: a warm slot's guess is as good
    assert picker.take(1, prefer=(2,)) == (0,)  # 2 is busier now: the least used instead
    assert picker.take(2, prefer=(1, 2)) == (1, 2)  # as free as (0, 1): loads 0 and 1
    assert picker.peek(1) == picker.take(1) == (0,)  # peek counts nothing, take does
    assert picker.take(1, prefer=(7,)) == (1,)  # not ours: ignored


COUNTS = r"""
import json, os, subprocess

def widen():
    # sandbox code asks for every CPU of the host: where a cpuset confines the
    # sandbox, it keeps its own
    try:
        os.sched_setaffinity(0, range(1024))  # (its cpu_count shows only its own)
    except OSError as e:
        return e.errno
    return sorted(os.sched_getaffinity(0))

print(json.dumps({
    "nproc": int(subprocess.run(["nproc"], capture_output=True, text=True).stdout),
    "cpu_count": os.cpu_count(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "sysconf": os.sysconf("SC_NPROCESSORS_ONLN"),
    "sysconf_conf": os.sysconf("SC_NPROCESSORS_CONF"),
    "env": {k: v for k, v in os.environ.items() if k.endswith(("_THREADS", "PROCS", "CPU_COUNT"))},
    "widened": widen(),
}))
"""


def has_cpuset(engine) -> bool:
    """Whether the engine's cgroups have a cpuset controller (cgroup v1 here)."""
    return any((d / "cpuset.cpus").exists()
               for d in engine.cgroups._dirs(engine.cgroup_parent).values())


async def _counts(engine, sid, env=None):
    r = await engine.exec(sid, ["python3", "-c", COUNTS], env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@requires_root
async def test_a_sandbox_sees_ceil_cpus_cpus_everywhere(engine):
    host = len(host_cpus())
    for cpus in (0.5, 1, 2.0):
        sid = (await engine.create(cpus=cpus)).id
        got = await _counts(engine, sid)
        n = thread_count(cpus, host)
        assert (got["nproc"], got["cpu_count"], len(got["affinity"])) == (n, n, n), got
        assert got["sysconf"] == got["sysconf_conf"] == n, got
        assert got["env"] == dict.fromkeys(THREAD_VARIABLES, str(n)), got
        if has_cpuset(engine):
            assert got["widened"] == got["affinity"], got  # confined: it cannot widen it
        await engine.delete(sid)


@requires_root
async def test_sandboxes_are_spread_over_the_cpus_and_their_own_env_wins(engine):
    if len(host_cpus()) < 2:
        pytest.skip("needs two CPUs")
    a = (await engine.create(cpus=1)).id
    b = (await engine.create(cpus=1, env={"OMP_NUM_THREADS": "7"})).id
    got_a, got_b = await _counts(engine, a), await _counts(engine, b)
    assert got_a["affinity"] != got_b["affinity"], (got_a, got_b)
    assert got_b["env"]["OMP_NUM_THREADS"] == "7" and got_b["env"]["MKL_NUM_THREADS"] == "1"
    got = await _counts(engine, a, env={"OMP_NUM_THREADS": "3"})  # an exec's env too
    assert got["env"]["OMP_NUM_THREADS"] == "3"


@requires_root
async def test_warm_slots_hold_the_cpus_a_sandbox_would_get(engine):
    """A warm slot's cpuset holds the CPUs the picker would give a default-size
    sandbox when the slot was made; the picker counts sandboxes only (never slots), a
    sandbox takes the slot that holds what it is given, and is confined to it."""
    picker = engine.cpu_picker

    async def settled() -> None:
        for _ in range(600):  # refills run in the background
            if not engine._pool._spawning and engine._pool._ready:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the slot pool never settled")

    await settled()
    if has_cpuset(engine):
        for slot in engine._pool._ready:
            d = next(d for d in slot.cgroup._hierarchies() if (d / "cpuset.cpus").exists())
            assert (d / "cpuset.cpus").read_text().strip() == ",".join(map(str, slot.cpus))
    host = len(host_cpus())
    sizes = (1, 2.0, 0.5, 1)
    infos = [await engine.create(cpus=c) for c in sizes]
    assert sum(picker._load.values()) == sum(thread_count(c, host) for c in sizes)
    for info in infos:
        got = await _counts(engine, info.id)
        assert got["affinity"] == sorted(engine._live[info.id].cpus), got
        if has_cpuset(engine):
            assert got["widened"] == got["affinity"], got
        await engine.delete(info.id)
    assert sum(picker._load.values()) == 0
