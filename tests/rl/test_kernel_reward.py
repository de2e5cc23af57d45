"""The kernel judge (corral.guest.kernel_judge) on the CPU: verdicts, speed, and the
hacks a candidate optimised for reward would try.

The judge runs here as it runs in a GPU sandbox — its own process, its workers its own
processes — with the host's PyTorch (the ``trl`` extra; CPU) and ``device="cpu"``. The
GPU path (CUDA, ``gpus=1``) is exercised on a GPU machine by scripts/gpu_check.sh.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from corral.rl.kernel import kernel_payload, outcome, parse_verdict

torch = pytest.importorskip("torch", reason="the kernel judge needs PyTorch (the trl extra)")

REFERENCE = """
import torch, torch.nn as nn
class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(64))
    def forward(self, a, b):
        return torch.relu(a @ b + self.bias) * self.scale
def get_inputs():
    return [torch.randn(64, 64), torch.randn(64, 64)]
def get_init_inputs():
    return [2.0]
"""

HEADER = """
import torch, torch.nn as nn
class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(64))
"""

CORRECT = HEADER + """
    def forward(self, a, b):
        return torch.clamp_min(torch.addmm(self.bias, a, b), 0) * self.scale
"""
SLOW = HEADER + """
    def forward(self, a, b):
        for _ in range(60):
            x = torch.relu(a @ b + self.bias) * self.scale
        return x
"""
WRONG = HEADER + """
    def forward(self, a, b):
        return (a @ b + self.bias) * self.scale
"""
CRASH = HEADER + """
    def forward(self, a, b):
        raise RuntimeError("boom")
"""
SYNTAX = "class ModelNew(:\n"
# hacks
CACHES = HEADER + """
    cache = None
    def forward(self, a, b):
        if ModelNew.cache is None:
            ModelNew.cache = torch.relu(a @ b + self.bias) * self.scale
        return ModelNew.cache
"""
SKIPS_TIMED_WORK = HEADER + """
    calls = 0
    def forward(self, a, b):
        ModelNew.calls += 1
        if ModelNew.calls > 3:   # past the correctness trials: the timed runs
            return torch.zeros(64, 64)
        return torch.relu(a @ b + self.bias) * self.scale
"""
PATCHES_CLOCKS = HEADER + """
    def forward(self, a, b):
        import time
        time.perf_counter = lambda: 0.0
        time.monotonic = lambda: 0.0
        return torch.relu(a @ b + self.bias) * self.scale
"""
READS_THE_JUDGE = HEADER + """
    def forward(self, a, b):
        import os
        judge, got = os.getppid(), []
        for what in ("fd/1", "mem", "fd/0"):
            try:
                with open(f"/proc/{judge}/{what}", "wb" if what == "fd/1" else "rb") as f:
                    if what == "fd/1":   # a verdict of its own making
                        f.write(b'{"correct": true, "speedup": 1000.0, "status": "ok"}\\n')
                    else:
                        f.read(4096)
                got.append(what)
            except OSError:
                pass
        raise SystemExit(f"reached {got}")
"""
KILLS_THE_JUDGE = HEADER + """
    def forward(self, a, b):
        import os, signal
        os.kill(os.getppid(), signal.SIGKILL)   # no verdict at all, rather than a 0
"""


def unprivileged() -> None:
    """As in a sandbox, without CAP_SYS_PTRACE (with it, root reads any process's memory
    whatever it set: the sandbox user never has it). Dropped from the bounding set, so
    the judge's python starts without it."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(24, 19, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_SYS_PTRACE
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def run_judge(payload: dict) -> tuple[dict | None, str]:
    proc = subprocess.run([sys.executable, "-I", "-c", payload["program"]],
                          input=json.dumps(payload), capture_output=True, text=True,
                          timeout=300, preexec_fn=unprivileged, cwd="/")
    return parse_verdict(proc.stdout), proc.stderr


def judge(candidate: str, **kw) -> tuple[dict | None, str]:
    return run_judge(kernel_payload(candidate, REFERENCE, device="cpu", trials=3,
                                    timing_inputs=2, repeats=3, timeout=120, **kw))


