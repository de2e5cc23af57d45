"""Harbor (the environment layer of Terminal-Bench, SkyRL and others) runs its tasks on
corral: a task in Harbor's own format (``environment/Dockerfile`` FROM an image of a
local registry, ``tests/test.sh``, ``solution/solve.sh``) run by ``harbor run`` with
Harbor's oracle agent and ``--env corral.integrations.harbor:CorralEnvironment``
(and Harbor's own ``cwsandbox`` and ``e2b`` environments on corral's front-ends).
The right solution earns 1.0, a broken one 0.0.

Harbor needs Python >= 3.12: the test makes a virtualenv with pyenv's 3.12 (or any
``python3.12``) holding ``harbor==HARBOR_VERSION`` once, cached under
``~/.cache/corral/``, and puts this checkout's ``src`` on its ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
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
# cwsandbox, e2b: for Harbor's own cwsandbox and e2b environments, pointed at corral's front-ends
REQUIREMENTS = (f"harbor=={HARBOR_VERSION}", "cwsandbox==1.22.0", "e2b==2.63.0")
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
    done = venv / ".complete"  # written last, naming what is in: else (re)made
    if done.exists() and done.read_text() == " ".join(REQUIREMENTS):
        return venv
    python = _python312()
    if python is None:
        pytest.skip("Harbor needs Python >= 3.12 and none was found (pyenv 3.12 or python3.12)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() and done.read_text() == " ".join(REQUIREMENTS):
            return venv
        try:
            if not (venv / "bin/pip").exists():
                subprocess.run([python, "-m", "venv", str(venv)], check=True,
                               capture_output=True)
            subprocess.run([str(venv / "bin/pip"), "install", "-q", *REQUIREMENTS],
                           check=True, capture_output=True, timeout=900)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(f"could not install {' '.join(REQUIREMENTS)} into a venv: {exc}")
        done.write_text(" ".join(REQUIREMENTS))
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


def make_task(root: Path, base_ref: str, answer: str, *, prebuilt: bool = False) -> Path:
    """A Harbor task: compute 2+3 into /app/answer.txt; ``answer`` is what solve.sh
    writes. ``prebuilt``: the task names ``docker_image`` (the registry's image, where
    /app/input.txt is made by solve.sh) instead of a Dockerfile. Built from the
    Dockerfile, the expected answer is root's alone and the verifier runs as root
    (Harbor's ``[verifier] user``: honoured, docs/users.md)."""
    for d in ("environment", "tests", "solution"):
        (root / d).mkdir(parents=True)
    (root / "task.toml").write_text(
        'schema_version = "1.4"\n\n[metadata]\n\n[verifier]\ntimeout_sec = 120.0\n\n'
        + ("" if prebuilt else 'user = "root"\n')
        + "\n[agent]\ntimeout_sec = 120.0\n\n[environment]\nbuild_timeout_sec = 600.0\n"
        + (f'docker_image = "{base_ref}"\n' if prebuilt else ""))
    workdir = "/tmp" if prebuilt else "/app"  # the stock image: only /tmp is writable
    (root / "instruction.md").write_text("Write the sum of the numbers in /app/input.txt "
                                         "to /app/answer.txt.\n")
    (root / "environment/Dockerfile").write_text(
        f"FROM {base_ref}\nWORKDIR /app\nRUN echo '2 3' > /app/input.txt\n"
        "RUN mkdir /srv/key && echo 5 > /srv/key/sum && chmod 700 /srv/key\n")
    (root / "solution/solve.sh").write_text(
        "#!/bin/bash\nset -e\n" + (f"echo '2 3' > {workdir}/input.txt\n" if prebuilt else "")
        + f"read a b < {workdir}/input.txt\necho {answer} > {workdir}/answer.txt\n")
    (root / "tests/test.sh").write_text(
        "#!/bin/bash\n"
        f'if [ "$(cat {workdir}/answer.txt 2>/dev/null)" = '
        + ("5" if prebuilt else '"$(cat /srv/key/sum)"') + " ]; then\n"
        "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n")
    return root


def harbor_run(venv: Path, daemon, task: Path, jobs: Path, *, env_arg: str = ENV_IMPORT_PATH,
               extra_env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> float:
    env = {**os.environ, "CORRAL_URL": daemon.url, "PYTHONPATH": str(SRC),
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(extra_env or {})}  # no price fetch
    done = subprocess.run(
        [str(venv / "bin/harbor"), "run", "-p", str(task), "-a", "oracle",
         "--env", env_arg, "-o", str(jobs), "-y", "-n", "1", "-q", *args],
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


def test_harbors_own_cwsandbox_environment_on_corrals_front_end(harbor_venv, base_ref, tmp_path):
    """Harbor's built-in ``cwsandbox`` environment, unmodified, against corral's
    CoreWeave Sandbox front-end: it builds nothing, so the task names its image
    (``docker_image``: a registry reference, pulled by corral)."""
    from tests.server.test_compat_cwsandbox import TOKEN, serving

    with serving() as (daemon, url):
        env = {"CWSANDBOX_BASE_URL": url, "CWSANDBOX_API_KEY": TOKEN}
        try:
            good = make_task(tmp_path / "good" / "cw-task", base_ref, "$((a + b))",
                             prebuilt=True)
            assert harbor_run(harbor_venv, daemon, good, tmp_path / "jobs-good",
                              env_arg="cwsandbox", extra_env=env,
                              args=("--no-force-build",)) == 1.0
            broken = make_task(tmp_path / "broken" / "cw-task", base_ref, "$((a - b))",
                               prebuilt=True)
            assert harbor_run(harbor_venv, daemon, broken, tmp_path / "jobs-broken",
                              env_arg="cwsandbox", extra_env=env,
                              args=("--no-force-build",)) == 0.0
        finally:
            with corral.Client(daemon.url) as client:
                for sb in corral.Sandbox.list(client=client):  # what Harbor left stopping
                    with contextlib.suppress(corral.NotFound):
                        sb.delete()
                with contextlib.suppress(corral.NotFound):
                    corral.Image.get(local_name(base_ref), client=client).delete()
                assert local_name(base_ref) not in {i.name for i in corral.Image.list(
                    client=client)}


def test_harbors_own_e2b_environment_on_corrals_front_end(harbor_venv, base_ref, tmp_path):
    """Harbor's built-in ``e2b`` environment, unmodified, against corral's E2B
    front-end, with ``prebuilt_template_id`` naming the image (Harbor's default path
    builds a template through E2B's build API, which corral does not serve). Its setup
    runs as ``user="root"`` (docs/users.md)."""
    from tests.server.test_compat_e2b import TOKEN, serving

    with serving() as daemon:
        env = {"E2B_API_URL": daemon.endpoint, "E2B_SANDBOX_URL": daemon.endpoint,
               "E2B_API_KEY": TOKEN}
        with corral.Client(daemon.url) as client:
            image = corral.Image.pull(base_ref, insecure=True, client=client)
        args = ("--ek", f"prebuilt_template_id={image.name}")
        try:
            good = make_task(tmp_path / "good" / "e2b-task", base_ref, "$((a + b))",
                             prebuilt=True)
            assert harbor_run(harbor_venv, daemon, good, tmp_path / "jobs-good",
                              env_arg="e2b", extra_env=env, args=args) == 1.0
            broken = make_task(tmp_path / "broken" / "e2b-task", base_ref, "$((a - b))",
                               prebuilt=True)
            assert harbor_run(harbor_venv, daemon, broken, tmp_path / "jobs-broken",
                              env_arg="e2b", extra_env=env, args=args) == 0.0
        finally:
            with corral.Client(daemon.url) as client:
                for sb in corral.Sandbox.list(client=client):
                    with contextlib.suppress(corral.NotFound):
                        sb.delete()
