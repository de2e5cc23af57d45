"""Every code block of the README and of docs/ is run here, against a real daemon, or
checked (Python compiles, YAML parses, every ``corral`` command a block names exists,
the image spec is a valid spec), or listed with the reason it cannot run in a test: a
new shell block that is none of these fails, so the docs cannot drift from the code."""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from corral.cli.main import build_parser
from corral.image_schema import parse_build_yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CORRAL = [sys.executable, "-m", "corral.cli.main"]

SDK_BLOCK = "import corral\n\nwith corral.Sandbox.create(memory_mb=512"  # README.md
RL_BLOCK = "import corral.rl as rl\n"  # docs/rl.md
CLI_BLOCK = "id=$(corral create"  # docs/cli.md
FUSION_BLOCK = "from sandbox_fusion import"  # docs/sandboxfusion.md
E2B_BLOCK = "from e2b import Sandbox"  # docs/e2b.md
NOT_RUN = {  # first line of a shell block no test runs as written -> why
    "make demo": "installs everything and runs the whole suite: it is how tests run",
    "pip install -e .": "run as written, in a fresh virtualenv, by tests/packaging/test_install.py",
    "corral serve --tcp 127.0.0.1:7070": "needs the tensorlake client and your script; "
    "tests/server/test_compat_tensorlake.py covers the front-end",
    "corral serve --grpc 127.0.0.1:7072": "needs the cwsandbox client; "
    "tests/server/test_compat_cwsandbox.py covers the front-end",
}


def blocks(lang: str | None = None) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of the README and docs/, in order."""
    found = [b for page in PAGES
             for b in re.findall(r"^```(\w*)\n(.*?)^```$", page.read_text(), re.S | re.M)]
    return [(lng, text) for lng, text in found if lang is None or lng == lang]


def block(lang: str, start: str) -> str:
    (text,) = [t for lng, t in blocks(lang) if t.startswith(start)]
    return text


def test_every_block_is_run_checked_or_excused():
    runnable = (SDK_BLOCK, RL_BLOCK, CLI_BLOCK, FUSION_BLOCK, E2B_BLOCK, *NOT_RUN)
    for lang, text in blocks():
        if lang == "sh":
            assert text.startswith(runnable), f"a sh block run by no test:\n{text}"
        else:  # Python, syntax, a spec, or a picture: each kind has its check below
            assert lang in ("python", "text", "yaml", ""), f"a block of unknown kind {lang!r}"


def test_python_blocks_compile_and_yaml_blocks_parse():
    for lang, text in blocks():
        if lang == "python":
            compile(text, "<docs>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        elif lang == "yaml":
            yaml.safe_load(text)


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


def _named_commands() -> list[list[str]]:
    """Each ``corral ...`` line of the text and shell blocks, as the words naming its
    command (``pause|resume|stop`` expanded)."""
    commands = []
    for lang, text in blocks():
        for line in text.splitlines() if lang in ("text", "sh") else ():
            if not line.startswith("corral "):
                continue
            words = []
            for word in line.split("#")[0].split()[1:]:
                if not re.fullmatch(r"[a-z|]+", word):
                    break
                words.append(word)
            *head, last = words or [""]
            commands += [[*head, verb] for verb in last.split("|")]
    return commands


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)), {})


def test_docs_name_real_commands():
    commands = _named_commands()
    assert ["daemon", "stop"] in commands and ["inspect"] in commands and ["rm"] in commands
    for words in commands:
        parser = build_parser()
        for i, word in enumerate(words):
            choices = _subcommands(parser)
            if not choices:  # the rest are the command's own arguments
                break
            assert word in choices, f"`corral {' '.join(words[:i + 1])}` is no command"
            parser = choices[word]


def test_the_cli_page_names_every_command():
    page = (ROOT / "docs" / "cli.md").read_text()
    named = {verb for verbs in re.findall(r"^corral ([a-z|]+)", page, re.M)
             for verb in verbs.split("|")}
    assert set(_subcommands(build_parser())) <= named, "docs/cli.md lacks a command"


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
    spec = parse_build_yaml(block("yaml", "name: my-env\nbase: rl\n"), source="docs/images.md")
    assert spec.name == "my-env" and len(spec.steps) == 5
    assert [getattr(s, "as_root", False) for s in spec.steps] == [False, True, False, False, False]


@pytest.mark.parametrize("phrase", ["pip install 'corral[", "corral rm --tag job=42\n"])
def test_docs_have_no_known_dead_ends(phrase):
    for page in PAGES:
        assert phrase not in page.read_text(), page.name
