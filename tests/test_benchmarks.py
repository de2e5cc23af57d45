"""Every ``benchmarks/bench_*.py`` runs to the end at its ``--smoke`` sizes and writes its
figures as JSON, so no benchmark rots unseen (two once did: a renamed flag, a changed
event). No figure is checked: a benchmark never gates CI on time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_root

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py") if p.name != "bench_args.py")
RAY = {"bench_cluster.py", "bench_cluster_tenants.py"}


def test_every_benchmark_is_smoked():
    assert len(SCRIPTS) >= 14, SCRIPTS  # the glob found them all, not nothing
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
