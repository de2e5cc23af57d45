"""Seeded CartPole-v1 episodes hosted in corral sandboxes, against the same episodes
in this process.

The sandboxes run the ``rl`` image when its gymnasium and numpy are the versions
installed here (``cartpole_image``); else the default image, and since sandboxes have
no network gymnasium and numpy come in as wheels: ``pip download`` on the host fetches
exactly the versions installed here (the ``bench`` extra pins them), they are uploaded
into each sandbox and installed offline into the sandbox user's site (``pip install
--user --no-index``). The setup (``cartpole_setup_s``) is not part of the episode time.
Then ``workers`` long-lived sandboxes (one per core) each run their share of the
episodes, in ``rounds`` rounds (3; quick and smoke 1) whose order alternates, so a
change of the host's load hits every way alike; each figure is the median over rounds:

- ``cartpole_1000_s``: **pre-started episode servers**. Before the clock starts (as the
  sandboxes' create is), each sandbox starts ``cartpole_episodes.py serve``, which
  imports gymnasium, makes the env and says ``READY``; the clock runs from the request
  (``FIRST COUNT`` on its stdin) to the last record. The server answers that one
  request and exits; the next round starts new ones. ``cartpole_prestart_s`` is how
  long the servers took to get ready (not in the figure).
- ``cartpole_cold_s``: one ``python3 cartpole_episodes.py FIRST COUNT`` per sandbox
  (what ``cartpole_1000_s`` measured before): the interpreter's start and gymnasium's
  import in the figure.
- ``cartpole_inprocess_s``: the same episodes one after another in a fresh host
  interpreter, gymnasium's first import included; ``cartpole_inprocess_warm_s`` in
  that interpreter again, gymnasium imported already (a new env made);
  ``cartpole_subprocess_s``: split over ``workers`` plain host processes (the
  sandboxes' cost with the parallelism factored out).
- ``cartpole_ratio`` = ``cartpole_1000_s`` / ``cartpole_inprocess_s``;
  ``cartpole_warm_ratio`` the same over the warm in-process time; ``cartpole_cold_ratio``
  ``cartpole_cold_s`` over ``cartpole_inprocess_s``; ``cartpole_subprocess_ratio``
  ``cartpole_1000_s`` over ``cartpole_subprocess_s``.
- ``cartpole_own_s``: ``cartpole_own_episodes`` episodes (1000; quick 40, smoke 2),
  **each in a sandbox of its own** (create from the image, one ``python3
  cartpole_episodes.py SEED 1``, delete), ``2 * workers`` at a time, once (last);
  ``cartpole_own_ratio`` is it over the in-process time of as many episodes
  (``cartpole_inprocess_s`` scaled by episodes; ``--own 0`` skips it).
  ``cartpole_own_prestarted_s`` / ``_ratio``: the same episodes, each sandbox restored
  from a live snapshot of one whose episode server is at ``READY`` (what
  ``corral.rl.evaluate``'s ``prestart`` does; the snapshot's making included); absent
  where the host has no CRIU.

CPU, which the host's load moves much less than wall time (a loaded host also queues
the sandboxes in corral's CPU group, which host processes are not in):
``cartpole_inprocess_cpu_s`` (the fresh interpreter's CPU for the cold run, its start
included), ``cartpole_cold_cpu_s`` / ``cartpole_prestarted_cpu_s`` (the episode
processes' CPU, summed over sandboxes, as they report it; a pre-started server's
includes its start and import, done before the clock; ``cartpole_request_cpu_s`` only
what it spent after ``READY``), and their ``_cpu_ratio`` to the in-process one.

Records (a digest of every observation) must be equal in every way: ``cartpole_match``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workloads import cartpole_episodes

EPISODES, QUICK_EPISODES, SMOKE_EPISODES = 1000, 100, 4
QUICK_OWN, SMOKE_OWN = 40, 2
ROUNDS = 3
IMAGE = "rl"  # gymnasium and numpy already there: no wheels when their versions are the host's
VERSIONS = "import gymnasium, numpy; print(gymnasium.__version__, numpy.__version__)"
WHEELS_DIR = "/tmp/wheels"
SCRIPT = "/workspace/cartpole_episodes.py"
SETUP_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 600.0


def wheel_pins() -> list[str]:
    """``name==version`` for gymnasium and what it needs, as installed on the host."""
    try:
        pins = [f"gymnasium=={importlib.metadata.version('gymnasium')}"]
        requires = importlib.metadata.requires("gymnasium") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError("gymnasium is not installed: .venv/bin/pip install -e .[bench]"
                           ) from exc
    for req in requires:
        if ";" in req:  # an extra or a marker: not needed by CartPole
            continue
        name = re.split(r"[<>=!~ \[(]", req, maxsplit=1)[0]
        pins.append(f"{name}=={importlib.metadata.version(name)}")
    return pins


def download_wheels(dest: Path) -> list[Path]:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "-d", str(dest), *wheel_pins()], capture_output=True, text=True, timeout=600)
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        raise RuntimeError(f"pip download failed: {r.stderr.strip()[-500:]}")
    return wheels


def split(first: int, total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous (first_seed, count) shares of ``total`` seeds, as even as possible."""
    out, start = [], first
    for i in range(parts):
        count = total // parts + (1 if i < total % parts else 0)
        if count:
            out.append((start, count))
        start += count
    return out


