"""Live checkpoints: a Python process holding 50 MB, checkpointed and restored (as a host
process, and in a corral sandbox), against a cold start of the same program.

    python3 benchmarks/bench_live.py [--quick] [--smoke] [--json OUT]

CRIU is the one ``scripts/build_criu.sh`` caches (docs/live.md). Figures (medians):

In a checkpointable sandbox (``sandbox`` in the JSON), on a private engine:

- ``cold_ms`` (baseline): ``create`` + starting the program until it first counts;
- ``checkpoint_ms``: ``Engine.checkpoint`` (the sandbox frozen for CRIU's dump and the
  copy of its writable layer, then thawed);
- ``restore_ms``: ``create(snapshot=live)`` until the restored program counts on;
  ``restore_vs_cold`` their ratio;
- ``fork_ms``: ``fork(n, live=True)`` (one checkpoint, ``n`` restores at once) until
  every copy answers an exec; ``fork_per_copy_ms``; against ``fork_serial_ms``, the same
  checkpoint and ``n`` restores one after another (each until it answers an exec),
  ``fork_vs_serial`` their ratio;
- ``redump_ms`` / ``chain_restore_ms``: the restored copy checkpointed again, and that
  checkpoint restored until it counts on (a chain of forks, as a tree search makes);
- ``hibernate_ms`` / ``resume_ms``: ``hibernate`` of that copy (its memory freed), and
  ``resume`` until it counts on; ``resume_vs_cold``.

As a plain host process:

- ``checkpoint_ms``: ``criu dump`` of the process (it stops; its image is written to a
  tmpfs-backed directory when /dev/shm has room, else the state filesystem);
- ``restore_ms``: ``criu restore -d`` of that image until the restored process runs
  (it goes on counting from where it was: checked each round);
- ``cold_start_ms`` (baseline): a fresh ``python3`` that allocates the same heap and
  reports ready; ``restore_vs_cold`` is their ratio.

Needs root and the cached CRIU (it prints why it skips otherwise, and exits 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_args  # noqa: E402  (a sibling script, not a package)

from corral.runtime import criu
from corral.runtime.paths import default_cache_dir

PROGRAM = """
import os, sys, time
heap = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(heap), 4096):
    heap[i] = 1
