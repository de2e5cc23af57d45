"""The benchmark suite: corral side by side with its peers and real workloads, one run.

    make bench             # scripts/install-bench.sh, then this: ~10 minutes
    make bench QUICK=1     # fewer samples: ~2 minutes
    python3 benchmarks/run.py [--quick | --smoke] [--out DIR] [--only STAGES] [--peers NAMES]

``--smoke`` (what ``make test`` runs, ``tests/test_benchmarks.py``): the stages the
``bench_*.py`` smokes do not cover — ``peers`` (bare, bwrap and corral's SDK unless
``--peers`` says otherwise), ``humaneval`` and ``cartpole`` — at tiny sizes; its figures
mean nothing.

Needs root. Stages, in order (``--only`` picks some, comma-separated):

- ``engine``: ``bench_engine.py`` (create→ready, exec, rate, density, with bare
  fork+exec and raw bwrap baselines); ``sdk``: ``bench_sdk.py``; ``other``: every
  other ``bench_*.py`` in this folder (the pool benchmark, when it lands);
- ``peers``: every module of ``peers/`` timed by one harness (see ``peers/__init__``),
  corral's own row included, each skipped with its reason printed when it cannot run;
- ``humaneval`` and ``cartpole``: the workloads of ``workloads/``.

Writes ``OUT/latest.json`` (keys documented in benchmarks/README.md), ``latest.md``
and ``latest.png`` (default OUT: benchmarks/results). Never fails on time: the exit
status is non-zero only when a stage could not run or a workload got a wrong answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers  # noqa: E402
import report  # noqa: E402
from bench_engine import host_facts, raise_nofile  # noqa: E402

SCHEMA_VERSION = 1
STAGES = ("engine", "sdk", "other", "peers", "humaneval", "cartpole")
SMOKE_STAGES, SMOKE_PEERS = "peers,humaneval,cartpole", "corral_sdk,bare,bwrap"
OWN = ("bench_engine.py", "bench_sdk.py")
# headline keys that other bench_*.py scripts measure
COLLECTED = ("pool_acquire_ms_p50", "snapshot_commit_ms", "restore_100_s")
NOT_YET = "not yet measured: {what} has not landed; this key stays null until it does"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def find_key(data: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in nested dicts."""
    if isinstance(data, dict):
        if data.get(key) is not None:
            return data[key]
        for value in data.values():
            found = find_key(value, key)
            if found is not None:
                return found
    return None


def run_script(script: Path, quick: bool, tmp: Path) -> dict[str, Any]:
    """Run one ``bench_*.py``; its JSON (``--json``) if it wrote one, and its output."""
    out_json = tmp / f"{script.stem}.json"
    argv = [sys.executable, str(script), *(["--quick"] if quick else []),
            "--json", str(out_json)]
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        print(f"    {line}", end="", flush=True)
        lines.append(line)
    proc.wait()
    result: dict[str, Any] = {"exit_status": proc.returncode,
                              "duration_s": time.perf_counter() - t}
    if out_json.exists():
        try:
            result["data"] = json.loads(out_json.read_text())
        except ValueError:
            pass
    result["stdout_tail"] = "".join(lines[-30:])
    return result


def figure_from_output(text: str, key: str) -> float | None:
    m = re.search(rf"{key}\W+([0-9]+(?:\.[0-9]+)?)", text)
    return float(m.group(1)) if m else None


