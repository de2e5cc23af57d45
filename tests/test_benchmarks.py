"""Every benchmark in ``benchmarks/`` runs to the end at its ``--smoke`` sizes and writes
its figures as JSON, so no benchmark rots unseen (two once did: a renamed flag, a changed
event; ``profile_engine.py`` did: a changed method signature). The ``bench_*.py`` and
``profile_*.py`` scripts, ``soak.py``, and ``run.py --smoke`` for what only it runs: the
peers' harness (``peers/``) and the workloads (``workloads/``). No figure is checked: a
benchmark never gates CI on time."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_root

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
# modules the benchmarks import or run, not benchmarks of their own
HELPERS = {"bench_args.py", "report.py", "setup_ray_sandbox.py", "ray_sandbox_baseline.py"}
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
RAY = {"bench_cluster.py", "bench_cluster_tenants.py"}


def test_every_benchmark_is_smoked():
    assert len(SCRIPTS) >= 14, SCRIPTS  # the glob found them all, not nothing
    assert {"run.py", "soak.py", "profile_engine.py", "profile_humaneval.py"} <= set(SCRIPTS)
    # what run.py alone runs: its --smoke runs the peers' harness and every workload
    smoked = re.search(r'SMOKE_STAGES, SMOKE_PEERS = "([^"]+)"',
                       (BENCH / "run.py").read_text())
    assert smoked, "run.py lost SMOKE_STAGES"
    workloads = {w.stem for w in (BENCH / "workloads").glob("*.py")} - {
        "__init__", "cartpole_episodes"}  # the episodes run inside cartpole's sandboxes
    assert workloads and workloads | {"peers"} <= set(smoked[1].split(","))
    for name in SCRIPTS:
        assert "--smoke" in (BENCH / name).read_text() or "bench_args" in (BENCH / name).read_text(), (
            f"{name} takes no --smoke: build its parser with bench_args.parser()")


@requires_root
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_at_smoke_size(script, tmp_path):
    if script in RAY:
        pytest.importorskip("ray", reason="the ray extra is not installed")
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(BENCH.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--json", str(out)],
                          cwd=BENCH.parent, env=env, capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    figures = json.loads(out.read_text())
    assert figures, f"{script} wrote no figures"