out = sys.argv[2]
n = 0
print("ready", flush=True)
while True:
    n += 1
    with open(out + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(out + ".tmp", out)
    time.sleep(0.01)
"""


def _count(path: Path) -> int:
    for _ in range(500):
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.01)
    raise RuntimeError(f"no count in {path}")


def _start(mb: int, counter: Path) -> tuple[subprocess.Popen[str], float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(mb), str(counter)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, start_new_session=True,  # its own session: criu dumps it without --shell-job
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the benchmark process did not start")
    return proc, time.perf_counter() - t0


def _criu(binary: Path, *args: str) -> None:
    r = subprocess.run([str(binary), *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"criu {args[0]} failed: {r.stderr[-2000:]}")


def one_round(binary: Path, mb: int, work: Path) -> tuple[float, float, float]:
    counter = work / "count"
    counter.unlink(missing_ok=True)
    proc, cold = _start(mb, counter)
    images = work / "images"
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(mode=0o700)
    proc.stdout.close()  # type: ignore[union-attr]  # a pipe to us would be an external fd
    before = _count(counter)
    t0 = time.perf_counter()
    _criu(binary, "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log",
          "--ext-unix-sk", "--file-locks")
    dump = time.perf_counter() - t0
    proc.wait()
    t0 = time.perf_counter()
    # restored detached: it is re-parented to init, which reaps it once killed
    _criu(binary, "restore", "-d", "-D", str(images), "-o", "restore.log",
          "--inherit-fd", "fd[1]:" + _pipe_id(images))
    restore = time.perf_counter() - t0
    time.sleep(0.1)
    after = _count(counter)
    os.kill(proc.pid, 9)
    if after < before:
        raise RuntimeError(f"the restored process lost its count ({after} < {before})")
    return dump, restore, cold


def _pipe_id(images: Path) -> str:
    """The ``pipe:[ino]`` of the dumped stdout, for --inherit-fd (a fresh /dev/null)."""
    log = (images / "dump.log").read_text(errors="replace")
    for line in log.splitlines():
        if "pipe:[" in line:
            start = line.index("pipe:[")
            return line[start:line.index("]", start) + 1]
    return "pipe:[0]"


SANDBOX_PROGRAM = (
    "nohup python3 -c 'import time, sys\nb = bytearray({mb} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
    "i = 0\nwhile True:\n    i += 1\n    open(\"/tmp/count\", \"w\").write(str(i))\n"
    "    time.sleep(0.01)' >/dev/null 2>&1 &"
)


async def _counts(engine: Any, sid: str) -> int:
    for _ in range(2000):
        out = (await engine.exec(sid, ["cat", "/tmp/count"])).stdout.strip()
        if out:
            return int(out)
        await asyncio.sleep(0.005)
    raise RuntimeError(f"sandbox {sid} never counted")


async def sandbox_rounds(mb: int, rounds: int, n: int) -> dict[str, float]:
    """Cold create + warm-up, checkpoint, restore and fork of a checkpointable sandbox."""
    from corral.runtime.engine import Engine

    engine = await Engine.open(Path(tempfile.mkdtemp(prefix="corral-bench-live-")))
    spec = {"network": "none", "checkpointable": True, "memory_mb": 256 + 2 * mb}
    cold, ckpt, rest, fork, serial, redump, chain, hib, resume = ([] for _ in range(9))
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            sb = await engine.create(spec)
            await engine.exec(sb.id, ["sh", "-c", SANDBOX_PROGRAM.format(mb=mb)])
            saved = await _counts(engine, sb.id)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            snap = await engine.checkpoint(sb.id)
            ckpt.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            copy = await engine.create(snapshot=snap.id)
            if await _counts(engine, copy.id) < saved:
                raise RuntimeError("the restored program lost its count")
            rest.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            snap2 = await engine.checkpoint(copy.id)
            redump.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            grand = await engine.create(snapshot=snap2.id)
            await _counts(engine, grand.id)
            chain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await engine.hibernate(grand.id)
            hib.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await engine.resume(grand.id)
            await _counts(engine, grand.id)
            resume.append(time.perf_counter() - t0)
            await engine.delete(grand.id)
            await engine.delete_snapshot(snap2.id)
            t0 = time.perf_counter()
            copies = await engine.fork(sb.id, n, live=True)
            await asyncio.gather(*(engine.exec(c.id, ["true"]) for c in copies))
            fork.append(time.perf_counter() - t0)
            for c in copies:
                await engine.delete(c.id)
            # the baseline: the same checkpoint and n restores, one after another
            t0 = time.perf_counter()
            snap3 = await engine.checkpoint(sb.id)
            for _ in range(n):
                one = await engine.create(snapshot=snap3.id)
                await engine.exec(one.id, ["true"])
                copies.append(one)
            serial.append(time.perf_counter() - t0)
            await engine.delete_snapshot(snap3.id)
            for sid in (copy.id, *(c.id for c in copies[n:]), sb.id):
                await engine.delete(sid)
            await engine.delete_snapshot(snap.id)
    finally:
        await engine.close()
    med = {k: statistics.median(v) * 1000 for k, v in
           (("cold_ms", cold), ("checkpoint_ms", ckpt), ("restore_ms", rest), ("fork_ms", fork),
            ("fork_serial_ms", serial),
            ("redump_ms", redump), ("chain_restore_ms", chain), ("hibernate_ms", hib),
            ("resume_ms", resume))}
    med.update(restore_vs_cold=med["restore_ms"] / med["cold_ms"],
               resume_vs_cold=med["resume_ms"] / med["cold_ms"],
               fork_per_copy_ms=med["fork_ms"] / n, fork_copies=n,
               fork_vs_serial=med["fork_ms"] / med["fork_serial_ms"])
    return {k: round(v, 2) for k, v in med.items()}


def main() -> int:
    args = bench_args.parser(__doc__).parse_args()
    rounds = bench_args.pick(args, 7, 3, 1)
    mb = bench_args.pick(args, 50, 50, 8)
    figures: dict[str, object] = {"heap_mb": mb, "rounds": rounds}
    found = criu.find(default_cache_dir())
    if os.geteuid() != 0 or found is None:
        why = "not root" if os.geteuid() != 0 else f"no cached CRIU ({criu.BUILD})"
        print(f"skipped: {why}")
        figures["skipped"] = why
    else:
        base = Path("/dev/shm") if shutil.disk_usage("/dev/shm").free > 4 * (mb << 20) else None
        work = Path(tempfile.mkdtemp(prefix="corral-bench-live-", dir=base))
        try:
            results = [one_round(found.path, mb, work) for _ in range(rounds)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        dump, restore, cold = (statistics.median(x) * 1000 for x in zip(*results, strict=True))
        figures.update(criu=found.version_text, checkpoint_ms=round(dump, 1),
                       restore_ms=round(restore, 1), cold_start_ms=round(cold, 1),
                       restore_vs_cold=round(restore / cold, 2))
        print(f"CRIU {found.version_text}, {mb} MB heap, median of {rounds}: checkpoint "
              f"{dump:.0f} ms, restore {restore:.0f} ms; cold start {cold:.0f} ms "
              f"(restore/cold {restore / cold:.2f})")
        n = bench_args.pick(args, 8, 4, 2)
        sb = asyncio.run(sandbox_rounds(mb, rounds, n))
        figures["sandbox"] = sb
        print(f"sandbox, {mb} MB heap, median of {rounds}: cold create + warm-up "
              f"{sb['cold_ms']:.0f} ms; checkpoint {sb['checkpoint_ms']:.0f} ms, restore "
              f"{sb['restore_ms']:.0f} ms (restore/cold {sb['restore_vs_cold']:.2f}); fork into "
              f"{n} {sb['fork_ms']:.0f} ms ({sb['fork_per_copy_ms']:.0f} ms a copy; one checkpoint "
              f"and {n} restores one after another {sb['fork_serial_ms']:.0f} ms, fork/serial "
              f"{sb['fork_vs_serial']:.2f}); copy "
              f"checkpointed again {sb['redump_ms']:.0f} ms, restored {sb['chain_restore_ms']:.0f}"
              f" ms; hibernate {sb['hibernate_ms']:.0f} ms, resume {sb['resume_ms']:.0f} ms "
              f"(resume/cold {sb['resume_vs_cold']:.2f})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
