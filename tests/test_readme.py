"""Every code block of the README is run here, against a real daemon, or checked (syntax
summaries name real commands, the image spec parses), or listed with the reason it
cannot run in a test: a new block that is none of these fails, so the docs cannot
drift from the code."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from corral.image_schema import parse_build_yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CORRAL = [sys.executable, "-m", "corral.cli.main"]

SDK_BLOCK = "import corral\n\nwith corral.Sandbox.create("
RL_BLOCK = "import corral.rl as rl\n"
CLI_BLOCK = "id=$(corral create"
FUSION_BLOCK = "from sandbox_fusion import"
E2B_BLOCK = "from e2b import Sandbox"
NOT_RUN = {  # first line of a runnable-looking block -> why no test runs it
    "make demo": "installs everything and runs the whole suite: it is how tests run",
    "pip install -e .": "run as written, in a fresh virtualenv, by tests/packaging/test_install.py",
    "corral serve --tcp 127.0.0.1:7070": "needs the tensorlake client and your script; "
    "tests/server/compat covers the front-end",
    "corral serve --grpc 127.0.0.1:7072": "needs the cwsandbox client; tests/server/compat "
    "covers the front-end",
}


def blocks(lang: str | None = None) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block, in order."""
    found = re.findall(r"^```(\w*)\n(.*?)^```$", README.read_text(), re.S | re.M)
    return [(lng, text) for lng, text in found if lang is None or lng == lang]


def block(lang: str, start: str) -> str:
    (text,) = [t for lng, t in blocks(lang) if t.startswith(start)]
    return text


def test_every_block_is_run_checked_or_excused():
    runnable = (SDK_BLOCK, RL_BLOCK, CLI_BLOCK, FUSION_BLOCK, E2B_BLOCK, *NOT_RUN)
    for lang, text in blocks():
        if lang in ("python", "sh"):
            assert text.startswith(runnable), f"README {lang} block run by no test:\n{text}"
        else:  # syntax, a spec, or a picture: each kind has its check below
            assert lang in ("text", "yaml", ""), f"README block of unknown kind {lang!r}"


def _run(code: str, env: dict[str, str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(code, env=env, capture_output=True, text=True, **kwargs)


def test_readme_sdk_example_runs(daemon):
    env = {**os.environ, "CORRAL_URL": daemon.url}
    proc = _run([sys.executable, "-c", block("python", SDK_BLOCK)], env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "0 42 False"
    assert lines[1] == "hi"
    assert any(line.startswith("pip ") for line in lines)
    assert lines[-1] == "[]"


def test_readme_rl_example_runs(daemon, tmp_path):
    env = {**os.environ, "CORRAL_URL": daemon.url, "XDG_CACHE_HOME": str(tmp_path)}
    proc = _run([sys.executable, "-c", block("python", RL_BLOCK)], env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[1.0, 0.0]", "20 0 True", "(4,) Discrete(2)"]


def test_readme_cli_session_runs(daemon, tmp_path):
    """The CLI session, line by line as a user would paste it, with ``corral`` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "corral"
    shim.write_text(f"#!/bin/sh\nexec {shlex.join(CORRAL)} \"$@\"\n")
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "CORRAL_URL": daemon.url, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = "set -eu\n" + block("sh", CLI_BLOCK)
    proc = _run(["bash", "-c", script], env, cwd=work, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    sandbox_id = lines[2]
    assert lines[:2] == ["42", "hi"] and sandbox_id.startswith("sb-")
    assert lines[3:] == [sandbox_id, sandbox_id, sandbox_id, "deleted 1 sandboxes"]
    assert (work / "app" / "solution.py").read_text() == 'print("hi")\n'
    assert '"memory_mb": 256' in (work / "sandbox.json").read_text()


def _syntax_commands() -> list[list[str]]:
    """Each ``corral ...`` line of the syntax blocks, as the words naming its command
    (``pause|resume|stop`` expanded)."""
    commands = []
    for _, text in blocks("text"):
        for line in text.splitlines():
            if not line.startswith("corral "):
                continue
            words = []
            for word in line.split("#")[0].split()[1:]:
                if not re.fullmatch(r"[a-z|]+", word):
                    break
                words.append(word)
            *head, last = words
            commands += [[*head, verb] for verb in last.split("|")]
    return commands


def test_readme_syntax_names_real_commands():
    commands = _syntax_commands()
    assert ["daemon", "stop"] in commands and ["inspect"] in commands and ["rm"] in commands
    for words in commands:
        proc = _run([*CORRAL, *words, "-h"], dict(os.environ), timeout=60)
        assert proc.returncode == 0, (words, proc.stderr)


def test_readme_sandboxfusion_example_runs():
    """The SandboxFusion block, with only SANDBOX_FUSION_ENDPOINT pointing at a daemon."""
    pytest.importorskip("sandbox_fusion", reason="the compat extra is not installed")
    from tests.server.test_compat_sandboxfusion import serving

    with serving() as d:
        env = {**os.environ, "SANDBOX_FUSION_ENDPOINT": d.endpoint}
        proc = _run([sys.executable, "-c", block("python", FUSION_BLOCK)], env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Success 'cba\\n'\n"


def test_readme_e2b_example_runs():
    """The E2B block, with only the three E2B variables pointing at a daemon."""
    pytest.importorskip("e2b", reason="the compat extra is not installed")
    from tests.server.test_compat_e2b import TOKEN, serving

    with serving() as d:
        env = {"PATH": os.environ["PATH"], "E2B_API_URL": d.endpoint,
               "E2B_SANDBOX_URL": d.endpoint, "E2B_API_KEY": TOKEN}
        proc = _run([sys.executable, "-c", block("python", E2B_BLOCK)], env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "42\n\n"


def test_readme_image_spec_parses():
    spec = parse_build_yaml(block("yaml", "name: my-env"), source="README.md")
    assert spec.name == "my-env" and len(spec.steps) == 5
    assert [getattr(s, "as_root", False) for s in spec.steps] == [False, True, False, False, False]


@pytest.mark.parametrize("phrase", ["pip install 'corral[", "corral rm --tag job=42\n"])
def test_readme_has_no_known_dead_ends(phrase):
    assert phrase not in README.read_text()
