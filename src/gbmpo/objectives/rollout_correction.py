r"""Rollout-training mismatch correction: importance weights of the sampler against the trainer.

The completions of a step are drawn by a *sampler* :math:`\mu` (vLLM, a bf16 decoder, a
KV-cached decode loop, a top-p / top-k truncated distribution) while the loss is computed with the
*trainer's* log-probs :math:`\pi_{old}` at the same weights. Wherever the two differ, the
policy gradient is taken on samples of the wrong distribution; the correction reweights (or
masks) each token or sequence by the importance ratio

.. math::
    \rho_{i,t} = \frac{\pi_{old}(o_{i,t}\mid h_{i,t})}{\mu(o_{i,t}\mid h_{i,t})}
    = \exp(\log\pi_{old} - \log\mu), \qquad
    \rho_i = \prod_t \rho_{i,t} = \exp\Big(\sum_t \log\pi_{old} - \log\mu\Big)

(token level / sequence level), computed once per batch from detached log-probs. The weight
multiplies the per-token surrogate only, never the regularizer (as TRL 1.16's
``GRPOTrainer._compute_loss`` and verl 0.9.1's policy losses do). ``optim.mu > 1`` is *not* a
mismatch: the surrogate's own ratio :math:`\pi_\theta/\pi_{old}` handles it.

Modes (registry :data:`ROLLOUT_CORRECTIONS`, ``objective.rollout_correction.mode``), each a
function ``(log_ratio, *, low, high) -> weights`` on the token or sequence log-ratios:

* ``none``: :math:`w = 1` (the default on every engine);
* ``tis``: truncated IS, :math:`w = \mathrm{clip}(\rho, \text{low}, \text{high})`
  (:func:`truncated_is`);
* ``mis``: masked IS, :math:`w = \rho\,\mathbb 1[\text{low} \le \rho \le \text{high}]`
  (:func:`masked_is`);
* ``icepop``: IcePop, token-level masked IS with both bounds (:func:`icepop`).

:func:`off_policy_sequence_mask` is DeepSeek-V3.2's off-policy sequence mask (a separate switch,
``objective.rollout_correction.off_policy_mask_threshold``). :func:`correction_weights` turns
trainer and sampler log-probs into the ``[B, T]`` weights; :func:`weight_stats` gives the logged
``rollout_correction/*`` metrics (:mod:`gbmpo.io.metrics`).

This module is pure torch, with no trainer state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from gbmpo.objectives.tensors import compute_dtype
from gbmpo.registry import Registry, UnknownNameError

__all__ = [
    "LEVELS",
    "ROLLOUT_CORRECTIONS",
    "CorrectionFn",
    "check_correction",
    "correction_weights",
    "icepop",
    "masked_is",
    "no_correction",
    "off_policy_sequence_mask",
    "sampler_log_ratio",
    "truncated_is",
    "weight_stats",
]

#: ``objective.rollout_correction.level`` values
LEVELS: tuple[str, ...] = ("token", "sequence")

#: ``(log_ratio, *, low, high) -> weights`` of the same shape
CorrectionFn = Callable[..., Tensor]

#: ``objective.rollout_correction.mode`` -> its weight function
ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")


@ROLLOUT_CORRECTIONS.register("none")
def no_correction(log_ratio: Tensor, *, low: float | None = None,
                  high: float | None = None) -> Tensor:
    r"""No correction: :math:`w = 1` (the sampler's log-probs are taken as the trainer's)."""
    return torch.ones_like(log_ratio)


@ROLLOUT_CORRECTIONS.register("tis")
def truncated_is(log_ratio: Tensor, *, low: float | None = None,
                 high: float | None = None) -> Tensor:
    r"""Truncated importance sampling (TIS):

    .. math::
        w = \min\big(\max(\rho, \text{low}), \text{high}\big), \qquad \rho = \exp(\text{log\_ratio})

    (a bound that is ``None`` is not applied). Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training" (the cap :math:`C` on the vLLM / trainer
    ratio, :math:`w = \min(\rho, C)`); TRL 1.16 ``vllm_importance_sampling_mode=token_truncate``
    / ``sequence_truncate`` with ``vllm_importance_sampling_clip_min`` / ``_max``; verl 0.9.1
    ``rollout_is_threshold`` as one number (upper bound only)."""
    return torch.clamp(torch.exp(log_ratio), min=low, max=high)


@ROLLOUT_CORRECTIONS.register("mis")
def masked_is(log_ratio: Tensor, *, low: float | None = None,
              high: float | None = None) -> Tensor:
    r"""Masked importance sampling (MIS): the ratio where it lies in the bounds, 0 outside,

    .. math::
        w = \rho\;\mathbb 1[\text{low} \le \rho \le \text{high}]

    (a bound that is ``None`` is not applied). Liu, Li et al. 2025, "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (sequence-level
    MIS); TRL 1.16 ``vllm_importance_sampling_mode=token_mask`` / ``sequence_mask``; verl 0.9.1
    ``rollout_is_threshold="low_high"``."""
    rho = torch.exp(log_ratio)
    lo = -math.inf if low is None else low
    hi = math.inf if high is None else high
    return rho.masked_fill((rho < lo) | (rho > hi), 0.0)


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(log_ratio: Tensor, *, low: float | None = None,
           high: float | None = None) -> Tensor:
    r"""IcePop: token-level double-sided masking of the training / inference ratio,

    .. math::
        w_{i,t} = \rho_{i,t}\;\mathbb 1[\alpha \le \rho_{i,t} \le \beta],
        \qquad (\alpha, \beta) = (\text{low}, \text{high})

    i.e. :func:`masked_is` at token level with both bounds (the paper uses
    :math:`\alpha = 0.5, \beta = 5`). Ling Team 2025, "Every Step Evolves: Scaling Reinforcement
    Learning for Trillion-Scale Thinking Model" (arXiv 2510.18855); TRL 1.16
    ``token_mask`` with both bounds; verl 0.9.1 ``rollout_is=token`` with
    ``rollout_is_threshold="low_high"``."""
    if low is None or high is None:
        raise ValueError("icepop masks outside [low, high]: give both bounds")
    return masked_is(log_ratio, low=low, high=high)


def sampler_log_ratio(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor,
                      level: str = "token") -> Tensor:
    r"""The log importance ratio of the trainer against the sampler, in float32 (float64 stays):

    .. math::
        \text{token: } \ell_{i,t} = m_{i,t}\,(\log\pi_{old} - \log\mu)_{i,t}\ \ [B, T], \qquad
        \text{sequence: } \ell_i = \sum_t \ell_{i,t}\ \ [B, 1]

    Tokens whose sampler log-prob is NaN (a sampler that could not score them) count as 0, as
    in TRL 1.16. Both inputs are detached: the weights are constants of the loss."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(LEVELS)}")
    if tuple(trainer_logp.shape) != tuple(sampler_logp.shape):
        raise ValueError(f"sampler log-probs shape {tuple(sampler_logp.shape)} != trainer "
                         f"log-probs shape {tuple(trainer_logp.shape)}")  # fmt: skip
    dt = compute_dtype(trainer_logp)
    m = mask.to(torch.bool)
    diff = trainer_logp.detach().to(dt) - sampler_logp.detach().to(dt)
    diff = torch.where(m & ~torch.isnan(diff), diff, torch.zeros((), dtype=dt,
                                                                 device=diff.device))
    return diff.sum(dim=-1, keepdim=True) if level == "sequence" else diff


