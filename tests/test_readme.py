"""The README's SDK and RL examples run as written, against a real daemon."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_sdk_example_runs(daemon):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    env = {**os.environ, "CORRAL_URL": daemon.url}
    proc = subprocess.run(
        [sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "0 42 False"
    assert lines[1] == "hi"
    assert any(line.startswith("pip ") for line in lines)
    assert lines[-1] == "[]"


def test_readme_rl_example_runs(daemon, tmp_path):
    block = re.search(
        r"^```python\n(import corral.rl as rl\n.*?)^```", README.read_text(), re.S | re.M
    )
    env = {**os.environ, "CORRAL_URL": daemon.url, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", block.group(1)], env=env, capture_output=True, text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[1.0, 0.0]", "20 0 True", "(4,) Discrete(2)"]
