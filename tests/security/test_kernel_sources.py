"""Red-team: the kernel judge compiles each model from a file of its own (Triton's
``@jit`` reads its source back), and the candidate runs as the same uid in the same
sandbox. It looks for the other models' files — the reference's (gone with its worker,
before the candidate starts) and the input maker's (alive all through the candidate's
runs) — to read them or rewrite the maker's. None is there while it runs, and the judge
leaves no model's file behind. (CPU, the host's PyTorch, a private ``TMPDIR``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from corral.rl.kernel import kernel_payload, outcome, parse_verdict
from tests.rl.test_kernel_reward import CORRECT, REFERENCE, unprivileged

pytest.importorskip("torch", reason="the kernel judge needs PyTorch (the trl extra)")

LOOKS = """
import glob as _glob, os as _os, tempfile as _tempfile

def _look(when):
    found = []
    for path in _glob.glob(_os.path.join(_tempfile.gettempdir(), "corral-*", "*")):
        if _os.path.basename(path) == "candidate.py":
            continue
        try:
            with open(path) as f:
                found.append((path, len(f.read())))
            with open(path, "a") as f:  # rewrite the maker's: its get_inputs is asked again
                f.write("\\ndef get_inputs():\\n    return []\\n")
        except OSError:
            pass
    with open(SEEN, "a") as f:
        f.write(f"{when} {found!r}\\n")

_look("load")
"""
FORWARD_LOOKS = CORRECT.replace(
    "    def forward(self, a, b):\n",
    "    def forward(self, a, b):\n        _look('forward')\n", 1)


def test_the_candidate_finds_no_other_models_source(tmp_path):
    assert "_look('forward')" in FORWARD_LOOKS
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o777)
    seen = tmp_path / "seen"
    seen.touch(mode=0o666)
    tmp_path.chmod(0o777)
    candidate = f"SEEN = {str(seen)!r}\n" + LOOKS + FORWARD_LOOKS
    payload = kernel_payload(candidate, REFERENCE, device="cpu", trials=2,
                             timing_inputs=1, repeats=1, timeout=120)
    proc = subprocess.run([sys.executable, "-I", "-c", payload["program"]],
                          input=json.dumps(payload), capture_output=True, text=True,
                          timeout=300, preexec_fn=unprivileged, cwd="/",
                          env={**os.environ, "TMPDIR": str(tmp)})
    out = outcome(parse_verdict(proc.stdout), max_speedup=10.0, stderr=proc.stderr)
    assert out.correct, (out, proc.stderr[-2000:])  # the maker's inputs were not rewritten
    looks = seen.read_text().splitlines()
    assert looks[0].startswith("load") and any(x.startswith("forward") for x in looks)
    assert all(x.endswith(" []") for x in looks), looks  # no reference or maker file seen
    assert list(tmp.iterdir()) == []  # and no model's file left behind