def check_correction(mode: str, level: str, low: float | None, high: float | None,
                     threshold: float | None = None, where: str = "rollout_correction") -> None:
    """``ValueError`` (``UnknownNameError`` for the mode, listing the valid ones) for settings the
    functions cannot take: a level outside :data:`LEVELS`, bounds that are not numbers with
    ``0 < low < high``, a correcting mode without ``high``, ``icepop`` without ``low`` or at
    sequence level, a negative or non-finite ``off_policy_mask_threshold``."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise UnknownNameError(f"{where}.mode: unknown name {mode!r}; valid names: "
                               f"{', '.join(ROLLOUT_CORRECTIONS.names())}")  # fmt: skip
    if level not in LEVELS:
        raise ValueError(f"'{where}.level' must be one of {', '.join(LEVELS)}, got {level!r}")
    for key, v in (("low", low), ("high", high)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v <= 0):  # fmt: skip
            raise ValueError(f"'{where}.{key}' must be a finite number > 0 or null, got {v!r}")
    if low is not None and high is not None and low >= high:
        raise ValueError(f"'{where}.low'={low} must be below '{where}.high'={high}")
    if mode != "none" and high is None:
        raise ValueError(f"'{where}.high' must be set with mode {mode!r} (the upper bound of "
                         "the weights; 2.0 is the usual TIS cap)")  # fmt: skip
    if mode == "icepop":
        if low is None:
            raise ValueError(f"mode 'icepop' masks tokens outside [low, high]: set '{where}.low' "
                             "(IcePop uses low 0.5, high 5.0)")  # fmt: skip
        if level != "token":
            raise ValueError(f"mode 'icepop' is token-level: '{where}.level' must be 'token' "
                             "(for sequence-level masking use mode 'mis')")  # fmt: skip
    if threshold is not None and (isinstance(threshold, bool)
                                  or not isinstance(threshold, (int, float))
                                  or not math.isfinite(threshold) or threshold < 0):  # fmt: skip
        raise ValueError(f"'{where}.off_policy_mask_threshold' must be a finite number >= 0 or "
                         f"null, got {threshold!r}")  # fmt: skip


def correction_weights(mode: str, trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, *,
                       level: str = "token", low: float | None = None,
                       high: float | None = None) -> Tensor:
    r"""The ``[B, T]`` weights of ``mode`` (registry :data:`ROLLOUT_CORRECTIONS`) from the
    trainer's and the sampler's per-token log-probs: :math:`w = f(\ell)` on the token or
    sequence log-ratio of :func:`sampler_log_ratio` (a sequence weight broadcast to its tokens),
    0 on padding; detached. Errors as :func:`check_correction`."""
    check_correction(mode, level, low, high, where="rollout_correction")
    fn = ROLLOUT_CORRECTIONS.get(mode)
    log_ratio = sampler_log_ratio(trainer_logp, sampler_logp, mask, level)
    w = fn(log_ratio, low=low, high=high).expand(trainer_logp.shape)
    m = mask.to(torch.bool)
    return torch.where(m, w, torch.zeros((), dtype=w.dtype, device=w.device)).detach()


def off_policy_sequence_mask(advantages: Tensor, logp: Tensor, sampler_logp: Tensor,
                             mask: Tensor, threshold: float) -> Tensor:
    r"""DeepSeek-V3.2's off-policy sequence mask (OPSM), ``[B, 1]`` with 1 = keep, 0 = drop:

    .. math::
        M_i = \mathbb 1\Big[A_i \ge 0\ \lor\
        \frac{1}{|o_i|}\sum_t \big(\log\mu(o_{i,t}) - \log\pi_\theta(o_{i,t})\big) \le \delta\Big]

    i.e. a sequence with a negative advantage whose mean per-token log-ratio of the sampler over
    the current policy exceeds :math:`\delta` (``threshold``) is left out of the gradient.
    DeepSeek-AI 2025, "DeepSeek-V3.2" (arXiv 2512.02556), Eq. 9; TRL 1.16
    ``GRPOTrainer.get_off_policy_mask`` with ``off_policy_mask_threshold`` (NaN sampler
    log-probs count as 0, the mean divides by :math:`\max(|o_i|, 1)`). ``advantages``: ``[B]``,
    ``[B, 1]`` or ``[B, T]`` (the sign of each token's advantage, per token then)."""
    dt = compute_dtype(logp)
    mf = mask.to(dt)
    kl = torch.nan_to_num(sampler_logp.detach().to(dt) - logp.detach().to(dt), nan=0.0)
    mean_kl = (kl * mf).sum(dim=1, keepdim=True) / mf.sum(dim=1, keepdim=True).clamp(min=1.0)
    adv = advantages.detach().unsqueeze(1) if advantages.dim() == 1 else advantages.detach()
    return ((adv >= 0) | (mean_kl <= threshold)).to(dt)


@torch.no_grad()
def weight_stats(weights: Tensor, mask: Tensor, keep: Tensor | None = None) -> dict[str, float]:
    r"""The logged statistics of the correction over the valid tokens (:math:`m = 1`):
    ``weight_mean`` / ``weight_min`` / ``weight_max`` of the IS weights :math:`w` (a sequence
    weight counts once per token) and ``masked_frac``, the fraction of valid tokens the
    correction removes from the gradient, :math:`w\,M = 0` (``keep``: the off-policy sequence
    mask :math:`M`, ``[B, 1]`` or ``[B, T]``; ``None``: 1). ``nan`` when no token is valid."""
    m = mask.to(torch.bool)
    w = weights.detach().double().expand(m.shape)[m]
    if w.numel() == 0:
        nan = float("nan")
        return {"weight_mean": nan, "weight_min": nan, "weight_max": nan, "masked_frac": nan}
    factor = weights.detach().double().expand(m.shape)
    if keep is not None:
        factor = factor * keep.detach().double().expand(m.shape)
    return {
        "weight_mean": float(w.mean()),
        "weight_min": float(w.min()),
        "weight_max": float(w.max()),
        "masked_frac": float((factor[m] == 0).double().mean()),
    }
