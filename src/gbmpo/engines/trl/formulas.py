r"""TRL's normalisers, entropy bonus and adaptive entropy coefficient, reproduced as small pure
functions for :class:`gbmpo.integrations.trl.GBMPOTrainer`, and the logging window's reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["adaptive_entropy_coef", "dapo_normalizer", "entropy_bonus", "window_means"]


def dapo_normalizer(
    num_items_in_batch: Tensor | float,
    *,
    num_processes: int,
    accumulation_steps: int,
    steps_per_generation: int,
    training: bool,
) -> Tensor:
    r"""TRL ``loss_type="dapo"`` denominator of one micro-batch's token-sum loss (TRL 1.16
    ``GRPOTrainer._compute_loss``):

    .. math::
        Z = \frac{\max(1, N_{\text{tok}})}{P}\cdot\frac{G_{\text{acc}}}{S_{\text{gen}}}

    with :math:`N_{\text{tok}}` the valid tokens of the whole generation batch over all processes
    (``num_items_in_batch``), :math:`P` processes, :math:`G_{\text{acc}}` the current
    gradient-accumulation steps and :math:`S_{\text{gen}}` ``steps_per_generation`` (the last
    factor only in ``training``). Summing :math:`\sum_{i,t} m\ell / Z` over one optimizer step's
    micro-batches gives the global token mean (DAPO, arXiv 2503.14476), whatever the split across
    processes; :math:`Z` may be below the local micro-batch's token count."""
    n = torch.as_tensor(num_items_in_batch, dtype=torch.float32).clamp(min=1.0)
    z = n / num_processes
    if training:
        z = z * accumulation_steps / steps_per_generation
    return z


def entropy_bonus(entropies: Tensor, mask: Tensor, accumulation_steps: int) -> Tensor:
    r"""TRL's entropy term (the loss gets :math:`-c_H` times this): the mean per-token entropy
    over ``mask``, divided by the gradient-accumulation steps,

    .. math::
        \bar H = \frac{\sum_{i,t} m_{i,t} H_{i,t}}{\max(1, \sum_{i,t} m_{i,t})\,G_{\text{acc}}}

    (TRL ``entropy_coef``; independent of the loss type's normaliser).
    """
    m = mask.to(entropies.dtype)
    return (entropies * m).sum() / m.sum().clamp(min=1.0) / accumulation_steps


def adaptive_entropy_coef(
    coef: float,
    entropy: float,
    *,
    target: float,
    delta: float,
    coef_min: float,
    coef_max: float,
) -> float:
    r"""Adaptive entropy control (Skywork-OR1, arXiv 2505.22312, section 4; TRL
    ``use_adaptive_entropy``): after each optimizer step, with :math:`\bar H` the token-mean
    entropy of its accumulation window over all processes,

    .. math::
        c_H \leftarrow \begin{cases} \min(c_H + \delta, c_{\max}) & \bar H \le H^* \\
        \max(c_H - \delta, c_{\min}) & \bar H > H^* \end{cases}

    The next window's loss applies :math:`c_H` only while :math:`\bar H \le H^*`
    (``entropy_target``), else 0 (:meth:`GBMPOTrainer._entropy_term`)."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def window_means(metrics: dict[str, list[float]], token_weights: dict[str, list[float]]) -> None:
    r"""Reduce a logging window's per-micro-batch values in place (then emptied:
    ``token_weights``): a key with weights becomes its token-weighted mean
    :math:`\sum_j n_j v_j / \sum_j n_j` (:math:`n_j` valid tokens of micro-batch :math:`j`, so a
    fraction of tokens stays one over the whole window); ``ratio/min`` / ``ratio/max`` and
    ``rollout_correction/weight_min`` / ``_max`` become the window's extremes."""
    for key, w in token_weights.items():
        values = metrics.get(key)
        if values and len(values) == len(w) and sum(w) > 0:
            metrics[key] = [sum(v * x for v, x in zip(values, w, strict=True)) / sum(w)]
    token_weights.clear()
    for key, pick in (("ratio/min", min), ("ratio/max", max),
                      ("rollout_correction/weight_min", min),
                      ("rollout_correction/weight_max", max)):
        if metrics.get(key):
            metrics[key] = [pick(metrics[key])]