def run_peers(ctx_args: dict[str, Any], only: list[str] | None, quick: bool,
              smoke: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for module in peers.PEER_MODULES:
        if only and module not in only:
            continue
        workdir = Path(tempfile.mkdtemp(prefix=f"corral-bench-{module}-"))
        ctx = peers.Context(workdir=workdir, quick=quick, **ctx_args)
        peer = None
        try:
            peer = peers.load(module, ctx)
            peer.check()
            log(f"peer {peer.name}: {peer.title}")
            t = time.perf_counter()
            results[peer.name] = peers.measure(peer, quick, log=log, smoke=smoke)
            results[peer.name]["duration_s"] = time.perf_counter() - t
        except peers.Skip as exc:
            log(f"peer {module}: SKIPPED: {exc}")
            results[getattr(peer, "name", module)] = {"skipped": str(exc)}
        except Exception as exc:
            reason = f"failed: {type(exc).__name__}: {exc}"
            log(f"peer {module}: SKIPPED ({reason})")
            traceback.print_exc()
            results[getattr(peer, "name", module)] = {"skipped": reason}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return results


def headline(res: dict[str, Any]) -> None:
    """The stable top-level keys, and each one's ratio to its baseline."""
    eng = find_key(res.get("engine"), "figures") or {}
    base = res.get("baselines", {})
    bw = base.get("bwrap", {})
    he, cp = res.get("humaneval") or {}, res.get("cartpole") or {}
    pool = res.get("pool_acquire_ms_p50")
    snap = (res.get("snapshot") or {}).get("data") or {}
    keys = {
        "create_ready_ms_p50": eng.get("create_ready_ms_p50"),
        "create_ready_ms_p95": eng.get("create_ready_ms_p95"),
        "exec_rtt_ms_p50": eng.get("exec_rtt_ms_p50"),
        "bare_exec_ms_p50": eng.get("bare_exec_ms_p50"),
        "create_rate_per_s": eng.get("create_rate_per_s"),
        "mem_per_idle_sandbox_mb": eng.get("mem_per_idle_sandbox_mb"),
        "max_concurrent_sandboxes": eng.get("max_concurrent_sandboxes"),
        "snapshot_commit_ms": res.get("snapshot_commit_ms"),
        "restore_100_s": res.get("restore_100_s"),
        "pool_acquire_ms_p50": pool,
        "sdk_exec_rtt_ms_p50": find_key(res.get("sdk"), "sdk_exec_rtt_ms_p50"),
        "humaneval_pass": he.get("humaneval_pass"),
        "humaneval_wall_ratio": he.get("humaneval_wall_ratio"),
        "cartpole_1000_s": cp.get("cartpole_1000_s"),
        "cartpole_ratio": cp.get("cartpole_ratio"),
    }
    res.update(keys)
    res["not_measured"] = {
        key: NOT_YET.format(what="the snapshot benchmark (benchmarks/bench_snapshot.py)")
        for key in ("snapshot_commit_ms", "restore_100_s") if res.get(key) is None
    }
    if pool is None:
        res["not_measured"]["pool_acquire_ms_p50"] = NOT_YET.format(
            what="the pool benchmark (benchmarks/bench_pool.py)")
    # (key, baseline name, baseline value): the ratio is key / baseline.
    bwrap_true = eng.get("bwrap_true_ms_p50")
    pairs = {
        "create_ready_ms_p50": ("raw bwrap `true` (same namespaces)", bwrap_true),
        "create_ready_ms_p95": ("raw bwrap `true` (same namespaces)", bwrap_true),
        "exec_rtt_ms_p50": ("bare fork+exec", eng.get("bare_exec_ms_p50")),
        "snapshot_commit_ms": ("cp -a + sync of the same 50 MB", snap.get("copy_50mb_ms")),
        "restore_100_s": ("100 plain creates", snap.get("plain_create_100_s")),
        "bare_exec_ms_p50": ("bare fork+exec (the floor itself)", eng.get("bare_exec_ms_p50")),
        "create_rate_per_s": ("raw bwrap creates/s, same in-flight", bw.get("create_rate_per_s")),
        "mem_per_idle_sandbox_mb": ("raw bwrap idle sandbox", bw.get("mem_per_idle_sandbox_mb")),
        "max_concurrent_sandboxes": ("sandboxes asked for",
                                     find_key(res.get("engine"), "density")),
        "pool_acquire_ms_p50": ("cold create→ready", eng.get("create_ready_ms_p50")),
        "sdk_exec_rtt_ms_p50": ("bare fork+exec", eng.get("bare_exec_ms_p50")),
        "humaneval_pass": ("problems", he.get("humaneval_total")),
        "humaneval_wall_ratio": ("plain subprocesses, s", he.get("humaneval_subprocess_wall_s")),
        "cartpole_1000_s": ("in-process, s", cp.get("cartpole_inprocess_s")),
        "cartpole_ratio": ("in-process, s", cp.get("cartpole_inprocess_s")),
    }
    ratios = {}
    for key, (name, value) in pairs.items():
        mine = keys[key]
        if key == "humaneval_wall_ratio":
            mine = he.get("humaneval_wall_s")
        elif key == "cartpole_ratio":
            mine = cp.get("cartpole_1000_s")
        ratio = mine / value if isinstance(mine, (int, float)) and value else None
        if key == "mem_per_idle_sandbox_mb" and not report.meaningful(
                bw, "mem_per_idle_sandbox_mb"):
            ratio = None  # raw bwrap's figure is within the host's noise
        ratios[key] = {"baseline": name, "baseline_value": value, "value": mine, "ratio": ratio}
    res["ratios"] = ratios
    for name, row in base.items():
        if name != "corral" and "skipped" not in row:
            row["vs_corral"] = report.vs_corral(row, base.get("corral", {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (~2 minutes)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes, stages {SMOKE_STAGES} (peers {SMOKE_PEERS}): "
                        "proves they run; the figures mean nothing")
    parser.add_argument("--json", type=Path, help="also write latest.json's figures here")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; "
                        "--smoke: a temporary one, removed)")
    parser.add_argument("--only", help=f"comma-separated stages of {','.join(STAGES)}")
    parser.add_argument("--peers", help=f"comma-separated of {','.join(peers.PEER_MODULES)}")
    args = parser.parse_args()
    if args.smoke:
        args.only = args.only or SMOKE_STAGES
        args.peers = args.peers or SMOKE_PEERS
    out_dir = args.out or (HERE / "results" if not args.smoke else None)
    stages = args.only.split(",") if args.only else list(STAGES)
    if unknown := set(stages) - set(STAGES):
        parser.error(f"unknown stages: {', '.join(sorted(unknown))}")
    if os.geteuid() != 0:
        print("benchmarks need root (namespaces, cgroups, mounts, container runtimes)",
              file=sys.stderr)
        return 2
    import bench_sdk  # imports corral: after the root check, which needs no install

    raise_nofile()
    peers.become_subreaper()
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "quick": args.quick, "stages": stages,
        "command": "make bench" + (" QUICK=1" if args.quick else "") + (
            " (smoke)" if args.smoke else ""),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host_facts(),
        "baselines": {}, "notes": [],
    }
    failed: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-run-"))
    os.chmod(tmp, 0o711)  # the daemon's sandboxes must reach its socket's folder
    daemon = None
    try:
        scripts = sorted(s for s in HERE.glob("bench_*.py") if s.name != "bench_args.py")
        for stage, chosen in (("engine", [s for s in scripts if s.name == OWN[0]]),
                              ("sdk", [s for s in scripts if s.name == OWN[1]]),
                              ("other", [s for s in scripts if s.name not in OWN])):
            if stage not in stages:
                continue
            for script in chosen:
                log(f"{script.name}")
                out = run_script(script, args.quick, tmp)
                res[stage if stage != "other" else script.stem.removeprefix("bench_")] = out
                if out["exit_status"] != 0:
                    failed.append(script.name)
                if stage == "other":
                    for key in COLLECTED:
                        value = find_key(out.get("data"), key)
                        if value is None:
                            value = figure_from_output(out["stdout_tail"], key)
                        if value is not None:
                            res[key] = value
        url = None
        if {"peers", "humaneval", "cartpole"} & set(stages):
            log("starting a private corral daemon for the SDK row and the workloads")
            try:
                daemon = bench_sdk.start_daemon(tmp)
                url = f"unix://{tmp / 'corral.sock'}"
            except (Exception, SystemExit) as exc:  # start_daemon exits on failure
                res["notes"].append(f"the corral daemon did not start: {exc}")
                failed.append("daemon")
        if "peers" in stages:
            from corral.runtime.images import ImageStore
            from corral.runtime.paths import Layout

            rootfs = ImageStore(Layout.create().images_dir).get("python").rootfs
            res["baselines"] = run_peers({"rootfs": rootfs, "corral_url": url},
                                         args.peers.split(",") if args.peers else None,
                                         args.quick, args.smoke)
        for stage in ("humaneval", "cartpole"):
            if stage not in stages:
                continue
            log(f"workload {stage}{' (quick)' if args.quick else ''}")
            try:
                if url is None:
                    raise RuntimeError("no corral daemon")
                module = __import__(f"workloads.{stage}", fromlist=["run"])
                res[stage] = module.run(url, args.quick, smoke=args.smoke)
                res[stage]["quick"] = args.quick
            except Exception as exc:
                traceback.print_exc()
                res[stage] = {"error": f"{type(exc).__name__}: {exc}"}
                failed.append(stage)
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGINT)  # stop; SIGTERM would hand sandboxes over
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    he, cp = res.get("humaneval") or {}, res.get("cartpole") or {}
    if he.get("humaneval_pass") is not None and he["humaneval_pass"] != he["humaneval_total"]:
        failed.append(f"humaneval ({he['humaneval_pass']}/{he['humaneval_total']} passed)")
    if cp.get("cartpole_match") is False:
        failed.append("cartpole (sandboxed episodes differ from in-process ones)")
    headline(res)
    res["duration_s"] = time.perf_counter() - t0
    res["failed"] = failed
    res["host"]["loadavg_end"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
    with tempfile.TemporaryDirectory(prefix="corral-bench-smoke-") as scratch:
        paths = report.write(res, out_dir or Path(scratch))  # a smoke keeps no results
        print()
        print(paths["md"].read_text())
        log(f"wrote {', '.join(str(p) for p in paths.values())} in {res['duration_s']:.0f} s")
    if failed:
        print(f"FAILED: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
