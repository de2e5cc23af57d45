"""Seeded CartPole-v1 episodes hosted in corral sandboxes, against the same episodes
in this process.

The sandboxes run the ``rl`` image when its gymnasium and numpy are the versions
installed here (``cartpole_image``); else the default image, and since sandboxes have
no network gymnasium and numpy come in as wheels: ``pip download`` on the host fetches
exactly the versions installed here (the ``bench`` extra pins them), they are uploaded
into each sandbox and installed offline into the sandbox user's site (``pip install
--user --no-index``). The setup (``cartpole_setup_s``) is not part of the episode time.
Then ``workers`` long-lived sandboxes (one per core) each run their share of the
episodes in one ``python3 cartpole_episodes.py FIRST COUNT``; ``cartpole_1000_s`` is
the wall time from dispatch to the last record, and ``cartpole_ratio`` is it over the
same episodes run in this process, one after another (``cartpole_inprocess_s``).
``cartpole_subprocess_s`` is the same split over ``workers`` plain host processes:
the sandboxes' cost with the parallelism factored out. Records (a digest of every
observation) must be equal in all three: ``cartpole_match``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workloads import cartpole_episodes

EPISODES, QUICK_EPISODES, SMOKE_EPISODES = 1000, 100, 4
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


async def _sandboxed(url: str, shares: list[tuple[int, int]], out: dict[str, Any]) -> list[list]:
    import corral

    script = Path(cartpole_episodes.__file__).read_bytes()
    async with corral.AsyncClient(url) as client, contextlib.AsyncExitStack() as stack:
        t = time.perf_counter()
        image = await _image(client)
        wheels: list[Path] = []
        if image is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-bench-wheels-"))
            wheels = download_wheels(Path(tmp))
        out["cartpole_image"] = image or "python (+ the host's wheels)"
        boxes = await asyncio.gather(*(corral.AsyncSandbox.create(client=client, image=image)
                                       for _ in shares))
        try:
            await asyncio.gather(*(_setup(sb, wheels, script) for sb in boxes))
            out["cartpole_setup_s"] = time.perf_counter() - t
            t = time.perf_counter()
            results = await asyncio.gather(*(
                sb.exec(["python3", SCRIPT, str(first), str(count)], timeout=RUN_TIMEOUT_S)
                for sb, (first, count) in zip(boxes, shares, strict=True)))
            out["cartpole_1000_s"] = time.perf_counter() - t
        finally:
            await asyncio.gather(*(sb.delete() for sb in boxes), return_exceptions=True)
    records = []
    for sb, r in zip(boxes, results, strict=True):
        if r.returncode != 0:
            raise RuntimeError(f"episodes failed in sandbox {sb.id}: {r.stderr[-500:]}")
        records += parse(r.stdout)
    return records


def _subprocesses(shares: list[tuple[int, int]]) -> tuple[float, list[list]]:
    script = cartpole_episodes.__file__
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, script, str(first), str(count)],
                              stdout=subprocess.PIPE, text=True) for first, count in shares]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
    elapsed = time.perf_counter() - t
    if any(p.returncode for p in procs):
        raise RuntimeError("episodes failed in a host subprocess")
    return elapsed, [rec for o in outs for rec in parse(o)]


def run(url: str, quick: bool, workers: int | None = None, *,
        smoke: bool = False) -> dict[str, Any]:
    """Run the workload against the daemon at ``url``; returns the JSON figures."""
    workers = workers or os.cpu_count() or 1
    n = SMOKE_EPISODES if smoke else QUICK_EPISODES if quick else EPISODES
    shares = split(0, n, workers)
    out: dict[str, Any] = {"cartpole_episodes": n, "cartpole_workers": len(shares),
                           "cartpole_wheels": wheel_pins()}
    # In-process first: a fresh interpreter's first import of gymnasium is part of it.
    t = time.perf_counter()
    inprocess = cartpole_episodes.run_episodes(0, n)
    out["cartpole_inprocess_s"] = time.perf_counter() - t
    out["cartpole_subprocess_s"], plain = _subprocesses(shares)
    boxed = asyncio.run(_sandboxed(url, shares, out))
    out["cartpole_ratio"] = out["cartpole_1000_s"] / out["cartpole_inprocess_s"]
    out["cartpole_subprocess_ratio"] = out["cartpole_1000_s"] / out["cartpole_subprocess_s"]
    out["cartpole_match"] = boxed == inprocess == plain
    out["cartpole_mean_return"] = sum(r[2] for r in inprocess) / n
    return out
