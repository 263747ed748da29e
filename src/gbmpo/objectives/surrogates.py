r"""Policy-gradient surrogates: per-token losses built from the importance ratio.

A surrogate is a callable taking keyword arguments only,
``surrogate(logp=, old_logp=, advantages=, mask=) -> (loss [B, T], diagnostics)``:

* ``logp`` ``[B, T]``: log-probs of the sampled tokens under the policy being trained (with grad);
* ``old_logp`` ``[B, T]``: the same under the behaviour policy that sampled them (treated as a
  constant, detached here);
* ``advantages``: ``[B]`` (one per completion, broadcast to its tokens) or ``[B, T]``;
  treated as constants;
* ``mask`` ``[B, T]``: {0, 1} float or bool completion mask.

The loss is 0 at masked positions (and gives no gradient there); aggregation over tokens is a
separate step (:mod:`gbmpo.objectives.aggregate`). Math runs in float32 whatever the input dtype
(float64 inputs stay float64, for gradient checks). The token log-ratio is clamped to
``[-20, 20]`` before ``exp`` (as verl does) so the ratio stays finite.

Diagnostics are detached 0-dim tensors, masked means over valid tokens (0 on an empty mask):
``clip_frac_low`` / ``clip_frac_high`` (tokens whose gradient the lower / upper clip removes),
``clip_frac_dual`` (tokens capped by the dual clip), ``ratio_mean``, ``ratio_min``, ``ratio_max``.

Names (registry :data:`SURROGATES`, built by :func:`get_surrogate`): ``clip``, ``gspo``, ``atr``,
``divergence_clip`` (clip by any policy divergence; ``atr`` is its ``measure="k3"``; the
``dppo_tv`` / ``dppo_kl`` measures give DPPO), ``rpg_clip``, ``rpg_reinforce``, and the baselines
``cispo`` (MiniMax-M1), ``sapo`` (soft gate), ``gmpo`` (geometric mean) and ``vespo`` (gamma
weight of the sequence ratio).

Why one module of ~1,000 lines: the surrogates share one signature, one set of diagnostics, the
masking and dtype helpers and one registry, and the formulas read best side by side; each class is
short. The clip measures of ``divergence_clip`` are in :mod:`gbmpo.objectives.clip_measures`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from gbmpo.objectives.clip_measures import (
    CLIP_MEASURES,
    DPPO_MEASURES,
    PER_TOKEN_MEASURES,
    atr_bounds,
    dppo_kl_interval,
    dppo_tv_interval,
    dppo_valid_mask,
    k1_interval,
    k2_interval,
    k3_interval,
    mirror_interval,
    prob_l2_interval,
    ratio_interval,
)
from gbmpo.objectives.mirror import NeuralMirrorMap, as_mirror_map
from gbmpo.objectives.tensors import attach, check_mask, float_mask, masked
from gbmpo.registry import Registry

__all__ = [
    "RPG_VARIANTS",
    "SURROGATES",
    "ATRSurrogate",
    "CISPOSurrogate",
    "ClipSurrogate",
    "DivergenceClipSurrogate",
    "GMPOSurrogate",
    "GSPOSurrogate",
    "RPGClipSurrogate",
    "RPGReinforceSurrogate",
    "SAPOSurrogate",
    "Surrogate",
    "VESPOSurrogate",
    "atr_bounds",
    "cispo_loss",
    "dppo_loss",
    "get_surrogate",
    "gmpo_clipped_log_ratio",
    "ppo_clip_loss",
    "rpg_kl_component",
    "rpg_regularized_advantage",
    "rpg_reinforce_loss",
    "sapo_gate",
    "sequence_log_ratio",
    "vespo_weight",
]

class Surrogate(Protocol):
    """``surrogate(logp=, old_logp=, advantages=, mask=) -> (per-token loss [B, T],
    diagnostics)``, keyword arguments only."""

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


#: Registry of surrogate classes; instantiate through :func:`get_surrogate`.
SURROGATES: Registry[type] = Registry("surrogate")

#: KL variants of RPG (arXiv 2505.17508, Tables 1, 2, 4).
RPG_VARIANTS: tuple[str, ...] = ("fkl", "rkl", "ufkl", "urkl")

_LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------
# Pure formula functions
# --------------------------------------------------------------------------------------------


def ppo_clip_loss(
    ratio: Tensor,
    adv: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip_c: float | None = None,
    ratio_cap: float | None = None,
) -> Tensor:
    r"""Clipped surrogate loss per token (PPO, Schulman et al. 2017; DAPO clip-higher).

    .. math::
        \ell = -\min\big(\tilde w A,\ \mathrm{clip}(w, l, h) A\big),\qquad
        \tilde w = \min(w, \rho_{\text{cap}})\ \text{(``ratio_cap``, TRL's ``delta``, if given)},

    and with dual clip (Ye et al. 2020, as in verl and RPG): for :math:`A < 0`,
    :math:`\ell \leftarrow \min(\ell, -cA)`. With :math:`l = 1-\varepsilon_{\text{low}}`,
    :math:`h = 1+\varepsilon_{\text{high}}` this is docs/methods.md, section "Clipped surrogate".
    Gradient: :math:`-A\,w\,\nabla\log\pi_\theta` inside the trust region, 0 where the clip binds in
    the direction the advantage pushes, and 0 where the dual cap binds.
    """
    unclipped = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
    clipped = ratio.clamp(low, high)
    loss = -torch.minimum(unclipped * adv, clipped * adv)
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip_c * adv), loss)
    return loss


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    r"""GSPO sequence log-ratio (Zheng et al. 2025, arXiv 2507.18071; TRL
    ``importance_sampling_level="sequence"``), shape ``[B, 1]``:

    .. math::
        \log s_i = \frac{1}{|o_i|}\sum_t m_{i,t}\,(\log\pi_\theta - \log\pi_{\text{old}})_{i,t}

    with :math:`|o_i| = \max(1, \sum_t m_{i,t})`. Its gradient is
    :math:`\nabla \log s_i = \frac{1}{|o_i|}\sum_t m_{i,t}\nabla\log\pi_\theta(o_{i,t})`.
    """
    m = mask.to(log_ratio.dtype)
    return (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)


def rpg_regularized_advantage(adv: Tensor, log_w: Tensor, variant: str, beta: float) -> Tensor:
    r"""RPG regularized advantage for clipping (arXiv 2505.17508 App. G.2), a constant:

    * ``urkl``: :math:`\hat A = A - \beta\log w`;
    * ``rkl``: :math:`\hat A = A - \beta(\log w + 1)`;
    * ``fkl``, ``ufkl``, ``none``: :math:`\hat A = A` (the FKL weights do not factor as
      :math:`w\times(\cdot)`; add their KL through a regularizer instead).

    With :math:`\hat A` detached, :math:`\nabla(-w\hat A) = -w\hat A\nabla\log\pi_\theta`, the
    Table 1 gradient weight of URKL / RKL.
    """
    log_w = log_w.detach()
    if variant == "urkl":
        return adv - beta * log_w
    if variant == "rkl":
        return adv - beta * (log_w + 1.0)
    if variant in ("fkl", "ufkl", "none"):
        return adv
    raise ValueError(f"unknown RPG variant {variant!r}; valid: none, {', '.join(RPG_VARIANTS)}")


def rpg_kl_component(w_bar: Tensor, variant: str, beta: float) -> Tensor:
    r"""RPG KL component :math:`C_{KL}` of the REINFORCE weight :math:`wA + C_{KL}`
    (arXiv 2505.17508 Table 2 / App. F; the authors' ``compute_policy_loss_reinforce``), from the
    clipped ratio :math:`\bar w = \mathrm{clip}(w, 1-\epsilon_1, 1+\epsilon_2)`:

    * ``fkl``: :math:`+\beta`;
    * ``ufkl``: :math:`\beta(1-\bar w)`;
    * ``rkl``: :math:`-\beta\bar w(\log\bar w + 1)`;
    * ``urkl``: :math:`-\beta\bar w\log\bar w`.
    """
    w_bar = w_bar.detach()
    if variant == "fkl":
        return torch.full_like(w_bar, beta)
    if variant == "ufkl":
        return beta * (1.0 - w_bar)
    if variant == "rkl":
        return -beta * w_bar * (torch.log(w_bar) + 1.0)
    if variant == "urkl":
        return -beta * w_bar * torch.log(w_bar)
    raise ValueError(f"unknown RPG variant {variant!r}; valid: {', '.join(RPG_VARIANTS)}")


def rpg_reinforce_loss(
    logp: Tensor,
    ratio: Tensor,
    adv: Tensor,
    c_kl: Tensor,
    low: float,
    high: float,
    c: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""RPG-REINFORCE with RPG-Style Clip, per token (arXiv 2505.17508 Algorithm 2, §3.3).

    With :math:`\ell = -\log\pi_\theta` (carries the gradient), :math:`A_R` the baseline-subtracted
    advantage, :math:`w` the ratio, :math:`C_{KL}` from :func:`rpg_kl_component` (all of them
    except :math:`\ell` stop-gradient), the effective advantage is
    :math:`A' = A_R + C_{KL}/w` and :math:`\psi = A'\ell` (same sign as :math:`A'`, as
    :math:`\ell > 0`). Branches, evaluated in this order:

    1. :math:`A' \ge 0`, :math:`w < h = 1+\epsilon_2`: :math:`L = \psi w = (wA_R + C_{KL})\ell`
       (active).
    2. :math:`A' \ge 0`, :math:`w \ge h`: :math:`L = (hA_R + C_{KL})\,\mathrm{SG}(\ell)`
       (constant, no gradient).
    3. :math:`A' < 0`, :math:`w \le l = 1-\epsilon_1`: :math:`L = (lA_R + C_{KL})\,
       \mathrm{SG}(\ell)` (constant).
    4. :math:`A' < 0`, :math:`l < w < c`: :math:`L = (wA_R + C_{KL})\ell` (active).
    5. :math:`A' < 0`, :math:`w \ge c`: :math:`L = (cA_R + C_{KL})\,\mathrm{SG}(\ell)`
       (constant; dual clip, skipped when ``c`` is None).

    The value is continuous in :math:`w`. In the active region
    :math:`\nabla L = -(wA_R + C_{KL})\nabla\log\pi_\theta`, the REINFORCE weight of Table 2,
    whose expectation equals the gradient of the fully differentiable Table 1 loss (Prop. 4.1).
    The sign test uses :math:`wA_R + C_{KL}` (= :math:`wA'`, :math:`w>0`), which avoids the
    division. Unlike the authors' unused ``clip_ppo`` code path, the branch is on :math:`A'`,
    not on :math:`A_R` (paper form).

    Returns ``(loss, clipped_low, clipped_high, clipped_dual)`` (the last three are bool masks).
    """
    w = ratio.detach()
    adv = adv.detach()
    c_kl = c_kl.detach()
    ell = -logp
    weight = w * adv + c_kl
    pos = weight >= 0
    hit_high = pos & (w >= high)
    hit_low = ~pos & (w <= low)
    hit_dual = ~pos & ~hit_low & (w >= c) if c is not None else torch.zeros_like(pos)
    w_const = torch.where(pos, torch.full_like(w, high), torch.full_like(w, low))
    if c is not None:
        w_const = torch.where(hit_dual, torch.full_like(w, c), w_const)
    const = (w_const * adv + c_kl) * ell.detach()
    active = ~(hit_high | hit_low | hit_dual)
    loss = torch.where(active, weight * ell, const)
    return loss, hit_low, hit_high, hit_dual


def cispo_loss(logp: Tensor, ratio: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    r"""CISPO per-token loss (MiniMax-M1, arXiv 2506.13585):

    .. math::
        \ell = -\,\mathrm{SG}\big(\mathrm{clip}(w, l, h)\big)\,A\,\log\pi_\theta,

    the importance weight clipped and stopped, times the REINFORCE term, so that every token keeps
    a gradient :math:`-\mathrm{clip}(w, l, h)A\nabla\log\pi_\theta` (PPO's clip would drop it).
    MiniMax-M1 sets no lower bound in practice (:math:`l = 0`) and tunes :math:`h`; TRL's
    ``cispo`` is :math:`\min(w, \varepsilon_{\max})` (:math:`l = 0, h = \varepsilon_{\max}`),
    verl's is :math:`[1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}}]`.
    """
    return -(ratio.detach().clamp(low, high) * adv) * logp


def sapo_gate(ratio: Tensor, tau: Tensor | float) -> Tensor:
    r"""SAPO's soft gate ("Soft Adaptive Policy Optimization", arXiv 2511.20347):

    .. math::
        f_\tau(w) = \frac{4}{\tau}\,\sigma\big(\tau(w - 1)\big),

    whose derivative :math:`f'_\tau(w) = 4\sigma(1-\sigma)` is 1 at :math:`w = 1` (the plain
    policy gradient on-policy) and decays smoothly away from it, instead of PPO's hard cut.
    """
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def gmpo_clipped_log_ratio(
    log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float
) -> Tensor:
    r"""GMPO's token log-ratio clipped in log space on the side the advantage pushes
    ("Geometric-Mean Policy Optimization", arXiv 2507.20673; verl ``geo_mean``):

    .. math::
        \tilde r_t = \mathrm{sgn}(A_t)\min\big(\mathrm{sgn}(A_t)\log w_t,\
        \mathrm{sgn}(A_t)\,\mathrm{clip}(\log w_t, -\varepsilon_{\text{low}},
        \varepsilon_{\text{high}})\big),

    i.e. :math:`\min(\log w_t, \varepsilon_{\text{high}})` for :math:`A_t > 0`,
    :math:`\max(\log w_t, -\varepsilon_{\text{low}})` for :math:`A_t < 0` and 0 for
    :math:`A_t = 0`; the clipped side carries no gradient.
    """
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    pos = log_ratio.clamp(max=eps_high)
    neg = log_ratio.clamp(min=-eps_low)
    return torch.where(adv > 0, pos, torch.where(adv < 0, neg, zero))


def vespo_weight(
    seq_log_ratio: Tensor,
    adv: Tensor,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> Tensor:
    r"""VESPO's gamma weight of the sequence ratio (arXiv 2602.10693; TRL ``vespo``):

    .. math::
        \phi(W) = \exp\big(\lambda + k\log W - \lambda W\big) = e^{\lambda} W^k e^{-\lambda W},
        \qquad \log W = \mathrm{clip}\Big(\sum_t m_t\log w_t,\ \log 10^{-8},\ 20\Big),

    normalised so that :math:`\phi(1) = 1`, with :math:`(k, \lambda) = (k_+, \lambda_+)` for
    :math:`A \ge 0` and :math:`(k_-, \lambda_-)` otherwise (:math:`\lambda \ge 10^{-4}`); a
    non-finite :math:`\phi` becomes 0. It is a constant (stop-gradient) weight: the loss is
    :math:`-\phi A\log\pi_\theta` (:class:`VESPOSurrogate`). Note :math:`W` is the product of the
    token ratios (a sum of logs), not GSPO's geometric mean.
    """
    log_w = seq_log_ratio.detach().clamp(math.log(1e-8), 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp_min(1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def dppo_loss(
    logp: Tensor, ratio: Tensor, adv: Tensor, valid: Tensor, is_cap: float | None
) -> Tensor:
    r"""DPPO per-token loss (Qi et al., "Rethinking the Trust Region in LLM Reinforcement
    Learning", arXiv 2602.04879; verl ``dppo_tv`` / ``dppo_kl``):

    .. math::
        \ell = -A\,\mathrm{SG}\big(\min(w, C)\big)\,M\,\log\pi_\theta,

    with :math:`M` the trust-region mask of
    :func:`~gbmpo.objectives.clip_measures.dppo_valid_mask` and :math:`C` the truncated-importance-
    sampling cap (DPPO §5.4 uses truncation instead of PPO's dual clip; ``None``: no cap). Its
    gradient :math:`-A\min(w, C)M\nabla\log\pi_\theta` is PPO's inside the region (up to the cap)
    and 0 where the mask drops the token.
    """
    w = ratio.detach()
    if is_cap is not None:
        w = w.clamp(max=is_cap)
    return -(adv * w * valid.to(w.dtype)) * logp


# --------------------------------------------------------------------------------------------
# Shared plumbing
# --------------------------------------------------------------------------------------------


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _fcmp(op: Callable[..., Tensor], a: Tensor, b: Tensor | float) -> Tensor:
    """Comparison ``op(a, b)`` as a {0, 1} tensor of ``a``'s dtype, written straight into a
    float buffer (as fast as a multiplication; a bool result plus a cast costs ~10x more)."""
    return op(a, b, out=torch.empty_like(a))


def _prepare(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validate shapes; return (logp, log_ratio, adv [B, T], mask bool) in the compute dtype.

    Masked positions get log-ratio 0 and advantage 0, so padding garbage never reaches the
    loss or its gradient.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    if tuple(old_logp.shape) != tuple(logp.shape):
        raise ValueError(
            f"old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}"
        )
    m = check_mask(mask, logp.shape)
    dt = _compute_dtype(logp)
    lp = logp.to(dt)
    zero = torch.zeros((), dtype=dt, device=lp.device)
    lp = torch.where(m, lp, zero)
    old = torch.where(m, old_logp.detach().to(dt), zero)
    log_ratio = (lp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    adv = advantages.detach().to(dt)
    b, t = logp.shape
    if adv.dim() == 1 and adv.shape[0] == b:
        adv = adv.unsqueeze(-1).expand(b, t)
    elif adv.dim() == 2 and adv.shape[0] == b and adv.shape[1] in (1, t):
        adv = adv.expand(b, t)
    else:
        raise ValueError(
            f"advantages must be [B]={b} or [B, T]=[{b}, {t}], got shape {tuple(adv.shape)}"
        )
    adv = torch.where(m, adv, zero)
    return lp, log_ratio, adv, m


def _prepare_fused(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_prepare` without autograd, for surrogates with an analytic per-token derivative:
    ``(x, lp, log_ratio, adv, mf, inside)`` with ``x`` = ``logp`` in the compute dtype (the
    tensor the gradient flows to), ``lp`` / ``log_ratio`` / ``adv`` detached, finite and 0 where
    masked, ``mf`` the mask as {0, 1} floats and ``inside`` (float) the tokens whose log-ratio
    is within the +-20 clamp (elsewhere the clamp passes no gradient, as in :func:`_prepare`).
    Masked garbage (NaN, inf) never reaches a value or a gradient (:func:`_masked`)."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    if tuple(old_logp.shape) != tuple(logp.shape):
        raise ValueError(
            f"old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}"
        )
    dt = _compute_dtype(logp)
    mf = float_mask(mask, logp.shape, dt)
    x = logp.to(dt)
    b, t = logp.shape
    adv = advantages.detach().to(dt)
    if adv.dim() == 1 and adv.shape[0] == b:
        adv = adv.unsqueeze(-1)
    elif not (adv.dim() == 2 and adv.shape[0] == b and adv.shape[1] in (1, t)):
        raise ValueError(
            f"advantages must be [B]={b} or [B, T]=[{b}, {t}], got shape {tuple(adv.shape)}"
        )
    with torch.no_grad():
        lp = masked(x.detach(), mf)
        raw = masked(lp - old_logp.detach().to(dt), mf)
        log_ratio = raw.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        inside = _fcmp(torch.le, raw.abs(), _LOG_RATIO_CLAMP)
        adv = masked(adv, mf)
    return x, lp, log_ratio, adv, mf, inside


def _fdiag(
    w: Tensor, mf: Tensor, low: Tensor | None, high: Tensor | None, dual: Tensor | None
) -> dict[str, Tensor]:
    """:func:`_diagnostics` from {0, 1} float tensors that are already 0 where masked (``w`` is
    1 there), with float arithmetic only."""
    w = w.to(torch.float32)
    mf = mf.to(torch.float32)
    n = mf.sum()
    denom = n.clamp_min(1.0)
    zero = torch.zeros((), dtype=torch.float32, device=w.device)

    def frac(hit: Tensor | None) -> Tensor:
        return zero if hit is None else hit.to(torch.float32).sum() / denom

    wm = w * mf
    rmin = (wm + (1.0 - mf) * 3e38).amin()
    return {
        "clip_frac_low": frac(low),
        "clip_frac_high": frac(high),
        "clip_frac_dual": frac(dual),
        "ratio_mean": wm.sum() / denom,
        "ratio_min": torch.where(n > 0, rmin, zero),
        "ratio_max": wm.amax() if w.numel() else zero,
    }


def _diagnostics(
    ratio: Tensor, m: Tensor, low: Tensor, high: Tensor, dual: Tensor | None
) -> dict[str, Tensor]:
    """Masked means of the bool masks ``low`` / ``high`` / ``dual`` and the ratio's masked
    mean / min / max (0 on an empty mask), float32, without autograd or host syncs."""
    with torch.no_grad():
        r = ratio.detach().to(torch.float32)
        mf = m.to(torch.float32)
        n = mf.sum()
        denom = n.clamp_min(1.0)
        zero = torch.zeros((), dtype=torch.float32, device=r.device)

        def frac(hit: Tensor) -> Tensor:
            return torch.count_nonzero(hit & m).to(torch.float32) / denom

        any_valid = n > 0
        rmax = torch.where(any_valid, torch.where(m, r, -math.inf).amax(), zero)
        rmin = torch.where(any_valid, torch.where(m, r, math.inf).amin(), zero)
        return {
            "clip_frac_low": frac(low),
            "clip_frac_high": frac(high),
            "clip_frac_dual": frac(dual) if dual is not None else zero,
            "ratio_mean": (r * mf).sum() / denom,
            "ratio_min": rmin,
            "ratio_max": rmax,
        }


def _masked_clip_loss(
    ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip_c: float | None,
    ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`ppo_clip_loss` zeroed at masked positions, with its clip diagnostics, through
    autograd (the reference form of :func:`_fused_clip_loss`); ``low`` / ``high`` may be
    per-token tensors of ``ratio``'s shape."""
    loss = ppo_clip_loss(ratio, adv, low, high, dual_clip_c, ratio_cap)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    r = ratio.detach()
    hit_low = (r < low) & (adv < 0)
    hit_high = (r > high) & (adv > 0)
    dual = None
    if dual_clip_c is not None:
        ru = r if ratio_cap is None else r.clamp(max=ratio_cap)
        dual = (adv < 0) & (ru > dual_clip_c)
    return loss, _diagnostics(r, m, hit_low, hit_high, dual)


def _min_grad(a: Tensor, b: Tensor, da: Tensor, db: Tensor) -> Tensor:
    """Derivative of ``torch.minimum(a, b)`` as autograd takes it: ``da`` where ``a < b``,
    ``db`` where ``b < a``, the mean of the two at a tie."""
    return torch.where(a < b, da, torch.where(b < a, db, 0.5 * (da + db)))


def _fused_clip_loss(
    x: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    mf: Tensor,
    inside: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip_c: float | None,
    ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r""":func:`_masked_clip_loss` with its derivative in :math:`\log\pi_\theta` computed in the
    same elementwise pass, float arithmetic only (inputs from :func:`_prepare_fused`), attached
    to ``x`` by one multiplication in the backward instead of a graph of a dozen nodes.

    Same value, and the gradient as autograd takes it, ties included (the clip passes the
    gradient on its closed interval, ``minimum`` splits it at a tie): with
    :math:`u = wA` and :math:`c = \mathrm{clip}(w, l, h)A`, the derivative of
    :math:`-\min(u, c)` is :math:`-Aw\,[u \le c]` (where :math:`c < u` the ratio is outside
    :math:`[l, h]` and the clip passes nothing; a tie with :math:`A \ne 0` has :math:`w` in
    :math:`[l, h]`, both halves pass). The dual clip :math:`\min(\ell, -cA)` for :math:`A < 0`
    is :math:`\min(\ell, -c\min(A, 0))` (for :math:`A \ge 0`, :math:`\ell \le 0`); the TRL
    cap :math:`\min(w, \rho_{\text{cap}})` takes the general tie rule."""
    with torch.no_grad():
        w = torch.exp(log_ratio)
        a_w = adv * w  # d(w A) / d log pi
        clipped = w.clamp(low, high)
        ca = clipped * adv
        if ratio_cap is None:
            ua = a_w
            factor = _fcmp(torch.le, ua, ca)
        else:
            unclipped = w.clamp(max=ratio_cap)
            ua = unclipped * adv
            u_pass = _fcmp(torch.le, w, ratio_cap)
            c_pass = _fcmp(torch.ge, w, low) * _fcmp(torch.le, w, high)
            lt, gt = _fcmp(torch.lt, ua, ca), _fcmp(torch.gt, ua, ca)
            factor = lt * u_pass + gt * c_pass + (1.0 - lt - gt) * 0.5 * (u_pass + c_pass)
        loss = -torch.minimum(ua, ca)
        dual = None
        if dual_clip_c is not None:
            cap = adv.clamp(max=0.0) * -dual_clip_c
            factor = factor * (0.5 * (_fcmp(torch.le, loss, cap) + _fcmp(torch.lt, loss, cap)))
            loss = torch.minimum(loss, cap)
            unc = w if ratio_cap is None else w.clamp(max=ratio_cap)
            dual = _fcmp(torch.lt, adv, 0.0) * _fcmp(torch.gt, unc, dual_clip_c)
        loss = loss * mf
        g = -(a_w * factor) * inside * mf
        diag = _fdiag(
            w,
            mf,
            _fcmp(torch.lt, w, low) * _fcmp(torch.lt, adv, 0.0),
            _fcmp(torch.gt, w, high) * _fcmp(torch.gt, adv, 0.0),
            dual,
        )
    return attach(x, loss, g), diag


def _eps_bounds(eps_low: float, eps_high: float | None) -> tuple[float, float]:
    """Ratio clip interval ``(1 - eps_low, 1 + eps_high)`` (``eps_high`` already resolved)."""
    return 1.0 - eps_low, 1.0 + float(eps_high)  # type: ignore[arg-type]


def _finite_number(cls: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{cls}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{cls}: {name} must be finite, got {value!r}")
    return float(value)


def _check_eps(cls: str, eps_low: Any, eps_high: Any) -> None:
    lo = _finite_number(cls, "eps_low", eps_low)
    hi = _finite_number(cls, "eps_high", eps_high)
    if not 0.0 <= lo <= 1.0:
        raise ValueError(f"{cls}: eps_low must be in [0, 1], got {lo}")
    if hi < 0.0:
        raise ValueError(f"{cls}: eps_high must be >= 0, got {hi}")


def _check_dual(cls: str, name: str, c: Any) -> None:
    if c is None:
        return
    if _finite_number(cls, name, c) <= 1.0:
        raise ValueError(f"{cls}: dual-clip constant {name} must be > 1, got {c!r}")


def _check_clip_params(
    cls: str, eps_low: Any, eps_high: Any, dual_clip_c: Any, ratio_cap: Any
) -> None:
    _check_eps(cls, eps_low, eps_high)
    _check_dual(cls, "dual_clip_c", dual_clip_c)
    if ratio_cap is not None:
        d = _finite_number(cls, "ratio_cap", ratio_cap)
        if d < 1.0 + float(eps_high):
            raise ValueError(
                f"{cls}: ratio_cap (cap on the unclipped ratio) must be >= 1 + eps_high = "
                f"{1.0 + float(eps_high):g}, got {d}"
            )


def _init_ratio_clip(s: ClipSurrogate | GSPOSurrogate, delta: float | None) -> None:
    """``__post_init__`` of :class:`ClipSurrogate` / :class:`GSPOSurrogate`: the deprecated
    ``delta`` becomes ``ratio_cap`` (with a DeprecationWarning), ``eps_high=None`` becomes
    ``eps_low``, then the parameters are checked (errors name ``s.name``)."""
    if delta is not None:
        warnings.warn(
            f"surrogate {s.name!r}: parameter 'delta' is renamed 'ratio_cap' (a cap on the "
            "ratio; 'delta' names a trust-region radius, as in atr); 'delta' will be removed",
            DeprecationWarning,
            stacklevel=4,
        )
        if s.ratio_cap is not None and s.ratio_cap != delta:
            raise ValueError(
                f"{s.name}: give ratio_cap only (delta={delta!r} is its deprecated name, "
                f"ratio_cap={s.ratio_cap!r})"
            )
        object.__setattr__(s, "ratio_cap", delta)
    if s.eps_high is None:
        object.__setattr__(s, "eps_high", s.eps_low)
    _check_clip_params(s.name, s.eps_low, s.eps_high, s.dual_clip_c, s.ratio_cap)


def _check_variant(cls: str, variant: Any, allowed: tuple[str, ...]) -> None:
    if variant not in allowed:
        raise ValueError(f"{cls}: unknown variant {variant!r}; valid: {', '.join(allowed)}")


def _check_beta(cls: str, beta: Any) -> None:
    if _finite_number(cls, "beta", beta) < 0:
        raise ValueError(f"{cls}: beta must be >= 0, got {beta!r}")


# --------------------------------------------------------------------------------------------
# Registered surrogates
# --------------------------------------------------------------------------------------------


@SURROGATES.register("clip")
@dataclass(frozen=True)
class ClipSurrogate:
    r"""Token-level ratio clip (PPO / GRPO; DAPO clip-higher, arXiv 2503.14476), optional dual
    clip (Ye et al. 2020) and optional ratio cap (TRL's ``delta``; INTELLECT-2 two-sided clip).

    :math:`\ell_{i,t} = -\min(\min(w,\rho_{\text{cap}})A_i,\
    \mathrm{clip}(w, 1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}})A_i)`, then
    :math:`\min(\ell, -cA_i)` for :math:`A_i<0` (see :func:`ppo_clip_loss`; docs/methods.md,
    section "Clipped surrogate").

    Args:
        eps_low: lower clip range, ratio floor ``1 - eps_low``; in [0, 1].
        eps_high: upper clip range (``None``: equal to ``eps_low``); >= 0. DAPO uses 0.28.
        dual_clip_c: dual-clip constant ``c > 1`` (verl default 3; ``None``: off).
        ratio_cap: cap :math:`\rho_{\text{cap}}` on the unclipped ratio (TRL's ``delta``); must
            be ``>= 1 + eps_high``.
        delta: deprecated name of ``ratio_cap`` (DeprecationWarning).
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    dual_clip_c: float | None = None
    ratio_cap: float | None = None
    delta: InitVar[float | None] = None
    name: ClassVar[str] = "clip"

    def __post_init__(self, delta: float | None) -> None:
        _init_ratio_clip(self, delta)

    @property
    def bounds(self) -> tuple[float, float]:
        return _eps_bounds(self.eps_low, self.eps_high)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x, _, log_ratio, adv, m, inside = _prepare_fused(logp, old_logp, advantages, mask)
        low, high = self.bounds
        return _fused_clip_loss(
            x, log_ratio, adv, m, inside, low, high, self.dual_clip_c, self.ratio_cap
        )


@SURROGATES.register("gspo")
@dataclass(frozen=True)
class GSPOSurrogate:
    r"""GSPO: the clip of :class:`ClipSurrogate` applied to the sequence ratio
    :math:`s_i = \exp(\frac{1}{|o_i|}\sum_t m_{i,t}\log w_{i,t})` (Zheng et al. 2025,
    arXiv 2507.18071; TRL ``importance_sampling_level="sequence"``; docs/methods.md, section
    "GSPO"), broadcast to every token of completion ``i``.

    Gradient form: the per-token loss is the same for every token of a sequence and each
    token's log-prob receives :math:`\partial/\partial\log\pi_{i,t} = -A_i s_i/|o_i|` inside the
    trust region (TRL's broadcast form; verl's "GSPO-token" stop-gradient form
    :math:`\mathrm{SG}(s_i)\pi_{i,t}/\mathrm{SG}(\pi_{i,t})` has the same value and, with
    per-sequence advantages and ``grpo`` aggregation, the same total gradient). Use ``grpo``
    (sequence-mean of token-means) aggregation to get the GSPO objective
    :math:`\frac1B\sum_i \min(s_iA_i, \mathrm{clip}(s_i)A_i)`; token-sum-based modes weight each
    sequence by its length. Diagnostics are over tokens (the broadcast ratio).

    Args:
        eps_low, eps_high: clip ranges; defaults 3e-4 / 4e-4 as reported for GSPO (docs/methods.md,
        section "GSPO"); ``eps_high=None`` means equal to ``eps_low``. dual_clip_c: dual clip
        on the sequence ratio (``None``: off). ratio_cap: cap on the unclipped sequence ratio
        (TRL's ``delta``). delta: deprecated name of ``ratio_cap`` (DeprecationWarning).
    """

    eps_low: float = 3e-4
    eps_high: float | None = 4e-4
    dual_clip_c: float | None = None
    ratio_cap: float | None = None
    delta: InitVar[float | None] = None
    name: ClassVar[str] = "gspo"

    def __post_init__(self, delta: float | None) -> None:
        _init_ratio_clip(self, delta)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        _, log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
        seq = sequence_log_ratio(log_ratio, m).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(seq).expand_as(log_ratio)
        low, high = _eps_bounds(self.eps_low, self.eps_high)
        return _masked_clip_loss(ratio, adv, m, low, high, self.dual_clip_c, self.ratio_cap)


@SURROGATES.register("atr")
@dataclass(frozen=True)
class ATRSurrogate:
    r"""ATR-GRPO: the token clip with the KL3 trust-region bounds of :func:`atr_bounds`
    (UCF, arXiv 2602.05494; docs/methods.md, section "ATR-GRPO"), the alias of
    ``divergence_clip(measure="k3", delta=delta)`` (:class:`DivergenceClipSurrogate`, same bits):
    :math:`\ell = -\min(wA, \mathrm{clip}(w, l_\delta, u_\delta)A)`, i.e. the ratio's gradient
    is removed once :math:`w - 1 - \log w > \delta` in the direction the advantage pushes.

    Args:
        delta: KL3 radius ``> 0`` (required: the paper's value was not recovered; 0.0177 /
            0.0231 / 0.0331 reproduce the PPO-0.2 upper / lower and DAPO-0.28 upper bound).
        dual_clip_c: optional dual clip ``c > 1``.
    """

    delta: float
    dual_clip_c: float | None = None
    name: ClassVar[str] = "atr"

    def __post_init__(self) -> None:
        atr_bounds(self.delta)
        _check_dual("atr", "dual_clip_c", self.dual_clip_c)

    @property
    def bounds(self) -> tuple[float, float]:
        return atr_bounds(self.delta)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x, _, log_ratio, adv, m, inside = _prepare_fused(logp, old_logp, advantages, mask)
        low, high = self.bounds
        return _fused_clip_loss(x, log_ratio, adv, m, inside, low, high, self.dual_clip_c)


@SURROGATES.register("divergence_clip")
@dataclass(frozen=True)
class DivergenceClipSurrogate:
    r"""Clip by any policy divergence: ATR-GRPO's unified clipping framework (arXiv 2602.05494)
    with GBMPO's Bregman divergences (arXiv 2602.04380) as further measures.

    The token ratio :math:`w` is kept in :math:`\{w : f(w) \le \delta\}` of the measure
    :math:`f` (``measure``, :mod:`gbmpo.objectives.clip_measures`, :math:`f(1) = 0`), the
    interval :math:`[l, u]`, and the loss is PPO's clip with these bounds,
    :math:`\ell = -\min(wA, \mathrm{clip}(w, l, u)A)` (:func:`ppo_clip_loss`, dual clip
    optional): the gradient of a token is removed once :math:`f(w) > \delta` in the direction
    its advantage pushes. ``measure="k3"`` is ATR-GRPO's KL3 trust region, the ``atr``
    surrogate (same bounds, same bits); ``measure="ratio"`` with ``delta=eps`` is ``clip``.
    ``prob_l2`` and ``neural_mirror`` give per-token bounds that depend on the sampled token's
    old probability :math:`p = \pi_{\text{old}}(o_t)`: a rare token may move its ratio further
    than a likely one (ProbL2: :math:`|w - 1| \le \sqrt\delta / p`).

    DPPO (``dppo_tv``, ``dppo_kl``; Qi et al., arXiv 2602.04879): the binary-TV / binary-KL
    trust region of the token's probability, with DPPO's loss instead of PPO's clip:
    :math:`\ell = -A\,\mathrm{SG}(\min(w, C))\,M\log\pi_\theta` (:func:`dppo_loss`), the mask
    :math:`M` dropping the same tokens the clip with these bounds drops (evaluated on the
    divergence directly, as DPPO's code does). DPPO's radii: 0.15 (TV) and 0.05 (KL), its
    authors' recipe; ``is_cap`` is :math:`C`. The diagnostics then count masked tokens as
    ``clip_frac_high`` (:math:`A > 0`) / ``clip_frac_low`` (:math:`A < 0`) and kept tokens whose
    weight the cap truncates as ``clip_frac_dual``.

    Args:
        measure: one of ``ratio`` (:math:`|w-1|`), ``k1`` (:math:`|\log w|`), ``k2``
            (:math:`\frac12\log^2 w`), ``k3`` (:math:`w - 1 - \log w`), ``prob_l2``
            (:math:`(wp - p)^2`), ``neural_mirror`` (:math:`D_h(wp, p)`), ``dppo_tv``
            (:math:`|wp - p|`), ``dppo_kl`` (binary KL).
        delta: radius :math:`\delta > 0` of both sides.
        delta_low, delta_high: per-side radii (override ``delta``): the lower end :math:`l`
            uses ``delta_low``, the upper end :math:`u` uses ``delta_high``.
        dual_clip_c: optional dual clip ``c > 1`` for negative advantages (not with the DPPO
            measures, which truncate the weight instead: ``is_cap``).
        mirror: ``neural_mirror`` only: a :class:`~gbmpo.objectives.mirror.NeuralMirrorMap`, a
            path to a saved map (as the ``neural_mirror`` regularizer takes), or ``None`` for
            ``NeuralMirrorMap.random(0.01, seed=42)``.
        is_cap: DPPO measures only: the truncated-importance-sampling cap :math:`C > 1` on the
            stopped weight :math:`\min(w, C)` (verl reads it from ``clip_ratio_c``; its DPPO
            code falls back to 20, the authors' recipe sets 1e4, i.e. off); ``None``: no cap.
    """

    measure: str
    delta: float | None = None
    delta_low: float | None = None
    delta_high: float | None = None
    dual_clip_c: float | None = None
    mirror: Any = None
    is_cap: float | None = None
    name: ClassVar[str] = "divergence_clip"

    def __post_init__(self) -> None:
        cls = self.name
        if self.measure not in CLIP_MEASURES:
            raise ValueError(
                f"{cls}: unknown measure {self.measure!r}; valid: {', '.join(CLIP_MEASURES)}"
            )
        for key in ("delta", "delta_low", "delta_high"):
            value = getattr(self, key)
            if value is not None and _finite_number(cls, key, value) <= 0:
                raise ValueError(f"{cls}: {key} must be > 0, got {value!r}")
        if self.radii[0] is None or self.radii[1] is None:
            raise ValueError(
                f"{cls}: give delta (both sides) or both delta_low and delta_high; got "
                f"delta={self.delta!r}, delta_low={self.delta_low!r}, "
                f"delta_high={self.delta_high!r}"
            )
        _check_dual(cls, "dual_clip_c", self.dual_clip_c)
        if self.measure in DPPO_MEASURES:
            if self.dual_clip_c is not None:
                raise ValueError(
                    f"{cls}: measure {self.measure!r} (DPPO) truncates the importance weight "
                    "instead of a dual clip: set dual_clip_c=None and use is_cap"
                )
            if self.is_cap is not None and _finite_number(cls, "is_cap", self.is_cap) <= 1.0:
                raise ValueError(f"{cls}: is_cap must be > 1, got {self.is_cap!r}")
        elif self.is_cap is not None:
            raise ValueError(
                f"{cls}: is_cap (DPPO's truncated importance weight) is used only with the "
                f"measures {', '.join(DPPO_MEASURES)}, not {self.measure!r}"
            )
        if self.measure == "neural_mirror":
            object.__setattr__(self, "_mirror_map", as_mirror_map(self.mirror))
        elif self.mirror is not None:
            raise ValueError(
                f"{cls}: mirror is used only with measure='neural_mirror', not {self.measure!r}"
            )
        if self.measure not in PER_TOKEN_MEASURES:
            self.bounds  # noqa: B018 - computes (and so checks) the interval once

    @property
    def radii(self) -> tuple[float | None, float | None]:
        """``(delta_low, delta_high)`` after defaulting each to ``delta``."""
        lo = self.delta_low if self.delta_low is not None else self.delta
        hi = self.delta_high if self.delta_high is not None else self.delta
        return lo, hi

    @property
    def per_token(self) -> bool:
        """True when the bounds depend on the token's old probability (``prob_l2``,
        ``neural_mirror``)."""
        return self.measure in PER_TOKEN_MEASURES

    @property
    def bounds(self) -> tuple[float, float]:
        """``(l, u)`` of a measure whose interval is the same for every token."""
        lo, hi = self.radii
        assert lo is not None and hi is not None
        fn = {"ratio": ratio_interval, "k1": k1_interval, "k2": k2_interval,
              "k3": k3_interval}.get(self.measure)  # fmt: skip
        if fn is None:
            raise ValueError(
                f"{self.name}: measure {self.measure!r} has per-token bounds; use "
                "interval(old_logp)"
            )
        return fn(lo, hi)

    def interval(self, old_logp: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token ``(l, u)`` (float64, the shape of ``old_logp``) for the tokens whose old
        log-probs are ``old_logp``; constant tensors for the token-independent measures."""
        lo, hi = self.radii
        assert lo is not None and hi is not None
        p_old = torch.exp(old_logp.detach().to(torch.float64))
        if self.measure == "prob_l2":
            return prob_l2_interval(p_old, lo, hi)
        if self.measure == "neural_mirror":
            mirror: NeuralMirrorMap = self._mirror_map  # type: ignore[attr-defined]
            return mirror_interval(p_old, mirror, lo, hi)
        if self.measure == "dppo_tv":
            return dppo_tv_interval(p_old, lo, hi)
        if self.measure == "dppo_kl":
            return dppo_kl_interval(p_old, lo, hi)
        low, high = self.bounds
        return torch.full_like(p_old, low), torch.full_like(p_old, high)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x, lp, log_ratio, adv, m, inside = _prepare_fused(logp, old_logp, advantages, mask)
        if not self.per_token:
            low, high = self.bounds
            return _fused_clip_loss(x, log_ratio, adv, m, inside, low, high, self.dual_clip_c)
        if self.measure in DPPO_MEASURES:
            old = masked(old_logp.detach().to(lp.dtype), m)
            return self._dppo(x, lp, old, log_ratio, adv, m, inside)
        old = masked(old_logp.detach().to(torch.float64), m.to(torch.float64))
        lo_t, hi_t = self.interval(old)
        return _fused_clip_loss(
            x, log_ratio, adv, m, inside, lo_t.to(x.dtype), hi_t.to(x.dtype), self.dual_clip_c
        )

    def _dppo(
        self,
        x: Tensor,
        lp: Tensor,
        old: Tensor,
        log_ratio: Tensor,
        adv: Tensor,
        m: Tensor,
        inside: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """DPPO's loss (:func:`dppo_loss`, its derivative in ``log pi`` attached directly) and
        diagnostics; ``old``: the old log-probs, 0 where masked."""
        lo, hi = self.radii
        assert lo is not None and hi is not None
        with torch.no_grad():
            ratio = torch.exp(log_ratio)
            valid = dppo_valid_mask(self.measure, lp, old, adv, lo, hi).to(lp.dtype)
            w = ratio if self.is_cap is None else ratio.clamp(max=self.is_cap)
            g = -(adv * w * valid)  # d loss / d log pi; 0 where masked (adv = 0)
            loss = g * lp  # = dppo_loss(lp, ratio, adv, valid, is_cap), 0 where masked
            dropped = (1.0 - valid) * m
            capped = None
            if self.is_cap is not None:
                capped = valid * _fcmp(torch.gt, ratio, self.is_cap) * m
            low = dropped * _fcmp(torch.lt, adv, 0.0)
            high = dropped * _fcmp(torch.gt, adv, 0.0)
            diag = _fdiag(ratio, m, low, high, capped)
        return attach(x, loss, g), diag


@SURROGATES.register("rpg_clip")
@dataclass(frozen=True)
class RPGClipSurrogate:
    r"""RPG-Style Clip (arXiv 2505.17508 §3.3; docs/methods.md, section "RPG"
    :math:`L^{\text{RPG-Clip}}`):

    .. math::
        L = \begin{cases} \max(-w\hat A, -\mathrm{clip}(w, 1-\epsilon_1, 1+\epsilon_2)\hat A)
        & \hat A \ge 0\\ \min(\max(-w\hat A, -\mathrm{clip}(w,\cdot)\hat A), -c\hat A)
        & \hat A < 0\end{cases}

    i.e. :func:`ppo_clip_loss` with dual clip applied to the regularized advantage
    :math:`\hat A` of :func:`rpg_regularized_advantage` (``urkl``: :math:`A-\beta\log w`,
    ``rkl``: :math:`A-\beta(\log w+1)`, detached). The KL anchor is :math:`\pi_{\text{old}}`
    (RPG's iterative reference). Inside the trust region the gradient weight is
    :math:`w\hat A`, RPG Table 1's URKL / RKL weight.

    Args:
        variant: ``none`` (plain :math:`A`), ``urkl`` or ``rkl``; ``fkl`` / ``ufkl`` also mean
            :math:`\hat A = A` (App. G.2) and then require ``beta == 0``: add their KL with the
            regularizer ``rpg_fkl`` / ``rpg_ufkl`` instead.
        beta: KL coefficient ``>= 0`` (RPG paper: 1e-4).
        eps_low, eps_high: :math:`\epsilon_1, \epsilon_2` (RPG: 0.2, 0.28).
        c: dual-clip constant ``> 1`` (verl default 3; ``None``: off).
    """

    variant: str = "none"
    beta: float = 0.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    c: float | None = 3.0
    name: ClassVar[str] = "rpg_clip"

    def __post_init__(self) -> None:
        _check_variant("rpg_clip", self.variant, ("none", *RPG_VARIANTS))
        _check_beta("rpg_clip", self.beta)
        if self.variant in ("none", "fkl", "ufkl") and self.beta != 0:
            raise ValueError(
                f"rpg_clip: beta has no effect with variant {self.variant!r} (A_hat = A, RPG "
                "App. G.2); set beta=0 and add the KL with a regularizer (e.g. 'rpg_ufkl' with "
                "coef=beta), or use variant 'urkl' / 'rkl'"
            )
        _check_eps("rpg_clip", self.eps_low, self.eps_high)
        _check_dual("rpg_clip", "c", self.c)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x, _, log_ratio, adv, m, inside = _prepare_fused(logp, old_logp, advantages, mask)
        a_hat = rpg_regularized_advantage(adv, log_ratio, self.variant, self.beta)
        a_hat = a_hat * m
        low, high = _eps_bounds(self.eps_low, self.eps_high)
        return _fused_clip_loss(x, log_ratio, a_hat, m, inside, low, high, self.c)


@SURROGATES.register("rpg_reinforce")
@dataclass(frozen=True)
class RPGReinforceSurrogate:
    r"""RPG-REINFORCE with RPG-Style Clip (arXiv 2505.17508 Algorithm 2 and Table 2;
    docs/methods.md, section "RPG"), token level; see :func:`rpg_reinforce_loss` for the five
    branches.

    The REINFORCE weight is :math:`\mathrm{SG}(wA + C_{KL})` with :math:`C_{KL}` of
    :func:`rpg_kl_component` computed from the clipped ratio :math:`\bar w`; the KL anchor is
    :math:`\pi_{\text{old}}` (``old_logp``), RPG's iterative reference. Active-region gradient:
    :math:`-(wA + C_{KL})\nabla\log\pi_\theta`. Implemented from the paper: the authors'
    repository defines but never calls ``compute_policy_loss_reinforce`` (docs/methods.md, "Choices"
    item 12). The loss value is a REINFORCE surrogate (weight times :math:`-\log\pi`), not an
    objective estimate.

    Args:
        variant: ``fkl``, ``rkl``, ``ufkl`` or ``urkl`` (required).
        beta: KL coefficient ``>= 0`` (RPG paper: 1e-4).
        eps_low, eps_high: :math:`\epsilon_1, \epsilon_2` (RPG: 0.2, 0.28).
        c: dual-clip constant ``> 1`` for :math:`A' < 0` (RPG REINFORCE scripts: 10;
            ``None``: off).
    """

    variant: str
    beta: float = 1e-4
    eps_low: float = 0.2
    eps_high: float = 0.28
    c: float | None = 10.0
    name: ClassVar[str] = "rpg_reinforce"

    def __post_init__(self) -> None:
        _check_variant("rpg_reinforce", self.variant, RPG_VARIANTS)
        _check_beta("rpg_reinforce", self.beta)
        _check_eps("rpg_reinforce", self.eps_low, self.eps_high)
        _check_dual("rpg_reinforce", "c", self.c)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lp, log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
        ratio = torch.exp(log_ratio)
        low, high = _eps_bounds(self.eps_low, self.eps_high)
        w_bar = ratio.detach().clamp(low, high)
        c_kl = rpg_kl_component(w_bar, self.variant, self.beta)
        c_kl = torch.where(m, c_kl, torch.zeros_like(c_kl))
        loss, hit_low, hit_high, hit_dual = rpg_reinforce_loss(
            lp, ratio, adv, c_kl, low, high, self.c
        )
        loss = torch.where(m, loss, torch.zeros_like(loss))
        diag = _diagnostics(ratio, m, hit_low, hit_high, hit_dual if self.c is not None else None)
        return loss, diag


def _zero_diag(ratio: Tensor, m: Tensor) -> dict[str, Tensor]:
    """Diagnostics of a surrogate without a clip: clip fractions 0, ratio statistics."""
    none = torch.zeros_like(m)
    return _diagnostics(ratio, m, none, none, None)


@SURROGATES.register("cispo")
@dataclass(frozen=True)
class CISPOSurrogate:
    r"""CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1,
    arXiv 2506.13585; docs/methods.md, section "Baseline surrogates"):
    :math:`\ell = -\mathrm{SG}(\mathrm{clip}(w, 1-\varepsilon_{\text{low}},
    1+\varepsilon_{\text{high}}))\,A\log\pi_\theta` (:func:`cispo_loss`). No token loses its
    gradient; the clip only bounds its weight. The loss value is a REINFORCE surrogate
    (weight times :math:`\log\pi`), not an objective estimate.

    Args:
        eps_low: lower range, weight floor ``1 - eps_low`` in [0, 1]; default 1.0 (floor 0, no
            lower clip, as MiniMax-M1 and TRL).
        eps_high: upper range, weight cap ``1 + eps_high`` (>= 0); default 4.0 (cap 5, the
            ScaleRL value TRL recommends for its ``epsilon_high``, which is the cap itself).

    Diagnostics: ``clip_frac_low`` / ``clip_frac_high`` are the tokens whose weight the floor /
    cap changes (any advantage sign: their gradient is scaled, not removed).
    """

    eps_low: float = 1.0
    eps_high: float = 4.0
    name: ClassVar[str] = "cispo"

    def __post_init__(self) -> None:
        _check_eps(self.name, self.eps_low, self.eps_high)

    @property
    def bounds(self) -> tuple[float, float]:
        return _eps_bounds(self.eps_low, self.eps_high)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x, lp, log_ratio, adv, m, _ = _prepare_fused(logp, old_logp, advantages, mask)
        low, high = self.bounds
        with torch.no_grad():
            ratio = torch.exp(log_ratio)
            g = -(ratio.clamp(low, high) * adv)  # d loss / d log pi; 0 where masked (adv = 0)
            loss = g * lp  # = cispo_loss(lp, ratio, adv, low, high)
            diag = _fdiag(
                ratio, m, _fcmp(torch.lt, ratio, low) * m, _fcmp(torch.gt, ratio, high) * m, None
            )
        return attach(x, loss, g), diag


@SURROGATES.register("sapo")
@dataclass(frozen=True)
class SAPOSurrogate:
    r"""SAPO: soft adaptive policy optimization (arXiv 2511.20347; docs/methods.md,
    section "Baseline surrogates"): :math:`\ell = -f_\tau(w)\,A` with the sigmoid gate
    :math:`f_\tau(w) = \frac4\tau\sigma(\tau(w-1))` of :func:`sapo_gate`, token level, and
    :math:`\tau = \tau_{\text{pos}}` for :math:`A > 0`, :math:`\tau_{\text{neg}}` otherwise. The
    gradient :math:`-4\sigma(1-\sigma)\,w A\nabla\log\pi_\theta` equals the policy gradient at
    :math:`w = 1` and fades smoothly as the ratio leaves 1 (faster for larger :math:`\tau`).
    SAPO's papers and both TRL and verl aggregate it as a sequence mean of token means
    (``grpo``).

    Args:
        tau_pos, tau_neg: temperatures ``> 0`` for positive / non-positive advantages; defaults
            1.0 / 1.05 (TRL ``sapo_temperature_pos`` / ``_neg``, verl ``tau_pos`` / ``tau_neg``;
            the paper makes the negative side decay faster).

    Diagnostics: clip fractions are 0 (nothing is clipped).
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    name: ClassVar[str] = "sapo"

    def __post_init__(self) -> None:
        for key in ("tau_pos", "tau_neg"):
            if _finite_number(self.name, key, getattr(self, key)) <= 0:
                raise ValueError(f"{self.name}: {key} must be > 0, got {getattr(self, key)!r}")

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x, _, log_ratio, adv, m, inside = _prepare_fused(logp, old_logp, advantages, mask)
        with torch.no_grad():
            ratio = torch.exp(log_ratio)
            tau = torch.where(adv > 0, self.tau_pos, self.tau_neg).to(ratio.dtype)
            sig = torch.sigmoid(tau * (ratio - 1.0))
            loss = -(sig * (4.0 / tau)) * adv  # -sapo_gate(w, tau) A; 0 where masked (adv = 0)
            # d f_tau(w) / d log pi = 4 sigma (1 - sigma) w
            g = -(4.0 * sig * (1.0 - sig) * ratio) * adv * inside
            diag = _fdiag(ratio, m, None, None, None)
        return attach(x, loss, g), diag


@SURROGATES.register("gmpo")
@dataclass(frozen=True)
class GMPOSurrogate:
    r"""GMPO: geometric-mean policy optimization (arXiv 2507.20673; verl
    ``geo_mean``; docs/methods.md, section "Baseline surrogates"). The sequence ratio is the
    geometric mean of the token ratios clipped in log space on the side each token's advantage
    pushes (:func:`gmpo_clipped_log_ratio`),

    .. math::
        s_i = \exp\Big(\frac{1}{|o_i|}\sum_t m_{i,t}\tilde r_{i,t}\Big),\qquad
        \ell_i = -\bar A_i\,s_i,

    with :math:`\bar A_i` the token mean of the advantage over the sequence (= :math:`A_i` for
    per-sequence advantages). Like :class:`GSPOSurrogate` the per-token loss is :math:`\ell_i` on
    every token of sequence ``i`` (use ``grpo`` aggregation for GMPO's
    :math:`\frac1B\sum_i\ell_i`); each unclipped token's log-prob receives
    :math:`-\bar A_i s_i/|o_i|`. Unlike the arithmetic mean of token ratios, the geometric mean
    is insensitive to a single outlier ratio.

    Args:
        eps_low, eps_high: log-space clip range, :math:`\log w \in [-\varepsilon_{\text{low}},
            \varepsilon_{\text{high}}]`; default 0.4 each, the paper's
            :math:`(e^{-0.4}, e^{0.4})` (verl passes its ``clip_ratio`` here, 0.2 by default).

    Diagnostics: token fractions clipped with :math:`A > 0` (high) / :math:`A < 0` (low); ratio
    statistics of the sequence ratio :math:`s_i` (broadcast to tokens).
    """

    eps_low: float = 0.4
    eps_high: float = 0.4
    name: ClassVar[str] = "gmpo"

    def __post_init__(self) -> None:
        for key in ("eps_low", "eps_high"):
            if _finite_number(self.name, key, getattr(self, key)) <= 0:
                raise ValueError(f"{self.name}: {key} must be > 0, got {getattr(self, key)!r}")

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        _, log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
        clipped = gmpo_clipped_log_ratio(log_ratio, adv, self.eps_low, self.eps_high)
        seq = sequence_log_ratio(clipped, m)
        ratio = torch.exp(seq).expand_as(log_ratio)
        mf = m.to(adv.dtype)
        adv_seq = (adv * mf).sum(-1, keepdim=True) / mf.sum(-1, keepdim=True).clamp_min(1.0)
        loss = torch.where(m, -(adv_seq * ratio), 0.0)
        with torch.no_grad():
            lr = log_ratio.detach()
            hit = (lr > self.eps_high) | (lr < -self.eps_low)
            diag = _diagnostics(ratio, m, hit & (adv < 0), hit & (adv > 0), None)
        return loss, diag


@SURROGATES.register("vespo")
@dataclass(frozen=True)
class VESPOSurrogate:
    r"""VESPO: a smooth gamma weight of the sequence ratio instead of a clip (arXiv 2602.10693;
    TRL ``vespo``; docs/methods.md, section "Baseline surrogates"):
    :math:`\ell_{i,t} = -\mathrm{SG}(\phi(W_i))\,A\log\pi_\theta(o_{i,t})` with
    :math:`W_i = \prod_t w_{i,t}` and :math:`\phi` of :func:`vespo_weight`
    (:math:`\phi(1) = 1`, down-weighting sequences whose ratio moved either way). The loss value
    is a REINFORCE surrogate (weight times :math:`\log\pi`).

    Args:
        k_pos, lambda_pos: shape and decay for :math:`A \ge 0` (defaults 2, 3, TRL's).
        k_neg, lambda_neg: the same for :math:`A < 0` (defaults 3, 2, TRL's).

    TRL folds its vLLM importance-sampling ratio into :math:`W` for this loss (instead of
    multiplying the loss by it); this surrogate sees only the trainer's and the behaviour
    policy's log-probs, so a sampler correction is not part of :math:`W` here.

    Diagnostics: clip fractions 0; ratio statistics of :math:`W_i` (broadcast to tokens).
    """

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    name: ClassVar[str] = "vespo"

    def __post_init__(self) -> None:
        for key in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            if _finite_number(self.name, key, getattr(self, key)) < 0:
                raise ValueError(f"{self.name}: {key} must be >= 0, got {getattr(self, key)!r}")

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x, lp, log_ratio, adv, m, _ = _prepare_fused(logp, old_logp, advantages, mask)
        with torch.no_grad():
            seq = log_ratio.sum(-1, keepdim=True)  # masked log-ratios are 0
            phi = vespo_weight(seq, adv, self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg)
            g = -(phi * adv)  # d loss / d log pi; 0 where masked (adv = 0)
            loss = g * lp
            w_seq = torch.exp(seq.clamp(math.log(1e-8), 20.0)).expand_as(log_ratio)
            diag = _fdiag(w_seq, m, None, None, None)
        return attach(x, loss, g), diag


def get_surrogate(name: str, **params: Any) -> Surrogate:
    """Build the surrogate registered as ``name`` with ``params``.

    Raises :class:`gbmpo.registry.UnknownNameError` (listing valid names) for an unknown name and
    ``TypeError`` naming any parameter the surrogate does not take.
    """
    return SURROGATES.build(name, **params)  # type: ignore[no-any-return]
