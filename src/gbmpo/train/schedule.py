r"""The learning-rate schedule of the own engine, also used by the TRL engine (:func:`lr_at`)."""

from __future__ import annotations

import math

from gbmpo.config.schema import OptimConfig, RunConfig

__all__ = ["lr_at"]


def lr_at(optim: OptimConfig, run: RunConfig, step: int, rl_seconds: float) -> float:
    r"""The learning rate of RL step ``step`` (0-based) after ``rl_seconds`` of RL.

    Linear warm-up :math:`\eta = \eta_0 (s+1)/w` for :math:`s < w` (``optim.warmup_steps``),
    then ``constant`` :math:`\eta_0`, or ``cosine`` (SGDR, Loshchilov & Hutter 2017, without
    restarts) :math:`\eta = \eta_0\,(r + (1-r)\tfrac12(1+\cos\pi u))`, :math:`r` =
    ``optim.min_lr_ratio``. The progress :math:`u \in [0, 1]` is the larger of
    :math:`(s-w)/(S-w)` (:math:`S` = ``run.steps``) and ``rl_seconds`` /
    ``run.time_budget_seconds``: the decay ends when the run ends, whichever limit stops it
    (with a time budget the rate therefore depends on timing).
    """
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = (step - optim.warmup_steps) / max(1, run.steps - optim.warmup_steps)
    if run.time_budget_seconds is not None:
        progress = max(progress, rl_seconds / run.time_budget_seconds)
    progress = min(1.0, max(0.0, progress))
    r = optim.min_lr_ratio
    return optim.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))
