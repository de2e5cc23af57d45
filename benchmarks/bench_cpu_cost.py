"""CPU per sandbox and per exec, across git commits: the tool that bisects a slowdown.

    python3 benchmarks/bench_cpu_cost.py                     # this tree alone
    python3 benchmarks/bench_cpu_cost.py --refs f42e1d2 HEAD --rounds 5
    python3 benchmarks/bench_cpu_cost.py --refs A B C --lifecycles 40 --execs 300 --json OUT

Wall-clock time on a loaded host is noise; CPU time is much less so. Each ref gets a
detached git worktree (``--trees``, default a temporary folder) and a private base
folder: its own state directory, socket and image cache (the host's prepared ``python``
image, tools and agent binaries seeded by hard links, as ``runtime/cache_seed.py`` does
for a cluster node: read only, the default cache is never written). Then, in rounds
whose order alternates (A B C, C B A, ...), one child process per ref starts that tree's
daemon (``python -m corral.server``, the tree's own code, SDK included) and measures,
through that tree's sync SDK:

- ``lifecycle``: ``Sandbox.create`` → ``exec(["true"])`` → ``delete``;
- ``exec``: ``exec(["true"])`` on one sandbox.

For each, in ms of CPU per operation: ``client`` (the SDK's process), ``daemon`` (the
daemon process's own user+system time, every thread) and ``tree`` (all of its
descendants: launchers, the warden, bwrap, the agent and the command — the reaped ones
through the daemon's ``cutime``/``cstime``, the live ones read from ``/proc``), and
``total`` = the three; the wall time too. The figures printed are medians over rounds,
and each ref's ratio to the first ref's. ``--demo N`` also runs each tree's
``examples/policy_eval_demo.py --episodes N`` once per round (CPU per run, and the
sandboxes it made). With ``CORRAL_BENCH_PROFILE=FILE`` in a round's environment,
``py-spy`` samples that daemon over the lifecycles (raw stacks to FILE). Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_args  # noqa: E402  (a sibling script, not a package)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TICK = os.sysconf("SC_CLK_TCK")
KINDS = ("client", "daemon", "tree", "total")
OPS = ("lifecycle", "exec", "demo")


# -- CPU of a process tree, from /proc ---------------------------------------------------

def _stat(pid: int | str) -> tuple[int, list[str]] | None:
    """(ppid, the fields after the command name) of ``pid``, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    return int(fields[1]), fields


def tree_cpu(root: int) -> tuple[float, float]:
    """(own, descendants) CPU seconds of ``root``: its own user+system time, and its
    descendants' — reaped (its ``cutime``+``cstime``) and live (each one's own)."""
    children: dict[int, list[int]] = {}
    fields: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            got = _stat(entry.name)
            if got is not None:
                children.setdefault(got[0], []).append(int(entry.name))
                fields[int(entry.name)] = got[1]
    if root not in fields:
        raise RuntimeError(f"process {root} is gone")
    f = fields[root]
    own = (int(f[11]) + int(f[12])) / TICK
    below = (int(f[13]) + int(f[14])) / TICK
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        f = fields[pid]
        below += (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / TICK
        todo.extend(children.get(pid, []))
    return own, below


# -- one round: a child process on one tree ----------------------------------------------

def _start_daemon(base: Path) -> subprocess.Popen:
    import corral

    sock = base / "corral.sock"
    sock.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.server", "--socket", str(sock),
         "--state-dir", str(base / "state")],
        stdout=open(base / "daemon.log", "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(base / 'daemon.log').read_text()[-2000:]}")
        if sock.exists():
            try:
                with corral.Client(f"unix://{sock}") as c:
                    c.health()
                return proc
            except corral.CorralError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("daemon did not start in 120 s")


