"""Staging and sealing a layer, large files hashed behind their copy or at seal.

    python3 benchmarks/bench_layer_hash.py [--quick] [--json OUT]

The storage half of a snapshot commit without a sandbox (no freeze): a 50 MB file on
tmpfs staged into a layer store on the state directory's disk and sealed (copy, hash,
syncfs), with ``LayerStore.stream_hash`` on (``streamed_ms``) and off (``at_seal_ms``),
alternating; baseline: ``cp -a`` + ``sync`` of the same file. ``stage_ms``: the copy
alone (what the sandbox waits for, frozen). Runs without root and without corral's
dependencies (it imports only the storage modules), so it runs on any spare machine.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if "corral" not in sys.modules:  # the storage modules only, not the client's imports
    pkg = types.ModuleType("corral")
    pkg.__path__ = [str(HERE.parent / "src" / "corral")]  # type: ignore[attr-defined]
    sys.modules["corral"] = pkg

import bench_args  # noqa: E402

from corral.runtime.layers import LayerStore  # noqa: E402

MB = 1 << 20


def run(rounds: int, mb: int, where: Path) -> dict[str, float]:
    src = Path(tempfile.mkdtemp(prefix="corral-bench-src-", dir="/dev/shm"))
    base = Path(tempfile.mkdtemp(prefix="corral-bench-layers-", dir=where))
    (src / "f").write_bytes(os.urandom(mb * MB))
    store = LayerStore(base / "layers")
    store.open([])
    res: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for way, on in (("at_seal", False), ("streamed", True)):
                store.stream_hash = on
                t = time.perf_counter()
                tmp = store.stage(src)
                staged = time.perf_counter()
                sealed = store.seal(tmp)
                res.setdefault(f"{way}_ms", []).append((time.perf_counter() - t) * 1000)
                res.setdefault(f"{way}_stage_ms", []).append((staged - t) * 1000)
                store.discard(sealed.tmp)
            t = time.perf_counter()
            subprocess.run(["cp", "-a", str(src), str(base / "copy")], check=True)
            os.sync()
            res.setdefault("copy_ms", []).append((time.perf_counter() - t) * 1000)
            shutil.rmtree(base / "copy")
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    out = {k: statistics.median(v) for k, v in res.items()}
    out["load_1min"] = os.getloadavg()[0]
    out["cpus"] = os.cpu_count() or 0
    return out


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the layer store goes (the state directory's disk)")
    args = ap.parse_args()
    rounds, mb = bench_args.pick(args, (9, 50), (5, 50), (1, 2))
    res = run(rounds, mb, args.dir)
    for key in ("streamed_ms", "at_seal_ms"):
        print(f"{key:18} {res[key]:8.1f} ms  {res[key] / res['copy_ms']:.2f}x cp -a + sync "
              f"({res['copy_ms']:.1f} ms); copy part {res[key[:-3] + '_stage_ms']:.1f} ms")
    print(f"load (1 min) {res['load_1min']:.2f} on {res['cpus']} CPUs")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
