"""Kernel rewards: a candidate CUDA/Triton/PyTorch kernel, judged for correctness and
timed against a reference in a GPU sandbox, in a way the candidate cannot game.

The task is KernelBench's shape: the ``reference`` source defines ``Model`` (an
``nn.Module``), ``get_inputs()`` and ``get_init_inputs()``; the ``candidate`` defines
``ModelNew``, a drop-in replacement (custom CUDA through ``load_inline``, Triton, or
plain PyTorch). The judge (:mod:`corral.guest.kernel_judge`, see its docstring and
``docs/grading.md`` for the hacks it guards against) runs in a fresh sandbox with a GPU:

>>> out = kernel_reward(candidate_src, reference_src, image="torch-cuda")  # doctest: +SKIP
>>> out.reward, out.correct, out.speedup, out.status
(2.31, True, 2.31, 'ok')

``reward`` is 0 for a wrong, crashing, compile-failing or too slow (timeout) candidate,
and ``min(speedup, max_speedup)`` for a correct one; ``None`` (not gradable, never a
silent 0) when the reference itself failed or the sandbox could not run the judge.
The image must hold PyTorch (with CUDA for ``device="cuda"``): see docs/gpus.md.
"""

from __future__ import annotations

import json
import random
import secrets
from dataclasses import dataclass
from importlib import resources
from typing import Any

from corral.errors import CorralError

DEFAULT_TIMEOUT_S = 300.0
NOT_GRADABLE = ("reference_error", "judge_error", "no_verdict")
CANDIDATE_STARTED = "corral-kernel-judge: candidate started"  # the judge's stderr


@dataclass(frozen=True)
class KernelOutcome:
    """A kernel's verdict and its parts: ``reward`` (None: not gradable), whether it is
    ``correct``, its ``speedup`` over the reference (the judge's clock, medians), the
    times, and ``status`` (``ok``, ``wrong``, ``compile_error``, ``runtime_error``,
    ``timeout``; ``reference_error``/``judge_error``/``no_verdict``: not gradable)
    with a ``reason``."""

    reward: float | None
    correct: bool
    speedup: float | None
    status: str
    reason: str | None = None
    reference_ms: float | None = None
    candidate_ms: float | None = None


def judge_program() -> str:
    """The judge's source text (one program: ``python3 -I -c PROGRAM``)."""
    return (resources.files("corral.guest") / "kernel_judge.py").read_text(encoding="utf-8")


def kernel_payload(
    candidate: str, reference: str, *, device: str = "cuda", trials: int = 3,
    timing_inputs: int = 4, repeats: int = 10, atol: float = 1e-2, rtol: float = 1e-2,
    timeout: float = DEFAULT_TIMEOUT_S, seed: int | None = None,
) -> dict[str, Any]:
    """The judge's stdin: sources, tolerances and seeds. The input seeds come from the
    host (``secrets`` unless ``seed`` fixes them) and reach the reference's process only."""
    if trials < 1 or timing_inputs < 1 or repeats < 1:
        raise ValueError("trials, timing_inputs and repeats must be at least 1")
    rng = secrets.SystemRandom() if seed is None else random.Random(seed)
    seeds = [rng.randrange(1 << 62) for _ in range(trials + timing_inputs)]
    return {"program": judge_program(), "candidate": candidate, "reference": reference,
            "device": device, "trials": trials, "timing_inputs": timing_inputs,
            "repeats": repeats, "atol": atol, "rtol": rtol, "timeout": timeout,
            "seeds": seeds, "init_seed": rng.randrange(1 << 31)}


def outcome(verdict: dict[str, Any] | None, *, max_speedup: float,
            stderr: bytes | str = b"") -> KernelOutcome:
    """The :class:`KernelOutcome` of the judge's verdict (``None``: it gave none). A judge
    that ended without a verdict after the candidate started was ended by the candidate
    (nothing else runs then): that scores 0, so killing the judge never beats a wrong
    answer; before that, nothing was graded (``None``)."""
    if verdict is None:
        err = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
        if CANDIDATE_STARTED in err:
            return KernelOutcome(0.0, False, None, "killed",
                                 "the judge ended while the candidate ran (killed by it?)")
        return KernelOutcome(None, False, None, "no_verdict",
                             "the judge ended without a verdict (killed, or out of memory)")
    status = str(verdict.get("status", "judge_error"))
    correct = bool(verdict.get("correct")) and status == "ok"
    speedup = verdict.get("speedup")
    if status in NOT_GRADABLE:
        reward = None
    elif correct and isinstance(speedup, (int, float)):
        reward = float(min(speedup, max_speedup))
    else:
        reward = 0.0
    return KernelOutcome(reward, correct, speedup, status, verdict.get("reason"),
                         verdict.get("reference_ms"), verdict.get("candidate_ms"))


def parse_verdict(stdout: bytes | str) -> dict[str, Any] | None:
    """The judge's verdict: the last stdout line, a JSON object (None if there is none)."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    lines = text.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def kernel_reward(
    candidate: str, reference: str, *, image: str = "python", gpus: int | str = 1,
    device: str = "cuda", python: str = "python3", memory_mb: int = 16384,
    max_speedup: float = 10.0, client: Any = None, timeout: float = DEFAULT_TIMEOUT_S,
    **judge: Any,
) -> KernelOutcome:
    """Judge ``candidate`` against ``reference`` in a fresh sandbox of ``image`` holding
    ``gpus`` (``gpus=0`` with ``device="cpu"`` runs it without one); ``judge`` options:
    ``trials``, ``timing_inputs``, ``repeats``, ``atol``, ``rtol``, ``seed``."""
    from corral.client._sync import Sandbox

    payload = kernel_payload(candidate, reference, device=device, timeout=timeout, **judge)
    spec: dict[str, Any] = {"memory_mb": memory_mb, "pids": 1024, "open_files": 4096,
                            "timeout": timeout * 3 + 60}
    if gpus:
        spec["gpus"] = gpus
    try:
        with Sandbox.create(image, client=client, **spec) as sb:
            result = sb.exec([python, "-I", "-c", payload["program"]], stdin=json.dumps(payload),
                             timeout=timeout * 2 + 30)
    except CorralError as exc:
        return KernelOutcome(None, False, None, "no_verdict", f"{exc.code}: {exc.message}")
    return outcome(parse_verdict(result.stdout), max_speedup=max_speedup, stderr=result.stderr)


__all__ = ["KernelOutcome", "judge_program", "kernel_payload", "kernel_reward", "outcome",
           "parse_verdict"]