def child(base: Path, lifecycles: int, execs: int, demo: int = 0) -> dict[str, float]:
    """One round against the tree on ``sys.path``: ms per operation. With
    ``CORRAL_BENCH_PROFILE=FILE``, ``py-spy`` samples the daemon over the lifecycles
    (its raw stacks to FILE; the figures of such a round are the profiler's too)."""
    import corral

    out: dict[str, float] = {}
    proc = _start_daemon(base)
    profile = os.environ.get("CORRAL_BENCH_PROFILE")
    try:
        def snap() -> tuple[float, ...]:
            """(client, daemon, its tree, wall); the client's own CPU and its reaped
            children's (the demo's process; the daemon is reaped only at the end)."""
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            return (time.process_time() + kids.ru_utime + kids.ru_stime, *tree_cpu(proc.pid),
                    time.perf_counter())

        def measure(name: str, ops: int, run) -> None:
            time.sleep(0.2)  # refills and stragglers of what came before
            before = snap()
            run(ops)
            time.sleep(0.2)  # this batch's own refill, counted
            after = snap()
            spent = [a - b for a, b in zip(after, before, strict=True)]
            spent[3] -= 0.2  # the settle is not the operations' wall time
            for key, value in zip(("client", "daemon", "tree", "wall"), spent, strict=True):
                out[f"{name}_{key}_ms"] = value / ops * 1000
            out[f"{name}_total_ms"] = sum(spent[:3]) / ops * 1000

        with corral.Client(f"unix://{base / 'corral.sock'}") as client:
            def cycles(k: int) -> None:
                for _ in range(k):
                    with corral.Sandbox.create(memory_mb=128, client=client) as s:
                        s.exec(["true"])

            cycles(2)  # warm: images opened, slots made, connection up
            with corral.Sandbox.create(memory_mb=128, client=client) as sb:
                def run_execs(k: int) -> None:
                    for _ in range(k):
                        sb.exec(["true"])

                run_execs(5)
                measure("exec", execs, run_execs)
            if profile:
                with _profiled(proc.pid, profile):
                    measure("lifecycle", lifecycles, cycles)
            else:
                measure("lifecycle", lifecycles, cycles)
            if demo:
                said: list[str] = []

                def run_demo(_: int) -> None:
                    said.append(subprocess.run(
                        [sys.executable, "examples/policy_eval_demo.py", "--episodes", str(demo),
                         "--url", client.url], check=True, capture_output=True, text=True).stdout)

                measure("demo", 1, run_demo)
                # "800 episodes in 212 sandboxes in ...": how many it made, deterministic
                made = re.search(r"episodes in (\d+) sandboxes", said[0])
                if made:
                    out["demo_sandboxes"] = float(made.group(1))
    finally:
        proc.send_signal(signal.SIGINT)  # stop; SIGTERM would hand its sandboxes over
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


