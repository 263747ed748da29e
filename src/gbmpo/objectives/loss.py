r"""The full policy loss: (weighted) surrogate + coef * regularizer per token, then aggregation.

.. math::
    \mathcal L = \mathrm{agg}\big(\omega_{i,t}\,\ell^{\text{surr}}_{i,t} + \lambda\,D_{i,t},\ m\big)

(GBMPO adds the regularizer per token before aggregation, as TRL does with its KL term;
docs/methods.md, sections "Aggregation" and "GBMPO regularizers"). The optional token weights
:math:`\omega` (default 1) multiply the surrogate only, as TRL 1.16 applies its vLLM
importance-sampling ratio, off-policy mask and high-entropy mask before adding
:math:`\beta\,\mathrm{KL}`. Surrogates come from :mod:`gbmpo.objectives.surrogates`, regularizers
from :mod:`gbmpo.objectives.regularizers`, aggregation modes from :mod:`gbmpo.objectives.aggregate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.aggregate import aggregate
from gbmpo.objectives.surrogates import Surrogate, _float_mask, _masked, get_surrogate

__all__ = ["compute_policy_loss"]

#: ``(logp, ref_logp, old_logp, mask) -> per-token values [B, T]``, attribute ``needs_ref``.
Regularizer = Callable[..., Tensor]


def _resolve_regularizer(regularizer: str | Regularizer | None) -> Regularizer | None:
    if regularizer is None or callable(regularizer):
        return regularizer
    if isinstance(regularizer, str):
        from gbmpo.objectives.regularizers import get_regularizer

        return get_regularizer(regularizer)  # type: ignore[no-any-return]
    raise TypeError(f"regularizer must be a name, a callable or None, got {regularizer!r}")


def _resolve_surrogate(surrogate: str | Surrogate) -> Surrogate:
    if isinstance(surrogate, str):
        return get_surrogate(surrogate)
    if callable(surrogate):
        return surrogate
    raise TypeError(f"surrogate must be a name or a callable, got {surrogate!r}")


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    mf = mask.to(torch.float32)
    v = _masked(x.detach().to(torch.float32), mf)
    return float(v.sum() / mf.sum().clamp_min(1))


def _valid_weights(weights: Tensor, mask: Tensor, pg: Tensor) -> Tensor:
    """``weights`` ([B, T] or [B, 1]) as ``pg``'s dtype, broadcast to [B, T], 0 where masked."""
    if not isinstance(weights, Tensor):
        raise TypeError(f"token_weights must be a Tensor or None, got {type(weights).__name__}")
    b, t = pg.shape
    if weights.dim() != 2 or weights.shape[0] != b or weights.shape[1] not in (1, t):
        raise ValueError(
            f"token_weights must be [B, T]=[{b}, {t}] or [B, 1]=[{b}, 1], got shape "
            f"{tuple(weights.shape)}"
        )
    if weights.is_complex():
        raise ValueError("token_weights must be real, got a complex tensor")
    w = weights.to(device=pg.device, dtype=pg.dtype).expand(b, t)
    return torch.where(mask.to(torch.bool), w, torch.zeros((), dtype=pg.dtype, device=pg.device))


