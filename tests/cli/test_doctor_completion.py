"""``corral doctor`` (a real subprocess, with bubblewrap hidden from PATH or not) and
``corral completion`` (the script loaded and used by a real bash)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corral.cli._completion import script
from corral.cli.main import build_parser
from tests.conftest import have_root_runtime

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _corral(*args: str, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": SRC, "CORRAL_NO_EMBED": "1", **env}
    if path is not None:
        full_env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "corral.cli.main", *args],
                          capture_output=True, text=True, env=full_env, timeout=120)


def _path_without(program: str, tmp_path: Path) -> str:
    """PATH with every directory holding ``program`` replaced by a copy without it."""
    dirs = []
    for i, d in enumerate(os.environ.get("PATH", "").split(os.pathsep)):
        if d and (Path(d) / program).exists():
            shadow = tmp_path / f"bin{i}"
            shadow.mkdir()
            for entry in Path(d).iterdir():
                if entry.name != program:
                    (shadow / entry.name).symlink_to(entry)
            d = str(shadow)
        dirs.append(d)
    return os.pathsep.join(dirs)


def test_doctor_names_a_missing_bubblewrap_and_fails(tmp_path):
    path = _path_without("bwrap", tmp_path)
    assert shutil.which("bwrap", path=path) is None
    run = _corral("--url", f"unix://{tmp_path}/none.sock", "doctor", path=path)
    assert run.returncode == 1, run.stdout + run.stderr
    line = next(ln for ln in run.stdout.splitlines() if "bubblewrap" in ln)
    assert line.startswith("FAIL")
    assert "apt-get install bubblewrap" in run.stdout
    assert "check(s) failed: bubblewrap" in run.stdout
    checks = json.loads(_corral("--url", f"unix://{tmp_path}/none.sock", "doctor", "--json",
                                path=path).stdout)
    (bw,) = [c for c in checks if c["name"] == "bubblewrap"]
    assert bw["status"] == "FAIL" and "bubblewrap" in bw["fix"]
    daemon = [c for c in checks if c["name"] == "daemon"][0]
    assert daemon["status"] == "WARN" and "none.sock" in daemon["detail"]
    assert not (tmp_path / "none.sock").exists()  # doctor never starts a daemon


def test_doctor_passes_on_a_healthy_machine_with_its_daemon(daemon):
    if not have_root_runtime():
        pytest.skip("a healthy machine: root, bubblewrap, cgroups")
    run = _corral("--url", daemon.url, "doctor", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    checks = {c["name"]: c for c in json.loads(run.stdout)}
    assert {"kernel", "user namespaces", "overlayfs", "cgroups", "seccomp", "bubblewrap",
            "agent", "images", "state dir", "cache dir", "memory", "daemon"} <= set(checks)
    assert not [c for c in checks.values() if c["status"] == "FAIL"]
    assert checks["daemon"]["status"] == "OK" and "version" in checks["daemon"]["detail"]


def test_doctor_probes_report_how_to_fix(tmp_path):
    from corral.runtime import doctor

    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "max_user_namespaces").write_text("0\n")
    check = doctor.user_namespaces(str(tmp_path))
    assert check.status == "FAIL" and "sysctl -w user.max_user_namespaces" in (check.fix or "")
    (tmp_path / "filesystems").write_text("nodev\ttmpfs\n\text4\n")
    assert doctor.overlayfs(str(tmp_path / "filesystems")).status in ("FAIL", "WARN")
    (tmp_path / "mountinfo").write_text("")
    check = doctor.cgroup_controllers(str(tmp_path / "mountinfo"))
    assert check.status == "FAIL" and check.fix
    assert doctor.kernel("5.4.0-100-generic").status == "FAIL"
    assert doctor.kernel("6.1.0-13-amd64").status == "OK"


def test_bash_completion_script_loads_and_completes(tmp_path):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    run = _corral("completion", "bash")
    assert run.returncode == 0, run.stderr
    file = tmp_path / "corral.bash"
    file.write_text(run.stdout)
    assert subprocess.run([bash, "-n", str(file)], capture_output=True).returncode == 0
    probe = f"""
source {file}
complete -p corral
complete_words() {{ COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _corral; echo "${{COMPREPLY[*]}}"; }}
complete_words corral do
complete_words corral pool c
complete_words corral --url unix:///x.sock snapshot l
complete_words corral exec sb-1 --ti
complete_words corral lo
"""
    out = subprocess.run([bash, "--norc", "-c", probe], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "complete -o bashdefault -o default -F _corral corral"
    assert lines[1:] == ["doctor", "create", "ls", "--timeout", "logs"]


def test_completion_follows_the_parser():
    text = script(build_parser(), "bash")
    for command in ("logs", "timeout", "doctor", "completion", "snapshot create"):
        assert f'"{command}"' in text
    fish = script(build_parser(), "fish")
    assert "-a doctor" in fish and "-l follow" in fish
    zsh = script(build_parser(), "zsh")
    assert zsh.startswith("#compdef corral") and "bashcompinit" in zsh


def test_doctor_checks_the_running_daemons_directories(daemon):
    if not have_root_runtime():
        pytest.skip("a healthy machine: root, bubblewrap, cgroups")
    run = _corral("--url", daemon.url, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(run.stdout)}
    state = str(daemon.state_dir.absolute())
    assert checks["state dir"]["detail"].endswith(f"under {state}"), checks["state dir"]
    assert f"state {state}" in checks["daemon"]["detail"]