@contextlib.contextmanager
def _profiled(pid: int, out: str):
    """``py-spy record`` of ``pid``'s threads while the block runs (raw stacks to ``out``)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spy = subprocess.Popen([exe, "record", "--nonblocking", "-r", "400", "-f", "raw", "-o", out,
                            "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)


# -- the parent: trees, caches, alternated rounds ----------------------------------------

def _seed_cache(cache: Path, images: list[str]) -> None:
    """A private image cache: the host's prepared ``images`` (with the layers and the
    root image they stand on), tools and agent binaries linked, never written."""
    from corral.runtime.paths import default_cache_dir

    source = default_cache_dir() / "images"
    if cache.exists():
        return
    (cache / "images" / ".layers").mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o755)

    def link(src: Path, into: Path) -> None:
        if src.exists() and not (into / src.name).exists():
            # another file system: not linked, the daemon prepares it as on a fresh host
            subprocess.run(["cp", "-al", str(src), str(into)], check=False,
                           stderr=subprocess.DEVNULL)

    todo = list(images)
    while todo:
        name = todo.pop()
        if not (source / name / "manifest.json").is_file():
            continue  # the daemon prepares it itself, as on a fresh host
        link(source / name, cache / "images")
        manifest = json.loads((source / name / "manifest.json").read_text())
        for layer in manifest.get("layers") or ():
            link(source / ".layers" / str(layer["id"]), cache / "images" / ".layers")
        todo += [x for x in (manifest.get("base"), (manifest.get("root") or {}).get("image"))
                 if x and x not in images]
    for tool in ("share", "bin", "criu"):
        link(default_cache_dir() / tool, cache)
    for lock in cache.glob("*/.*lock"):
        lock.unlink()  # locks stay per cache: a shared inode would lock the host's


def _tree(ref: str, trees: Path) -> tuple[str, Path]:
    """(short sha, source folder) of ``ref``: this checkout for ``.``, else a worktree."""
    if ref == ".":
        return "worktree", REPO
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", ref + "^{commit}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    path = trees / sha
    if not (path / "src" / "corral").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                        str(path), sha], check=True)
    return sha, path


def _round(tree: Path, base: Path, lifecycles: int, execs: int,
           demo: int) -> dict[str, float] | None:
    """One round in a child process on ``tree``; None (and why, printed) if it failed."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"),
           "CORRAL_CACHE_DIR": str(base / "cache")}
    env.pop("CORRAL_URL", None)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(base), str(lifecycles), str(execs), str(demo)],
        env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"round on {tree} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--refs", nargs="+", default=["."],
                    help="git refs to compare, the first is the baseline ('.': this checkout)")
    ap.add_argument("--rounds", type=int, help="rounds per ref (alternated)")
    ap.add_argument("--lifecycles", type=int, help="create+exec+delete per round")
    ap.add_argument("--execs", type=int, help="execs per round")
    ap.add_argument("--trees", type=Path, help="keep the worktrees here (default: temporary)")
    ap.add_argument("--demo", type=int, default=0, metavar="EPISODES",
                    help="also run each tree's examples/policy_eval_demo.py with EPISODES "
                    "episodes per policy, once per round (needs the rl image)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        base, lifecycles, execs, demo = args.child
        print(json.dumps(child(Path(base), int(lifecycles), int(execs), int(demo))))
        return 0
    if os.geteuid() != 0:
        print("needs root (the daemon runs real sandboxes)")
        return 1
    rounds = args.rounds or bench_args.pick(args, 5, 3, 1)
    lifecycles = args.lifecycles or bench_args.pick(args, 40, 20, 2)
    execs = args.execs or bench_args.pick(args, 300, 100, 5)
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-cpu-cost-"))
    os.chmod(tmp, 0o711)  # sandboxes run as an unprivileged uid and must reach it
    trees = args.trees or tmp / "trees"
    trees.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    try:
        refs = []
        for ref in args.refs:
            sha, path = _tree(ref, trees)
            if path != REPO and args.trees is None:
                made.append(path)
            base = tmp / f"base-{len(refs)}"
            base.mkdir(mode=0o711)
            _seed_cache(base / "cache", ["python", "rl"] if args.demo else ["python"])
            refs.append((ref, sha, path, base))
        got: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(refs))}
        for r in range(rounds):
            order = list(range(len(refs)))
            if r % 2:
                order.reverse()
            for i in order:
                ref, sha, path, base = refs[i]
                res = _round(path, base, lifecycles, execs, args.demo)
                if res is None:
                    continue
                got[i].append(res)
                print(f"round {r + 1}/{rounds} {sha}: lifecycle {res['lifecycle_total_ms']:.2f} "
                      f"ms CPU, exec {res['exec_total_ms']:.3f} ms CPU", flush=True)
        figures = summarise(refs, got)
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                           check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def summarise(refs: list, got: dict[int, list[dict[str, float]]]) -> dict:
    load = os.getloadavg()
    rows = []
    for i, (ref, sha, _path, _base) in enumerate(refs):
        if not got[i]:
            print(f"{sha}: no round ran")
            continue
        row = {"ref": ref, "commit": sha, "rounds": len(got[i])}
        for key in got[i][0]:
            row[key] = statistics.median(r[key] for r in got[i] if key in r)
        rows.append(row)
    ops = [op for op in OPS if rows and f"{op}_total_ms" in rows[0]]
    for row in rows:
        for op in ops:
            row[f"{op}_ratio"] = row[f"{op}_total_ms"] / rows[0][f"{op}_total_ms"]
    return {"load": [round(x, 1) for x in load], "ops": ops, "rows": rows}


def report(figures: dict) -> None:
    print(f"load {figures['load']}; CPU ms per operation (demo: per run), medians of rounds; "
          "ratio of the total to the first ref's")
    print(f"{'commit':10} {'op':9} " + " ".join(f"{k:>8}" for k in (*KINDS, "wall")) + "   ratio")
    for row in figures["rows"]:
        for op in figures["ops"]:
            vals = " ".join(f"{row[f'{op}_{k}_ms']:8.1f}" if op == "demo" else
                            f"{row[f'{op}_{k}_ms']:8.3f}" for k in (*KINDS, "wall"))
            made = f"  ({row['demo_sandboxes']:.0f} sandboxes)" if op == "demo" and \
                "demo_sandboxes" in row else ""
            print(f"{row['commit']:10} {op:9} {vals}   {row[f'{op}_ratio']:5.2f}x{made}")


if __name__ == "__main__":
    sys.exit(main())
