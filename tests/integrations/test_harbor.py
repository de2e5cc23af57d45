"""Harbor (the environment layer of Terminal-Bench, SkyRL and others) runs its tasks on
corral: a task in Harbor's own format (``environment/Dockerfile`` FROM an image of a
local registry, ``tests/test.sh``, ``solution/solve.sh``) run by ``harbor run`` with
Harbor's oracle agent and ``--env corral.integrations.harbor:CorralEnvironment``.
The right solution earns 1.0, a broken one 0.0.

Harbor needs Python >= 3.12: the test makes a virtualenv with pyenv's 3.12 (or any
``python3.12``) holding ``harbor==HARBOR_VERSION`` once, cached under
``~/.cache/corral/``, and puts this checkout's ``src`` on its ``PYTHONPATH``.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import corral
from corral.runtime.image_pull import local_name
from corral.runtime.paths import default_cache_dir
from tests.conftest import requires_root
from tests.runtime.oci_archives import oci_layout
from tests.runtime.registries import requires_registry, rootfs_layer, run_registry

pytestmark = [requires_root, requires_registry, pytest.mark.root, pytest.mark.timeout(900)]

HARBOR_VERSION = "0.26.0"
ENV_IMPORT_PATH = "corral.integrations.harbor:CorralEnvironment"
SRC = Path(__file__).resolve().parents[2] / "src"


def _python312() -> str | None:
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))
    return found[-1] if found else shutil.which("python3.12")


@pytest.fixture(scope="session")
def harbor_venv() -> Path:
    """A virtualenv with Harbor, made once and kept."""
    venv = Path(os.environ.get("CORRAL_HARBOR_VENV", "~/.cache/corral/harbor-"
                               f"{HARBOR_VERSION}")).expanduser()
    done = venv / ".complete"  # written last: a venv without it is half made
    if done.exists():
        return venv
    python = _python312()
    if python is None:
        pytest.skip("Harbor needs Python >= 3.12 and none was found (pyenv 3.12 or python3.12)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        try:
            subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True)
            subprocess.run([str(venv / "bin/pip"), "install", "-q", f"harbor=={HARBOR_VERSION}"],
                           check=True, capture_output=True, timeout=900)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(f"could not install harbor=={HARBOR_VERSION} into a venv: {exc}")
        done.write_text(HARBOR_VERSION)
    return venv


@pytest.fixture(scope="module")
def base_ref(tmp_path_factory):
    """The default image's root filesystem pushed to a local registry."""
    tmp = tmp_path_factory.mktemp("harbor-registry")
    layer = rootfs_layer(default_cache_dir() / "images/python/rootfs")
    layout = oci_layout(tmp / "layout", [layer], gzip_layers=False, config={
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]}})
    with run_registry(tmp / "registry") as registry:
        yield registry.push(layout, "harbor/base:1")


def make_task(root: Path, base_ref: str, answer: str) -> Path:
    """A Harbor task: compute 2+3 into /app/answer.txt; ``answer`` is what solve.sh writes."""
    for d in ("environment", "tests", "solution"):
        (root / d).mkdir(parents=True)
    (root / "task.toml").write_text(
        'schema_version = "1.4"\n\n[metadata]\n\n[verifier]\ntimeout_sec = 120.0\n\n'
        "[agent]\ntimeout_sec = 120.0\n\n[environment]\nbuild_timeout_sec = 600.0\n")
    (root / "instruction.md").write_text("Write the sum of the numbers in /app/input.txt "
                                         "to /app/answer.txt.\n")
    (root / "environment/Dockerfile").write_text(
        f"FROM {base_ref}\nWORKDIR /app\nRUN echo '2 3' > /app/input.txt\n")
    (root / "solution/solve.sh").write_text(
        f"#!/bin/bash\nset -e\nread a b < /app/input.txt\necho {answer} > /app/answer.txt\n")
    (root / "tests/test.sh").write_text(
        "#!/bin/bash\n"
        'if [ "$(cat /app/answer.txt 2>/dev/null)" = 5 ]; then\n'
        "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n")
    return root


def harbor_run(venv: Path, daemon, task: Path, jobs: Path) -> float:
    env = {**os.environ, "CORRAL_URL": daemon.url, "PYTHONPATH": str(SRC),
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # no fetch of a price list
    done = subprocess.run(
        [str(venv / "bin/harbor"), "run", "-p", str(task), "-a", "oracle",
         "--env", ENV_IMPORT_PATH, "-o", str(jobs), "-y", "-n", "1", "-q"],
        env=env, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = jobs.glob("*/result.json")
    stats = json.loads(result.read_text())["stats"]
    assert stats["n_errored_trials"] == 0, (stats, done.stdout[-3000:])
    (evals,) = stats["evals"].values()
    return float(evals["metrics"][0]["mean"])


def test_harbor_oracle_rewards_on_corral(harbor_venv, daemon, base_ref, tmp_path):
    with corral.Client(daemon.url) as client:
        before = {i.name for i in corral.Image.list(client=client)}
        try:
            good = make_task(tmp_path / "good" / "sum-task", base_ref, "$((a + b))")
            assert harbor_run(harbor_venv, daemon, good, tmp_path / "jobs-good") == 1.0
            broken = make_task(tmp_path / "broken" / "sum-task", base_ref, "$((a * b))")
            assert harbor_run(harbor_venv, daemon, broken, tmp_path / "jobs-broken") == 0.0
            made = {i.name for i in corral.Image.list(client=client)} - before
            assert local_name(base_ref) in made  # FROM the registry: pulled once
            assert not corral.Sandbox.list(tags=["harbor"], client=client)  # stop deleted
        finally:
            for name in sorted({i.name for i in corral.Image.list(client=client)} - before,
                               key=lambda n: n == local_name(base_ref)):  # the base last
                corral.Image.get(name, client=client).delete()