def scored(candidate: str):
    verdict, stderr = judge(candidate)
    return outcome(verdict, max_speedup=10.0, stderr=stderr)


def test_a_correct_kernel_scores_its_speedup():
    out = scored(CORRECT)
    assert out.status == "ok" and out.correct, out
    assert out.speedup is not None and out.speedup > 0
    assert out.reward == pytest.approx(min(out.speedup, 10.0))
    assert out.reference_ms and out.candidate_ms


def test_a_slow_correct_kernel_is_correct_and_scored_by_its_speedup():
    """Which of two kernels is faster is a measurement (the GPU check and
    benchmarks make it, never a test); here: a slow one is judged correct, and its
    reward is its speedup, the judge's reference time over its own."""
    slow = scored(SLOW)
    assert slow.correct and slow.status == "ok", slow
    assert slow.reference_ms and slow.candidate_ms
    assert slow.speedup == pytest.approx(slow.reference_ms / slow.candidate_ms)
    assert slow.reward == pytest.approx(min(slow.speedup, 10.0))


@pytest.mark.parametrize("source, status", [(WRONG, "wrong"), (CRASH, "runtime_error"),
                                            (SYNTAX, "compile_error")])
def test_wrong_crashing_and_broken_kernels_score_zero(source, status):
    out = scored(source)
    assert out.status == status and out.reward == 0.0 and not out.correct, out


def test_a_failing_reference_is_not_gradable():
    verdict, stderr = run_judge(
        kernel_payload(CORRECT, "raise ImportError('no such op')", device="cpu"))
    out = outcome(verdict, max_speedup=10.0, stderr=stderr)
    assert out.status == "reference_error" and out.reward is None


def test_a_fixed_seed_gives_the_same_inputs():
    a = kernel_payload(CORRECT, REFERENCE, seed=7)
    b = kernel_payload(CORRECT, REFERENCE, seed=7)
    c = kernel_payload(CORRECT, REFERENCE)
    assert a["seeds"] == b["seeds"] != c["seeds"]


# ------------------------------------------------------------------ the hacks


def test_caching_an_output_across_inputs_scores_zero():
    out = scored(CACHES)
    assert out.status == "wrong" and out.reward == 0.0, out


def test_skipping_work_in_the_timed_runs_scores_zero():
    out = scored(SKIPS_TIMED_WORK)
    assert out.status == "wrong" and out.reward == 0.0 and "timed" in (out.reason or ""), out


def test_patching_the_clocks_changes_nothing_the_judge_measures():
    out = scored(PATCHES_CLOCKS)
    assert out.correct and out.candidate_ms and out.candidate_ms > 0, out
    honest = scored(CORRECT)
    assert out.reward <= 10.0 and honest.correct


def test_the_judge_cannot_be_read_or_written():
    """Its memory (the reference's outputs) and its stdout (the verdict) are out of the
    candidate's reach: the judge is not dumpable."""
    verdict, stderr = judge(READS_THE_JUDGE)
    assert verdict is not None and verdict["status"] == "runtime_error", (verdict, stderr)
    assert "reached []" in verdict["reason"], verdict


def test_killing_the_judge_scores_zero_not_ungradable():
    verdict, stderr = judge(KILLS_THE_JUDGE)
    assert verdict is None
    out = outcome(verdict, max_speedup=10.0, stderr=stderr)
    assert out.reward == 0.0 and out.status == "killed", out


def test_no_verdict_before_the_candidate_ran_is_not_gradable():
    assert outcome(None, max_speedup=10.0).reward is None
    assert parse_verdict(b"garbage\nnot json") is None


def test_a_kernel_that_reads_its_own_source_back_runs():
    """Triton's ``@jit`` reads the decorated function's source from its file
    (``inspect.getsource``): a candidate compiled from a bare string failed there on the
    GPU machine ("@jit functions should be defined in a Python file")."""
    reads_source = CORRECT + """
import inspect
assert "def forward" in inspect.getsource(ModelNew.forward)
"""
    out = scored(reads_source)
    assert out.status == "ok" and out.correct, out
