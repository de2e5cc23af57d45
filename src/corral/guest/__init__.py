"""Programs that run inside a sandbox, shipped as files.

Everything here is executed by the *image's* ``python3`` (Debian 12's 3.11 in the
default image), not by the host's interpreter: standard library only (but for what a
program imports from its image, listed in the test), nothing of
corral outside this package (an import-linter contract and
``tests/guest/test_guest_stdlib.py`` hold both), no syntax newer than 3.11.

- :mod:`corral.guest.confine`: what every judge does first (non-dumpable, alone).
- :mod:`corral.guest.judge_wire` + :mod:`corral.guest.judge_solution` +
  :mod:`corral.guest.judge`: the Python test judge (``assert`` tests, HumanEval's
  ``check``), sent with ``confine`` as one ``python3 -I -c`` program.
- :mod:`corral.guest.io_judge`: the stdin/stdout judge (compile once, run every test
  case under time and memory limits, compare or call a checker), with
  :mod:`corral.guest.case_memory` (what one case holds in memory, all of it).
- :mod:`corral.guest.harness`: the weaker in-process harness (docs/grading.md).
- :mod:`corral.guest.kernel_judge`: the GPU kernel judge (docs/gpus.md); it imports the
  image's PyTorch inside its functions.
- :mod:`corral.guest.fusion_kernel`: SandboxFusion's ``/run_jupyter`` cell runner.
- :mod:`corral.guest.e2b_kernel`: the E2B Code Interpreter's kernel (matplotlib, when
  the image has it, inside its functions); :mod:`corral.guest.e2b_watcher`: the
  inotify watcher behind E2B's ``watch_dir``.
- :mod:`corral.guest.env_server`: the gymnasium environment server behind
  :class:`corral.rl.SandboxEnv` (the image's gymnasium and the uploaded codec,
  ``corral.rl.spaces``, inside its functions).

The host reads a program's text with :func:`program`; the pieces are concatenated in
the order given (a later piece sees the names of an earlier one, as the judge sees the
wire's), so a guest module imports its siblings only under ``if __name__ ...`` guards
that are false in the sandbox.
"""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def program(*modules: str) -> str:
    """The source text of the guest modules ``modules`` (names without ``.py``), joined
    into one program for ``python3 -I -c``."""
    base = resources.files(__name__)
    return "\n".join((base / f"{name}.py").read_text(encoding="utf-8") for name in modules)


__all__ = ["program"]
