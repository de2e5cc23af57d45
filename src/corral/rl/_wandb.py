"""Metrics to the Weights & Biases run this process has open, when there is one.

``code_reward`` and ``evaluate`` log what they measured (``corral/...`` keys) to
``wandb.run`` if the user's code started one (``wandb.init()``): nothing to set up,
and no run, no logging. wandb is never imported here: a run exists only once the
user imported it and called ``wandb.init()``. Pass ``wandb=False`` to either to
keep them out. A failure to log is a warning, never a failed reward or evaluation.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

log = logging.getLogger("corral.rl")


def active_run() -> Any | None:
    """``wandb.run`` if wandb is imported and a run is open, else ``None``."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


def log_metrics(metrics: dict[str, float | int], *, commit: bool | None = None) -> bool:
    """Log ``metrics`` to the open run; False if there is none (or it failed).

    ``commit=False`` adds them to the run's current step (a trainer's, which it commits
    itself) rather than starting a step of their own."""
    run = active_run()
    if run is None:
        return False
    finite = {k: v for k, v in metrics.items() if isinstance(v, int) or math.isfinite(v)}
    try:
        run.log(finite, commit=commit)
    except Exception as exc:  # noqa: BLE001 - a metrics sink never fails the job
        log.warning("could not log corral metrics to W&B: %s: %s", type(exc).__name__, exc)
        return False
    return True
