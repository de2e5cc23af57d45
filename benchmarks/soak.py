"""Soak: many sandboxes doing round trips for minutes; does the daemon stay flat?

    python3 benchmarks/soak.py [--sandboxes 200] [--minutes 10] [--sample 10] [--smoke]
                               [--json OUT]

Starts a private daemon (``python -m corral.server``) on a temporary socket and state
directory and gives each of ``--sandboxes`` sandboxes one loop, run until ``--minutes``
are up: an exec that echoes a unique token (the reply must be that token) and a file
written and read back (the bytes must be the same, a new size and content each time).
Every ``--sample`` seconds it reads the daemon's resident memory, open descriptors and
threads from ``/proc``. It reports them over time, their growth from the first sample
after the sandboxes started to the last (and the least-squares slope per minute), and
how many results were lost (a request that failed) or wrong. Needs root.

Like every benchmark it never fails on time or on a figure: the exit status is non-zero
only when a result was lost or wrong. Not part of ``make bench`` (it runs for minutes);
run it on demand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import start_daemon  # noqa: E402

import corral  # noqa: E402

MAX_FILE = 64 << 10
MAX_ROUNDS = 10_000_000  # per sandbox: the deadline ends a loop long before
SETTLE_S = 2.0  # after the client closed its connections, before the last sample


@dataclass
class Counts:
    rounds: int = 0
    lost: int = 0  # a request that raised
    wrong: int = 0  # an answer that was not what was sent
    errors: list[str] = field(default_factory=list)

    def fail(self, kind: str, what: str) -> None:
        if kind == "lost":
            self.lost += 1
        else:
            self.wrong += 1
        if len(self.errors) < 20:
            self.errors.append(f"{kind}: {what}")


def sample(pid: int, started: float) -> dict:
    """The daemon's resident memory (MiB), descriptors and threads now."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return {
        "t_s": round(time.monotonic() - started, 1),
        "rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 1),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
    }


async def worker(i: int, sb: corral.AsyncSandbox, deadline: float, counts: Counts) -> None:
    rng = random.Random(i)
    path = f"/tmp/soak-{i}"
    for _ in range(MAX_ROUNDS):
        if time.monotonic() >= deadline:
            return
        token = secrets.token_hex(8)
        data = rng.randbytes(rng.randrange(1, MAX_FILE))
        try:
            out = await sb.exec(["echo", token], timeout=30)
            if out.stdout != token + "\n" or out.returncode != 0:
                counts.fail("wrong", f"{sb.id} exec: {out.stdout[:60]!r} for {token}")
            await sb.files.write(path, data)
            back = await sb.files.read(path)
            if back != data:
                counts.fail("wrong", f"{sb.id} file: {len(back)} bytes back for {len(data)}")
        except corral.CorralError as exc:
            counts.fail("lost", f"{sb.id}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.1)
        counts.rounds += 1


def slope_per_min(points: list[dict], key: str) -> float:
    if len(points) < 2:
        return 0.0
    xs = [p["t_s"] / 60 for p in points]
    ys = [p[key] for p in points]
    return round(statistics.linear_regression(xs, ys).slope, 3)


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict:
    counts = Counts()
    samples: list[dict] = []
    started = time.monotonic()
    async with corral.AsyncClient(url, timeout=300) as client:
        samples.append(sample(pid, started))
        sandboxes = await asyncio.gather(*(
            corral.AsyncSandbox.create(memory_mb=64, tags=["soak"], timeout=args.minutes * 60 + 600,
                                       client=client)
            for _ in range(args.sandboxes)))
        created = sample(pid, started)
        samples.append(created)
        deadline = time.monotonic() + args.minutes * 60
        work = asyncio.gather(*(worker(i, sb, deadline, counts)
                                for i, sb in enumerate(sandboxes)))
        while not work.done():  # bounded by the deadline: the workers stop at it
            await asyncio.wait([work], timeout=args.sample)
            samples.append(sample(pid, started))
            s = samples[-1]
            print(f"  t={s['t_s']:7.1f}s  rss {s['rss_mib']:7.1f} MiB  fds {s['fds']:5d}  "
                  f"threads {s['threads']:3d}  rounds {counts.rounds}  lost {counts.lost}  "
                  f"wrong {counts.wrong}", flush=True)
        await work
        await asyncio.gather(*(sb.delete() for sb in sandboxes))
    # The client's connections are closed now: what is left open is the daemon's own.
    await asyncio.sleep(SETTLE_S)
    samples.append(sample(pid, started))
    run = [s for s in samples if s["t_s"] >= created["t_s"]][:-1]  # before the deletes
    first, last = run[0], run[-1]
    return {
        "sandboxes": args.sandboxes, "minutes": args.minutes,
        "rounds": counts.rounds, "round_trips": counts.rounds * 2,
        "lost": counts.lost, "wrong": counts.wrong, "errors": counts.errors,
        "rss_mib": {"start": samples[0]["rss_mib"], "first": first["rss_mib"],
                    "last": last["rss_mib"], "max": max(s["rss_mib"] for s in run),
                    "slope_per_min": slope_per_min(run, "rss_mib"),
                    "after_close": samples[-1]["rss_mib"]},
        "fds": {"start": samples[0]["fds"], "first": first["fds"], "last": last["fds"],
                "max": max(s["fds"] for s in run), "slope_per_min": slope_per_min(run, "fds"),
                "after_close": samples[-1]["fds"]},
        "threads": {"start": samples[0]["threads"], "first": first["threads"],
                    "last": last["threads"], "max": max(s["threads"] for s in run),
                    "after_close": samples[-1]["threads"]},
        "samples": samples,
    }


def main() -> int:
    p = bench_args.parser(__doc__)
    p.add_argument("--sandboxes", type=int, help="default 200 (--quick 50, --smoke 2)")
    p.add_argument("--minutes", type=float, help="default 10 (--quick 2, --smoke 0.05)")
    p.add_argument("--sample", type=float, help="seconds between samples: default 10 "
                   "(--quick 5, --smoke 1)")
    args = p.parse_args()
    for name, sizes in (("sandboxes", (200, 50, 2)), ("minutes", (10.0, 2.0, 0.05)),
                        ("sample", (10.0, 5.0, 1.0))):
        if getattr(args, name) is None:
            setattr(args, name, bench_args.pick(args, *sizes))
    base = Path(tempfile.mkdtemp(prefix="corral-soak-"))
    os.chmod(base, 0o711)  # sandboxes run as an unprivileged uid and must reach it
    proc = start_daemon(base)
    try:
        out = asyncio.run(soak(f"unix://{base / 'corral.sock'}", proc.pid, args))
    finally:
        proc.send_signal(signal.SIGINT)  # stop (SIGTERM hands sandboxes over)
        proc.wait(60)
        shutil.rmtree(base, ignore_errors=True)
    brief = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(brief, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 1 if out["lost"] or out["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
