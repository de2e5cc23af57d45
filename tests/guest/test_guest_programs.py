"""The guest package (corral.guest): standard library only, and every program it
ships compiles and starts under the *image's* own ``python3``, not the host's."""

from __future__ import annotations

import ast
import sys
from importlib import resources

import pytest

import corral
from corral.guest import program
from tests.conftest import requires_root

GUEST = resources.files("corral.guest")
MODULES = sorted(p.name[:-3] for p in GUEST.iterdir() if p.name.endswith(".py"))
PROGRAMS = {
    "python judge": ("confine", "judge_wire", "judge_solution", "judge"),
    "stdin/stdout judge": ("confine", "case_memory", "io_judge"),
    "in-process harness": ("harness",),
    "kernel judge": ("kernel_judge",),
    "SandboxFusion's run_jupyter cell runner": ("fusion_kernel",),
    "E2B Code Interpreter kernel": ("e2b_kernel",),
    "E2B watch_dir watcher": ("e2b_watcher",),
    "gymnasium env server": ("env_server",),
}
# What a program may import from its image besides the standard library, and only
# inside a function (the GPU image's PyTorch for the kernel judge).
IMAGE_PACKAGES = {"kernel_judge": {"torch"}, "e2b_kernel": {"matplotlib"},
                  "env_server": {"gymnasium", "_corral_spaces"}}


@pytest.mark.parametrize("name", MODULES)
def test_a_guest_module_imports_only_the_standard_library(name):
    tree = ast.parse((GUEST / f"{name}.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots = [node.module or ""]
        else:
            continue
        for root in roots:
            if root.startswith("corral.guest") or root == "__future__":
                continue
            if root.split(".")[0] in IMAGE_PACKAGES.get(name, ()):
                assert node.col_offset > 0, f"{name}: imports {root} at its top level"
                continue
            assert root.split(".")[0] in sys.stdlib_module_names, f"{name}: imports {root}"


def test_every_guest_module_is_part_of_a_program():
    used = {m for parts in PROGRAMS.values() for m in parts} | {"__init__"}
    assert set(MODULES) == used


@requires_root
def test_the_programs_compile_and_start_under_the_images_python(daemon):
    with corral.Client(daemon.url) as client, corral.Sandbox.create(client=client) as sb:
        version = sb.exec(["python3", "-c", "import sys; print(sys.version_info[:2])"]).stdout
        for name, parts in PROGRAMS.items():
            sb.files.write("/tmp/prog.py", program(*parts))
            r = sb.exec(["python3", "-I", "-c",
                         "import ast; compile(open('/tmp/prog.py').read(), 'p', 'exec')"])
            assert r.returncode == 0, (name, version, r.stderr)
        # Loaded as a module (not as __main__), the stdin/stdout judge's comparisons
        # work under the image's interpreter.
        sb.files.write("/tmp/prog.py", program("confine", "case_memory", "io_judge"))
        r = sb.exec(["python3", "-I", "-c",
                     "ns = {'__name__': 'guest'}; exec(open('/tmp/prog.py').read(), ns); "
                     "c = ns['compare']; print(c('float', '1.0000001 x', '1 x', 1e-6)[0], "
                     "c('tokens', '1  2', '1 3', 0)[0], c('lines', 'a \\n\\n', 'a', 0)[0])"])
        assert r.stdout.split() == ["AC", "WA", "AC"], (version, r.stdout, r.stderr)
