"""The SDK installs where a training job runs (issue 25, item 2).

The wheel and the sdist are built from this checkout and pass ``twine check``; the
wheel declares lower bounds only (no ``==``), ships ``py.typed``, and in fresh
virtualenvs runs the SDK contract (``sdk_contract.py``: create, exec, files, delete,
sync and asyncio) and the CLI against a real daemon:

- Python 3.10 with the *oldest* versions its metadata allows (``pip --constraint``
  pinning each lower bound), and the versions checked to be those;
- Python 3.13 with the newest;
- the README's install line, run as written, on Python 3.12.

pip fetches from the package index (its cache makes a second run quick): about a
minute in all. The pyenv interpreters are looked up under ``~/.pyenv/versions``; a
missing one skips its test with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import requires_root

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = Path(__file__).with_name("sdk_contract.py")
PYENV = Path.home() / ".pyenv" / "versions"

pytestmark = pytest.mark.timeout(900)


def _pyenv(minor: int) -> Path:
    found = sorted(PYENV.glob(f"3.{minor}.*/bin/python3"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p.parts[-3])])
    if not found:
        pytest.skip(f"no Python 3.{minor} under {PYENV} (pyenv install 3.{minor})")
    return found[-1]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what points Python or corral at this checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "CORRAL_URL", "CORRAL_TOKEN", "VIRTUAL_ENV")}
    return {**env, **extra}


def _run(argv: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("env", _clean_env())
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600,
                       **kwargs)
    assert p.returncode == 0, f"{shlex.join(map(str, argv))}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The sdist, and the wheel built from it (as ``python -m build`` does)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "-o", out, ROOT])
    wheel, = out.glob("corral-*.whl")
    sdist, = out.glob("corral-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def test_wheel_and_sdist_pass_twine_check(dist):
    out = _run([sys.executable, "-m", "twine", "check", "--strict", dist["wheel"], dist["sdist"]])
    assert out.stdout.count("PASSED") == 2, out.stdout


def test_the_wheel_states_lower_bounds_and_ships_its_types_and_data(dist):
    meta = _metadata(dist["wheel"])
    assert meta["Requires-Python"] == ">=3.10"
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    pinned = [str(r) for r in requires if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == [], f"exact pins keep the SDK out of training environments: {pinned}"
    core = {r.name.lower().replace("_", "-") for r in requires if r.marker is None
            or "extra" not in str(r.marker)}
    # the daemon, RL, TRL, Ray and compat stacks are extras, never the SDK's own
    assert not core & {"starlette", "uvicorn", "torch", "transformers", "trl", "ray",
                       "numpy", "gymnasium", "e2b", "grpcio"}, core
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
    assert {"corral/py.typed", "corral/runtime/agent/agent.c",
            "corral/server/ui/templates/base.html"} <= names


def _lower_bounds(wheel: Path, python: Path) -> dict[str, str]:
    """``{name: oldest version}`` of the wheel's core dependencies on ``python``."""
    env_json = _run([python, "-c", "import json, platform, sys; print(json.dumps({"
                     "'python_version': '%d.%d' % sys.version_info[:2], "
                     "'python_full_version': platform.python_version()}))"]).stdout
    env = {**default_environment(), **__import__("json").loads(env_json), "extra": ""}
    bounds = {}
    for line in _metadata(wheel).get_all("Requires-Dist"):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert lower, f"{line}: every dependency states its oldest version"
        bounds[req.name.lower().replace("_", "-")] = lower[0]
    return bounds


def _venv(python: Path, where: Path) -> Path:
    _run([python, "-m", "venv", where])
    return where / "bin"


def _installed(bin_dir: Path) -> dict[str, str]:
    out = _run([bin_dir / "python", "-m", "pip", "list", "--format=freeze"]).stdout
    return {n.lower().replace("_", "-"): v for n, _, v in
            (line.partition("==") for line in out.splitlines() if "==" in line)}


def _contract(bin_dir: Path, daemon, cwd: Path, home: Path | None = None) -> str:
    """Run the SDK contract and a CLI command with the venv's own Python and script;
    corral must come from ``home`` (default: the venv's own site-packages)."""
    env = _clean_env(CORRAL_URL=daemon.url)
    out = _run([bin_dir / "python", CONTRACT], env=env, cwd=cwd).stdout
    where = out.split("corral from ", 1)[1].strip()
    assert "contract ok" in out and where.startswith(str(home or bin_dir.parent)), out
    ls = _run([bin_dir / "corral", "ls", "--json"], env=env, cwd=cwd)
    assert ls.stdout.lstrip().startswith("[")
    return out


def _unavailable_daemon_says_what_to_install(bin_dir: Path, cwd: Path) -> str:
    """With no daemon anywhere, an SDK-only install says what to install."""
    env = _clean_env(CORRAL_SOCKET=str(cwd / "nothing-here.sock"))
    p = subprocess.run([bin_dir / "python", "-c", "import corral; corral.Sandbox.create()"],
                       capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert p.returncode != 0
    return p.stderr


@requires_root
def test_oldest_allowed_dependencies_on_python_310(dist, daemon, tmp_path):
    python = _pyenv(10)
    bounds = _lower_bounds(dist["wheel"], python)
    assert {"pydantic", "httpx", "exceptiongroup"} <= set(bounds)
    constraints = tmp_path / "oldest.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in bounds.items()))
    bin_dir = _venv(python, tmp_path / "venv")
    _run([bin_dir / "python", "-m", "pip", "install", "-q", "-c", constraints, dist["wheel"]],
         cwd=tmp_path)
    installed = _installed(bin_dir)
    oldest = {n: Version(v) for n, v in bounds.items()}
    assert {n: Version(installed.get(n, "0")) for n in bounds} == oldest  # the oldest, really
    out = _contract(bin_dir, daemon, tmp_path)
    assert "python 3.10" in out
    err = _unavailable_daemon_says_what_to_install(bin_dir, tmp_path)
    assert "DaemonUnavailable" in err and "Python 3.11 or newer" in err, err[-2000:]


@requires_root
def test_newest_dependencies_on_python_313(dist, daemon, tmp_path):
    python = _pyenv(13)
    bin_dir = _venv(python, tmp_path / "venv")
    _run([bin_dir / "python", "-m", "pip", "install", "-q", "--upgrade", dist["wheel"]],
         cwd=tmp_path)
    bounds = _lower_bounds(dist["wheel"], python)
    installed = _installed(bin_dir)
    assert set(bounds) <= set(installed)
    assert "python 3.13" in _contract(bin_dir, daemon, tmp_path)
    err = _unavailable_daemon_says_what_to_install(bin_dir, tmp_path)
    assert "pip install 'corral[daemon]'" in err, err[-2000:]


def _readme_install_line() -> str:
    """The first ``pip install`` command of the README's shell blocks."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command.startswith("pip install"):
                return command
    raise AssertionError("README.md shows no `pip install` line in a shell block")


@requires_root
def test_the_readme_install_line_works_as_written(daemon, tmp_path):
    line = _readme_install_line()
    bin_dir = _venv(_pyenv(12), tmp_path / "venv")
    env = _clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", VIRTUAL_ENV=str(bin_dir.parent))
    _run(["sh", "-c", f"{line} -q"], cwd=ROOT, env=env)  # from the checkout's root, as written
    assert "python 3.12" in _contract(bin_dir, daemon, tmp_path, home=ROOT / "src")
