r"""``rollout_correction/*`` on TRL: the schema's statistics (:mod:`gbmpo.io.metrics`) of TRL's
vLLM importance-sampling weights and off-policy sequence mask, logged by ``GBMPOTrainer`` for
every micro-batch (token-weighted over processes and the logging window; min / max the window's
extremes), with the own engine's definition (:func:`gbmpo.objectives.rollout_correction.
weight_stats`). TRL's own ``sampling/importance_sampling_ratio/*`` stay as TRL logs them (a
mean over sequences at sequence level)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["log_rollout_correction"]

_P = "rollout_correction/"


@torch.no_grad()
def log_rollout_correction(trainer: Any, mode: str, ratio: Tensor | None, keep: Tensor | None,
                           mask: Tensor) -> None:  # fmt: skip
    """Append this micro-batch's weight mean, min, max and masked fraction (weights ``ratio``,
    ``[B, T]`` or ``[B, 1]``, ``None``: 1; ``keep``: the off-policy mask, ``None``: 1) over
    the valid tokens of every process to ``trainer._metrics[mode]``."""
    m = mask.to(torch.bool)
    dev = mask.device
    w = torch.ones(m.shape, dtype=torch.float64, device=dev) if ratio is None else \
        ratio.detach().double().expand(m.shape)  # fmt: skip
    factor = w if keep is None else w * keep.detach().double().expand(m.shape)
    mf = m.double()
    local = torch.stack([(w * mf).sum(), ((factor == 0) & m).double().sum(), mf.sum()])
    totals = trainer.accelerator.reduce(local, reduction="sum")
    n = float(totals[2])
    valid = w[m]
    ext = torch.tensor([float(valid.min()) if valid.numel() else math.inf,
                        -float(valid.max()) if valid.numel() else math.inf],
                       device=dev)  # fmt: skip
    ext = trainer.accelerator.gather(ext.unsqueeze(0)).view(-1, 2).min(dim=0).values
    if n == 0:
        return
    metrics = trainer._metrics[mode]
    weights = getattr(trainer, "_token_weights", None)
    if weights is None:
        weights = trainer._token_weights = {"train": {}, "eval": {}}
    means = (("weight_mean", float(totals[0]) / n), ("masked_frac", float(totals[1]) / n))
    for key, value in means:
        metrics[_P + key].append(value)
        weights[mode].setdefault(_P + key, []).append(n)
    metrics[_P + "weight_min"].append(float(ext[0]))
    metrics[_P + "weight_max"].append(-float(ext[1]))