def parse(stdout: str) -> list[list]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def host_versions() -> str:
    """gymnasium's and numpy's versions here, as :data:`VERSIONS` prints them."""
    return " ".join(importlib.metadata.version(n) for n in ("gymnasium", "numpy"))


async def _setup(sb: Any, wheels: list[Path], script: bytes) -> None:
    await sb.files.write(SCRIPT, script)
    if not wheels:  # the image has the host's versions
        return
    for w in wheels:
        await sb.files.write(f"{WHEELS_DIR}/{w.name}", w.read_bytes())
    r = await sb.exec(
        ["python3", "-m", "pip", "install", "-q", "--user", "--no-index",
         "--break-system-packages", "--find-links", WHEELS_DIR, "gymnasium", "numpy"],
        timeout=SETUP_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"pip install in sandbox {sb.id} failed: {r.stderr[-500:]}")


async def _image(client: Any) -> str | None:
    """:data:`IMAGE` if it holds the host's gymnasium and numpy, else None (then the
    default image, with the host's wheels installed in each sandbox)."""
    import corral

    try:
        async with await corral.AsyncSandbox.create(client=client, image=IMAGE) as sb:
            r = await sb.exec(["python3", "-c", VERSIONS], timeout=SETUP_TIMEOUT_S)
    except corral.errors.ImageNotFound:
        return None
    return IMAGE if r.returncode == 0 and r.stdout.strip() == host_versions() else None


async def _ready_servers(boxes: list[Any]) -> list[Any]:
    """A pre-started episode server per sandbox, each at ``READY``."""
    procs = await asyncio.gather(*(sb.spawn(["python3", SCRIPT, "serve"], timeout=RUN_TIMEOUT_S)
                                   for sb in boxes))
    for sb, proc, line in zip(boxes, procs, await asyncio.gather(
            *(p.exchange(b"", timeout=SETUP_TIMEOUT_S) for p in procs)), strict=True):
        if line.strip() != "READY":
            raise RuntimeError(f"the episode server in sandbox {sb.id} said {line!r}: "
                               f"{(await proc.wait()).stderr[-500:]}")
    return procs


async def _served(procs: list[Any], shares: list[tuple[int, int]]) -> tuple[float, list[Any]]:
    """Seconds from the requests to the last record, and every server's result."""
    t = time.perf_counter()
    await asyncio.gather(*(p.write(f"{first} {count}\n") for p, (first, count)
                           in zip(procs, shares, strict=True)))
    results = await asyncio.gather(*(p.wait(timeout=RUN_TIMEOUT_S) for p in procs))
    return time.perf_counter() - t, results