def compute_policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    surrogate: str | Surrogate,
    regularizer: str | Regularizer | None,
    coef: float = 0.0,
    aggregation: str = "dr_grpo",
    max_len: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""Per-token :math:`\omega\,\ell^{\text{surr}} + \text{coef}\cdot D`, aggregated:

    .. math::
        \mathcal L = \mathrm{agg}\big(\omega_{i,t}\,\ell^{\text{surr}}_{i,t}
        + \lambda\,D_{i,t},\ m\big),
        \qquad
        \nabla_\theta\mathcal L = \mathrm{agg}\big(\omega_{i,t}\,\nabla_\theta
        \ell^{\text{surr}}_{i,t} + \lambda\,\nabla_\theta D_{i,t},\ m\big)

    (``agg`` is linear for a fixed mask and :math:`\omega` is a constant; :math:`\omega \equiv 1`
    when ``token_weights`` is None). The weights scale the policy-gradient term only, never the
    regularizer: TRL 1.16's ``GRPOTrainer._compute_loss`` multiplies its per-token loss by the
    vLLM importance-sampling ratio (``importance_sampling_ratio``), the off-policy mask and the
    high-entropy mask *before* adding :math:`\beta\,\mathrm{KL}`. (An importance-weighted
    regularizer is a regularizer of its own, e.g. ``kl_k3_is``.)

    Args:
        logp: ``[B, T]`` sampled-token log-probs under the trained policy (with grad).
        old_logp: ``[B, T]`` behaviour-policy log-probs; ``None`` means on-policy, i.e.
            ``logp.detach()`` (ratio 1 with the right gradient, TRL's single-iteration case).
        ref_logp: ``[B, T]`` anchor log-probs for the regularizer; may be ``None`` when the
            regularizer's ``needs_ref`` is False (or there is no regularizer).
        advantages: ``[B]`` or ``[B, T]``.
        mask: ``[B, T]`` {0, 1} completion mask.
        surrogate: a callable from :func:`gbmpo.objectives.get_surrogate`, or a registered name
            (built with its default parameters).
        regularizer: a callable ``(logp, ref_logp, old_logp, mask) -> [B, T]`` (e.g. from
            :func:`gbmpo.objectives.get_regularizer`), a registered name, or ``None`` for none.
        coef: regularizer coefficient :math:`\lambda` (or :math:`\beta`); the term is added only
            when ``coef != 0``, but its masked mean is always reported.
        aggregation: mode of :func:`gbmpo.objectives.aggregate`.
        max_len, num_sequences, num_tokens: passed to :func:`~gbmpo.objectives.aggregate`
            (full-batch normalisers for micro-batching; ``num_tokens`` may be a float below
            this batch's token count, e.g. a global count divided by the number of processes).
        token_weights: ``[B, T]`` or ``[B, 1]`` (one weight per sequence) per-token weights
            :math:`\omega` of the surrogate, any real dtype (bool masks too), e.g. importance
            ratios or 0/1 masks. Used as given on valid tokens (no detach: pass constants) and
            ignored on masked ones, so padding may hold anything, NaN included.

    Returns:
        ``(loss, metrics)``: the scalar loss (float32, or float64 for float64 ``logp``) and
        python floats: the surrogate diagnostics (``clip_frac_low``, ``clip_frac_high``,
        ``clip_frac_dual``, ``ratio_mean``, ``ratio_min``, ``ratio_max``; unweighted masked
        statistics), ``pg_loss`` (the aggregated weighted surrogate
        :math:`\mathrm{agg}(\omega\,\ell^{\text{surr}}, m)` alone), ``reg_loss`` (the aggregated
        :math:`\mathrm{agg}(\beta D, m)` alone, computed on its own so that a regularizer term far
        below the surrogate is not lost to rounding in ``loss - pg_loss``), ``reg_value`` (masked
        mean of the regularizer, 0 without one) and ``loss``.

    Raises:
        ValueError: invalid ``coef``, ``coef != 0`` without a regularizer, a missing
            ``ref_logp``, shape mismatches (``token_weights`` included), or invalid aggregation
            normalisers (see :func:`~gbmpo.objectives.aggregate`).
    """
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise ValueError(f"coef must be a finite number, got {coef!r}")
    surr = _resolve_surrogate(surrogate)
    reg = _resolve_regularizer(regularizer)
    if reg is None and coef != 0:
        raise ValueError(f"coef={coef} given but regularizer is None")
    if old_logp is None:
        old_logp = logp.detach()
    if logp.dim() == 2:
        # checked here once, then passed on as {0, 1} floats of the compute dtype (float-mask
        # arithmetic is what the built-in surrogates and regularizers use)
        dt = torch.float64 if logp.dtype == torch.float64 else torch.float32
        mask = _float_mask(mask, logp.shape, dt)

    pg, diag = surr(logp, old_logp, advantages, mask)
    if token_weights is not None:
        pg = pg * _valid_weights(token_weights, mask, pg)
    agg_kw: dict[str, Any] = {
        "num_sequences": num_sequences,
        "num_tokens": num_tokens,
    }
    per_token = pg
    reg_value = 0.0
    reg_loss = 0.0
    if reg is not None:
        needs_ref = bool(getattr(reg, "needs_ref", True))
        if needs_ref and ref_logp is None:
            raise ValueError(f"regularizer {reg!r} needs reference log-probs but ref_logp is None")
        values = reg(logp, ref_logp, old_logp, mask)
        if tuple(values.shape) != tuple(pg.shape):
            raise ValueError(
                f"regularizer returned shape {tuple(values.shape)}, expected {tuple(pg.shape)}"
            )
        reg_value = _masked_mean(values, mask)
        if coef != 0:
            per_token = pg + coef * values.to(pg.dtype)
            with torch.no_grad():
                reg_term = coef * values.detach().to(pg.dtype)
                reg_loss = float(aggregate(reg_term, mask, aggregation, max_len, **agg_kw))

    loss = aggregate(per_token, mask, aggregation, max_len, **agg_kw)
    with torch.no_grad():
        pg_loss = aggregate(pg.detach(), mask, aggregation, max_len, **agg_kw)
    metrics = {k: float(v) for k, v in diag.items()}
    metrics["pg_loss"] = float(pg_loss)
    metrics["reg_loss"] = reg_loss
    metrics["reg_value"] = reg_value
    metrics["loss"] = float(loss.detach())
    return loss, metrics
