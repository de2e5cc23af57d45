"""What ``import corral`` and a short ``corral`` command line cost a fresh process, in CPU.

    python3 benchmarks/bench_import.py [--quick] [--smoke] [--json OUT] [--baseline REF]

Every reward worker, rollout process and ``corral`` call starts a Python that imports
the SDK. Each sample is one fresh interpreter (this one, ``-X importtime`` off); its CPU
(user + system, from ``getrusage(RUSAGE_CHILDREN)`` around it) is the figure, since wall
time on a shared host is mostly other people's work. Kinds:

- ``pass``: ``python -c pass``, the interpreter's own start-up: the same-run baseline;
- ``import``: ``python -c 'import corral'``;
- ``sandbox``: what a sandbox user loads: ``import corral``, ``corral.Sandbox`` and
  ``corral.Client(url)`` built (no request; the public names load on first use);
- ``cli_help``: ``corral --help`` (``python -m corral.cli.main --help``);
- ``cli_ls``: ``corral ls`` against a loopback port that refuses (a socket bound, never
  listening): the CLI's imports, one client and one failed connect; exit status 1.

Rounds alternate the order of the kinds (and of the trees with ``--baseline REF``, a
detached git worktree of REF, run with the same interpreter): ABBA. Figures are medians of
the rounds; ``*_over_pass_ms`` is a kind's median less ``pass``'s, and with ``--baseline``
``ratio_*`` is this tree's excess over the baseline tree's. Runs without root.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)

HERE = Path(__file__).resolve().parent
KINDS = ("pass", "import", "sandbox", "cli_help", "cli_ls")


def _argv(kind: str, url: str) -> list[str]:
    py = sys.executable
    return {
        "pass": [py, "-c", "pass"],
        "import": [py, "-c", "import corral"],
        "sandbox": [py, "-c", f"import corral; corral.Sandbox; corral.Client({url!r})"],
        "cli_help": [py, "-m", "corral.cli.main", "--help"],
        "cli_ls": [py, "-m", "corral.cli.main", "--url", url, "ls"],
    }[kind]


def cpu_ms(argv: list[str], env: dict[str, str]) -> float:
    """One fresh process's CPU (user + system), in ms."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != (1 if argv[-1] == "ls" else 0):
        raise SystemExit(f"{argv} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)) * 1000


def _tree(ref: str, into: Path) -> Path:
    """A detached worktree of ``ref`` under ``into``; its ``src`` directory."""
    subprocess.run(["git", "-C", str(HERE.parent), "worktree", "add", "--detach", "-q",
                    str(into), ref], check=True)
    return into / "src"


def measure(trees: dict[str, Path], rounds: int, url: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "PYTHON"))}
    envs = {name: {**env, "PYTHONPATH": str(src)} for name, src in trees.items()}
    got: dict[str, list[float]] = {}
    load = [os.getloadavg()[0]]
    for name in trees:  # warm the page cache and the .pyc files once
        for kind in KINDS:
            cpu_ms(_argv(kind, url), envs[name])
    for i in range(rounds):
        pairs = [(name, kind) for name in trees for kind in KINDS]
        for name, kind in pairs if i % 2 == 0 else reversed(pairs):  # ABBA
            got.setdefault(f"{name}_{kind}_ms", []).append(cpu_ms(_argv(kind, url), envs[name]))
    load.append(os.getloadavg()[0])
    res = {k: statistics.median(v) for k, v in got.items()}
    for name in trees:
        for kind in KINDS[1:]:
            res[f"{name}_{kind}_over_pass_ms"] = res[f"{name}_{kind}_ms"] - res[f"{name}_pass_ms"]
            if name != "current" and res[f"{name}_{kind}_over_pass_ms"] > 0:
                res[f"ratio_{kind}"] = (res[f"current_{kind}_over_pass_ms"]
                                        / res[f"{name}_{kind}_over_pass_ms"])
    res["rounds"] = rounds
    res["load_1min_start"], res["load_1min_end"] = load
    res["cpus"] = os.cpu_count() or 0
    return res


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--baseline", metavar="REF",
                    help="also measure REF's tree (a git worktree), alternating with this one")
    args = ap.parse_args()
    rounds = bench_args.pick(args, 21, 11, 1)
    trees = {"current": HERE.parent / "src"}
    with tempfile.TemporaryDirectory(prefix="corral-bench-import-") as tmp, \
            contextlib.ExitStack() as stack, \
            socket.socket() as refuser:
        if args.baseline:
            trees["baseline"] = _tree(args.baseline, Path(tmp) / "baseline")
            stack.callback(subprocess.run, ["git", "-C", str(HERE.parent), "worktree", "remove",
                                            "--force", str(Path(tmp) / "baseline")], check=False)
        refuser.bind(("127.0.0.1", 0))  # bound, never listening: every connect is refused
        url = "http://127.0.0.1:%d" % refuser.getsockname()[1]
        t = time.perf_counter()
        res = measure(trees, rounds, url)
        res["duration_s"] = time.perf_counter() - t
    print(f"{'CPU ms per process (median)':28} " + " ".join(
        f"{name:>9} {'-pass':>7}" for name in trees) + (" ratio" if args.baseline else ""))
    for kind in KINDS:
        line = f"{kind:28} "
        for name in trees:
            over = res.get(f"{name}_{kind}_over_pass_ms")
            line += f"{res[f'{name}_{kind}_ms']:9.1f} " + (f"{over:7.1f}" if over is not None
                                                         else f"{'':7}")
        if f"ratio_{kind}" in res:
            line += f" {res[f'ratio_{kind}']:5.2f}"
        print(line)
    print(f"{rounds} rounds, load {res['load_1min_start']:.1f} -> {res['load_1min_end']:.1f} "
          f"on {res['cpus']} CPUs")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