async def _cold(boxes: list[Any], shares: list[tuple[int, int]]) -> tuple[float, list[Any]]:
    t = time.perf_counter()
    results = await asyncio.gather(*(
        sb.exec(["python3", SCRIPT, str(first), str(count)], timeout=RUN_TIMEOUT_S)
        for sb, (first, count) in zip(boxes, shares, strict=True)))
    return time.perf_counter() - t, results


def _records(boxes: list[Any], results: list[Any]) -> list[list]:
    records = []
    for sb, r in zip(boxes, results, strict=True):
        if r.returncode != 0:
            raise RuntimeError(f"episodes failed in sandbox {sb.id}: {r.stderr[-500:]}")
        records += parse(r.stdout)
    return records


def _cpu(results: list[Any], after_ready: bool = False) -> float:
    """CPU seconds the episode processes said they used (their last stderr line); with
    ``after_ready``, only after they said READY (what the request cost)."""
    said = [json.loads(r.stderr.strip().splitlines()[-1]) for r in results]
    return sum(d["cpu_s"] - (d["ready_cpu_s"] if after_ready else 0) for d in said)


class _Sandboxes:
    """The workload's sandboxes (made once), and what each way of running gave."""

    def __init__(self, url: str, shares: list[tuple[int, int]], out: dict[str, Any]) -> None:
        self.url, self.shares, self.out = url, shares, out
        self.times: dict[str, list[float]] = {"cold": [], "prestarted": [], "prestart": [],
                                              "cold_cpu": [], "prestarted_cpu": [],
                                              "request_cpu": []}
        self.records: dict[str, list[list]] = {}

    async def setup(self, stack: contextlib.AsyncExitStack) -> None:
        import corral

        script = Path(cartpole_episodes.__file__).read_bytes()
        self.client = await stack.enter_async_context(corral.AsyncClient(self.url))
        t = time.perf_counter()
        self.image = await _image(self.client)
        self.wheels: list[Path] = []
        if self.image is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-bench-wheels-"))
            self.wheels = download_wheels(Path(tmp))
        self.out["cartpole_image"] = self.image or "python (+ the host's wheels)"
        self.boxes = await asyncio.gather(*(
            corral.AsyncSandbox.create(client=self.client, image=self.image)
            for _ in self.shares))
        stack.push_async_callback(self._delete)
        await asyncio.gather(*(_setup(sb, self.wheels, script) for sb in self.boxes))
        self.out["cartpole_setup_s"] = time.perf_counter() - t

    async def _delete(self) -> None:
        await asyncio.gather(*(sb.delete() for sb in self.boxes), return_exceptions=True)

    async def cold(self) -> None:
        took, results = await _cold(self.boxes, self.shares)
        self.times["cold"].append(took)
        self.times["cold_cpu"].append(_cpu(results))
        self.records["cold"] = _records(self.boxes, results)

    async def prestarted(self) -> None:
        t = time.perf_counter()
        procs = await _ready_servers(self.boxes)
        self.times["prestart"].append(time.perf_counter() - t)
        took, results = await _served(procs, self.shares)
        self.times["prestarted"].append(took)
        self.times["prestarted_cpu"].append(_cpu(results))
        self.times["request_cpu"].append(_cpu(results, after_ready=True))
        self.records["prestarted"] = _records(self.boxes, results)

    async def own(self, count: int, concurrency: int) -> tuple[float, list[list]]:
        """``count`` episodes, each in a new sandbox of its own."""
        import corral

        script = Path(cartpole_episodes.__file__).read_bytes()
        gate = asyncio.Semaphore(concurrency)

        async def one(seed: int) -> list[list]:
            async with gate:
                async with await corral.AsyncSandbox.create(
                        client=self.client, image=self.image) as sb:
                    await _setup(sb, self.wheels, script)
                    r = await sb.exec(["python3", SCRIPT, str(seed), "1"], timeout=RUN_TIMEOUT_S)
                    return _records([sb], [r])

        t = time.perf_counter()
        parts = await asyncio.gather(*(one(seed) for seed in range(count)))
        return time.perf_counter() - t, [rec for part in parts for rec in part]

    async def own_live(self, count: int, concurrency: int) -> tuple[float, list[list]] | None:
        """``count`` episodes, each in a new sandbox of its own restored from a live
        snapshot of one whose episode server is at READY (what ``evaluate``'s
        ``prestart`` does); the snapshot's making is in the figure. None without CRIU."""
        import corral

        script = Path(cartpole_episodes.__file__).read_bytes()
        gate = asyncio.Semaphore(concurrency)
        t = time.perf_counter()
        async with await corral.AsyncSandbox.create(
                client=self.client, image=self.image, checkpointable=True) as base:
            await _setup(base, self.wheels, script)
            (server,) = await _ready_servers([base])
            try:
                snap = await base.checkpoint()
            except corral.errors.Unsupported:
                return None

        async def one(seed: int) -> list[list]:
            async with gate:
                async with await corral.AsyncSandbox.create(client=self.client,
                                                            snapshot=snap) as sb:
                    proc = await sb.process(server.id)
                    await proc.write(f"{seed} 1\n")
                    return _records([sb], [await proc.wait(timeout=RUN_TIMEOUT_S)])

        try:
            parts = await asyncio.gather(*(one(seed) for seed in range(count)))
        finally:
            await snap.delete()
        return time.perf_counter() - t, [rec for part in parts for rec in part]


