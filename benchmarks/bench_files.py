"""File transfer throughput: the blocking SDK, the asyncio SDK and curl, by size.

    python3 benchmarks/bench_files.py [--quick | --smoke] [--json OUT]

One private daemon, one sandbox; for each size (10, 20, 40, 80, 200 MB; ``--quick``
10 and 40; ``--smoke`` 1 and 2) the median seconds of an upload (``PUT .../files``) and of a download
(``GET .../files``) by:

- ``sync``: ``sb.files.write(path, data)`` / ``sb.files.read(path)``;
- ``async``: the same through ``AsyncSandbox``;
- ``curl``: ``curl --unix-socket`` from a file (the baseline: no Python in the way);

and the ratios sync/curl and async/curl per size. For each size it also reports how much
one curl upload and one download grew the daemon's peak resident memory (``VmHWM``,
reset through ``/proc/PID/clear_refs`` before each), in MB and as a share of the body:
the routes stream, so it stays a few MB whatever the size (200 MB: 6 MB up, 7 MB down;
when the routes held bodies whole it was 213 MB up and 843 MB down). Linear code keeps each ratio about
flat across sizes; before uploads were streamed in bounded pieces, the blocking
client's ratio grew with the size (the HTTP stack copied the unsent rest of the body
after every partial ``send``: 131 s for 200 MB). Needs root (real sandboxes).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_args  # noqa: E402  (a sibling script, not a package)
from bench_sdk import private_daemon  # noqa: E402

import corral  # noqa: E402

MB = 1 << 20
REMOTE = "/tmp/payload.bin"


def _median(fn, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _curl(url: str, sandbox_id: str, *args: str) -> None:
    sock = url.removeprefix("unix://")
    target = f"http://corral/v1/sandboxes/{sandbox_id}/files?path={REMOTE}"
    subprocess.run(["curl", "-sSf", "--unix-socket", sock, "-o", "/dev/null", *args, target],
                   check=True)


async def _async_rounds(url: str, sandbox_id: str, data: bytes, rounds: int) -> tuple[float, float]:
    async with corral.AsyncClient(url) as ac:
        asb = await corral.AsyncSandbox.connect(sandbox_id, client=ac)
        up, down = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            await asb.files.write(REMOTE, data)
            up.append(time.perf_counter() - t)
            t = time.perf_counter()
            await asb.files.read(REMOTE)
            down.append(time.perf_counter() - t)
        return statistics.median(up), statistics.median(down)


def daemon_pid(url: str) -> int:
    """The pid of the daemon serving the Unix socket of ``url``."""
    sock = url.removeprefix("unix://").encode()
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if sock in argv and b"corral.server" in argv:
            return int(entry.name)
    raise RuntimeError(f"no daemon process serves {url}")


def _status_bytes(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def peak_growth(pid: int, fn) -> float:
    """How much ``fn()`` grew ``pid``'s peak resident memory, in MB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak is now the current RSS
    before = _status_bytes(pid, "VmRSS")
    fn()
    return (_status_bytes(pid, "VmHWM") - before) / MB


def one_size(url: str, sb: corral.Sandbox, data: bytes, local: Path, rounds: int) -> dict[str, float]:
    row: dict[str, float] = {}
    pid, mb = daemon_pid(url), len(data) / MB
    row["daemon_peak_up_mb"] = peak_growth(
        pid, lambda: _curl(url, sb.id, "-X", "PUT", "--data-binary", f"@{local}"))
    row["daemon_peak_down_mb"] = peak_growth(pid, lambda: _curl(url, sb.id))
    row["daemon_peak_up_vs_body"] = row["daemon_peak_up_mb"] / mb
    row["daemon_peak_down_vs_body"] = row["daemon_peak_down_mb"] / mb
    row["sync_up"] = _median(lambda: sb.files.write(REMOTE, data), rounds)
    row["sync_down"] = _median(lambda: sb.files.read(REMOTE), rounds)
    row["async_up"], row["async_down"] = asyncio.run(_async_rounds(url, sb.id, data, rounds))
    row["curl_up"] = _median(
        lambda: _curl(url, sb.id, "-X", "PUT", "--data-binary", f"@{local}"), rounds)
    row["curl_down"] = _median(lambda: _curl(url, sb.id), rounds)
    for way in ("up", "down"):
        for who in ("sync", "async"):
            row[f"{who}_{way}_vs_curl"] = row[f"{who}_{way}"] / row[f"curl_{way}"]
    return row


def measure(url: str, sizes: list[int], rounds: int) -> dict[str, dict[str, float]]:
    res: dict[str, dict[str, float]] = {}
    with corral.Client(url) as client, tempfile.TemporaryDirectory() as tmp:
        sb = corral.Sandbox.create(memory_mb=max(sizes) * 3 + 256, client=client)
        try:
            for mb in sizes:
                data = os.urandom(mb * MB)
                local = Path(tmp) / f"{mb}.bin"
                local.write_bytes(data)
                row = res[f"{mb}MB"] = one_size(url, sb, data, local, rounds)
                local.unlink()
                print(f"{mb:>4} MB  " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()),
                      flush=True)
        finally:
            sb.delete()
    return res


def main() -> int:
    args = bench_args.parser(__doc__).parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    sizes = bench_args.pick(args, [10, 20, 40, 80, 200], [10, 40], [1, 2])
    rounds = bench_args.pick(args, 3, 3, 1)
    with private_daemon("corral-bench-files-", "--max-upload-bytes", str(512 * MB)) as url:
        res = measure(url, sizes, rounds)
    first, last = res[f"{sizes[0]}MB"], res[f"{sizes[-1]}MB"]
    scale = sizes[-1] / sizes[0]
    # seconds per MB at the largest size over seconds per MB at the smallest: ~1 when linear
    res["growth"] = {k: (last[k] / first[k]) / scale
                     for k in ("sync_up", "async_up", "curl_up", "sync_down", "async_down",
                               "curl_down")}
    print("per-MB cost, largest size vs smallest (1.0 = linear): " + "  ".join(
        f"{k} {v:.2f}" for k, v in res["growth"].items()))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