def _inprocess(n: int) -> tuple[float, float, list[list], float]:
    """(cold s, warm s, records, cold CPU s: the interpreter's start included) of ``n``
    episodes in a fresh host interpreter."""
    code = ("import json, sys, time; sys.path.insert(0, sys.argv[1]); "
            "import cartpole_episodes as c; t = time.perf_counter(); "
            "r = c.run_episodes(0, int(sys.argv[2])); cold = time.perf_counter() - t; "
            "cpu = c.cpu_s(); t = time.perf_counter(); c.run_episodes(0, int(sys.argv[2])); "
            "print(json.dumps([cold, time.perf_counter() - t, r, cpu]))")
    r = subprocess.run([sys.executable, "-c", code, str(Path(cartpole_episodes.__file__).parent),
                        str(n)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=True)
    cold, warm, records, cpu = json.loads(r.stdout)
    return cold, warm, records, cpu


def _subprocesses(shares: list[tuple[int, int]]) -> tuple[float, list[list]]:
    script = cartpole_episodes.__file__
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, script, str(first), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for first, count in shares]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
    elapsed = time.perf_counter() - t
    if any(p.returncode for p in procs):
        raise RuntimeError("episodes failed in a host subprocess")
    return elapsed, [rec for o in outs for rec in parse(o)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def run(url: str, quick: bool, workers: int | None = None, *,
        smoke: bool = False, rounds: int | None = None, own: int | None = None) -> dict[str, Any]:
    """Run the workload against the daemon at ``url``; returns the JSON figures."""
    workers = workers or os.cpu_count() or 1
    n = SMOKE_EPISODES if smoke else QUICK_EPISODES if quick else EPISODES
    rounds = rounds or (1 if quick or smoke else ROUNDS)
    own = (SMOKE_OWN if smoke else QUICK_OWN if quick else EPISODES) if own is None else own
    shares = split(0, n, workers)
    out: dict[str, Any] = {"cartpole_episodes": n, "cartpole_workers": len(shares),
                           "cartpole_wheels": wheel_pins(), "cartpole_rounds": rounds,
                           "cartpole_load": os.getloadavg()[0]}
    host: dict[str, list[Any]] = {"inprocess": [], "warm": [], "subprocess": [],
                                  "inprocess_cpu": []}

    async def go() -> list[list]:
        async with contextlib.AsyncExitStack() as stack:
            boxes = _Sandboxes(url, shares, out)
            await boxes.setup(stack)
            ways = ["inprocess", "subprocess", "cold", "prestarted"]
            for i in range(rounds):
                for way in ways if i % 2 == 0 else ways[::-1]:
                    if way == "inprocess":
                        cold, warm, host["records"], cpu = _inprocess(n)
                        host["inprocess"].append(cold)
                        host["inprocess_cpu"].append(cpu)
                        host["warm"].append(warm)
                    elif way == "subprocess":
                        took, host["plain"] = _subprocesses(shares)
                        host["subprocess"].append(took)
                    else:
                        await getattr(boxes, way)()
            for key in ("prestart", "cold", "cold_cpu", "prestarted_cpu", "request_cpu"):
                out[f"cartpole_{key}_s"] = _median(boxes.times[key])
            out["cartpole_1000_s"] = _median(boxes.times["prestarted"])
            out["cartpole_rounds_s"] = {k: [round(x, 4) for x in v] for k, v in
                                        {**boxes.times, **host}.items()
                                        if k not in ("records", "plain")}
            if own:
                out["cartpole_own_episodes"] = own
                out["cartpole_own_s"], own_records = await boxes.own(own, 2 * len(shares))
                live = await boxes.own_live(own, 2 * len(shares))
                if live is not None:
                    out["cartpole_own_prestarted_s"], live_records = live
                    own_records += live_records
                if own_records != host["records"][:own] * (1 if live is None else 2):
                    out["cartpole_own_match"] = False
            return boxes.records["cold"] if boxes.records["cold"] == boxes.records[
                "prestarted"] else []

    boxed = asyncio.run(go())
    out["cartpole_inprocess_s"] = _median(host["inprocess"])
    out["cartpole_inprocess_warm_s"] = _median(host["warm"])
    out["cartpole_subprocess_s"] = _median(host["subprocess"])
    out["cartpole_inprocess_cpu_s"] = _median(host["inprocess_cpu"])
    for way in ("cold", "prestarted", "request"):  # CPU: what the host's load moves least
        out[f"cartpole_{way}_cpu_ratio"] = (out[f"cartpole_{way}_cpu_s"]
                                            / out["cartpole_inprocess_cpu_s"])
    out["cartpole_ratio"] = out["cartpole_1000_s"] / out["cartpole_inprocess_s"]
    out["cartpole_warm_ratio"] = out["cartpole_1000_s"] / out["cartpole_inprocess_warm_s"]
    out["cartpole_cold_ratio"] = out["cartpole_cold_s"] / out["cartpole_inprocess_s"]
    out["cartpole_subprocess_ratio"] = out["cartpole_1000_s"] / out["cartpole_subprocess_s"]
    if own:
        share = out["cartpole_inprocess_s"] * own / n
        out["cartpole_own_ratio"] = out["cartpole_own_s"] / share
        if "cartpole_own_prestarted_s" in out:
            out["cartpole_own_prestarted_ratio"] = out["cartpole_own_prestarted_s"] / share
    out["cartpole_match"] = (boxed == host["records"] == host["plain"]
                             and out.pop("cartpole_own_match", True))
    out["cartpole_mean_return"] = sum(r[2] for r in host["records"]) / n
    out["cartpole_load_after"] = os.getloadavg()[0]
    return out


if __name__ == "__main__":  # python3 benchmarks/workloads/cartpole.py URL [--quick] [--own N]
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--own", type=int)
    a = ap.parse_args()
    print(json.dumps(run(a.url, a.quick, rounds=a.rounds, own=a.own), indent=1))
