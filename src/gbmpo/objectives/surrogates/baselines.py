"""Baseline surrogates from other methods: ``cispo`` (MiniMax-M1), ``sapo`` (soft gate),
``gmpo`` (geometric mean of the token ratios), ``vespo`` (gamma weight of the sequence
ratio), ``gpg`` (plain REINFORCE, no ratio) and ``dro`` (REINFORCE with a quadratic log-ratio
penalty against the behaviour policy)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from gbmpo.objectives.surrogates.base import (
    SURROGATES,
    _check_eps,
    _eps_bounds,
    _finite_number,
    clip_diagnostics,
    prepare_inputs,
    sequence_log_ratio,
)

__all__ = [
    "CISPOSurrogate",
    "DROSurrogate",
    "GPGSurrogate",
    "GMPOSurrogate",
    "SAPOSurrogate",
    "VESPOSurrogate",
    "cispo_loss",
    "gmpo_clipped_log_ratio",
    "sapo_gate",
    "vespo_weight",
]


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


def _ratio_diag(ratio: Tensor, m: Tensor) -> dict[str, Tensor]:
    """Diagnostics of a surrogate without a clip: clip fractions 0, ratio statistics."""
    none = torch.zeros_like(m)
    return clip_diagnostics(ratio, m, none, none, None)


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
        lp, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        low, high = self.bounds
        ratio = torch.exp(log_ratio)
        loss = torch.where(m, cispo_loss(lp, ratio, adv, low, high), 0.0)
        r = ratio.detach()
        return loss, clip_diagnostics(r, m, r < low, r > high, None)



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
        _, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        ratio = torch.exp(log_ratio)
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg).to(ratio.dtype)
        loss = torch.where(m, -sapo_gate(ratio, tau) * adv, 0.0)
        return loss, _ratio_diag(ratio, m)



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
        _, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        clipped = gmpo_clipped_log_ratio(log_ratio, adv, self.eps_low, self.eps_high)
        seq = sequence_log_ratio(clipped, m)
        ratio = torch.exp(seq).expand_as(log_ratio)
        mf = m.to(adv.dtype)
        adv_seq = (adv * mf).sum(-1, keepdim=True) / mf.sum(-1, keepdim=True).clamp_min(1.0)
        loss = torch.where(m, -(adv_seq * ratio), 0.0)
        with torch.no_grad():
            lr = log_ratio.detach()
            hit = (lr > self.eps_high) | (lr < -self.eps_low)
            diag = clip_diagnostics(ratio, m, hit & (adv < 0), hit & (adv > 0), None)
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
        lp, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        seq = log_ratio.sum(-1, keepdim=True)  # masked log-ratios are 0
        phi = vespo_weight(seq, adv, self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg)
        loss = torch.where(m, -(phi * adv) * lp, 0.0)
        w_seq = torch.exp(seq.detach().clamp(math.log(1e-8), 20.0)).expand_as(log_ratio)
        return loss, _ratio_diag(w_seq, m)



@SURROGATES.register("gpg")
@dataclass(frozen=True)
class GPGSurrogate:
    r"""GPG: group policy gradient, the plain REINFORCE surrogate without a ratio or a clip
    ("GPG: A Simple and Strong Reinforcement Learning Baseline", arXiv 2504.02546; verl 0.9.1
    ``policy_loss.loss_mode: gpg``; docs/methods.md, section "Baseline surrogates"):

    .. math::
        \ell_t = -A_t\,\log\pi_\theta(o_t),\qquad
        \frac{\partial\ell_t}{\partial\log\pi_\theta} = -A_t .

    The behaviour policy's log-probs are not used: the gradient is the on-policy policy gradient
    whatever the ratio (with ``mu > 1`` or several mini-batches the later updates are not
    importance-corrected, as in verl). The value is a REINFORCE surrogate, not an objective
    estimate. No parameters.

    Diagnostics: clip fractions 0; ratio statistics of :math:`w = \pi_\theta/\pi_{old}`.
    """

    name: ClassVar[str] = "gpg"

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lp, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        return torch.where(m, -adv * lp, 0.0), _ratio_diag(torch.exp(log_ratio), m)



@SURROGATES.register("dro")
@dataclass(frozen=True)
class DROSurrogate:
    r"""DRO: direct reward optimisation with a quadratic log-ratio penalty (Richemond et al.,
    "Offline Regularised Reinforcement Learning for Large Language Models Alignment", arXiv
    2405.19107; verl 0.9.1 ``policy_loss.loss_mode: dro`` with ``dro_beta``; docs/methods.md,
    section "Baseline surrogates"):

    .. math::
        \ell_t = -\Big(A_t\log\pi_\theta(o_t) - \frac{\beta}{2}\big(\log\pi_\theta(o_t)
        - \log\pi_{old}(o_t)\big)^2\Big),\qquad
        \frac{\partial\ell_t}{\partial\log\pi_\theta} = -A_t + \beta\,(\log\pi_\theta
        - \log\pi_{old}).

    The penalty is k2 of the token against the behaviour policy: it pulls the policy back
    towards the sampler as the update moves (0 gradient on-policy). The log-ratio is not
    clipped (verl's is not).

    Args:
        beta: the penalty's coefficient, > 0 (verl ``dro_beta``, required there; default 1.0).

    Diagnostics: clip fractions 0; ratio statistics of :math:`w = \pi_\theta/\pi_{old}`.
    """

    beta: float = 1.0
    name: ClassVar[str] = "dro"

    def __post_init__(self) -> None:
        if _finite_number(self.name, "beta", self.beta) <= 0:
            raise ValueError(f"{self.name}: beta must be > 0, got {self.beta!r}")

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lp, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        old = torch.where(m, old_logp.detach().to(lp.dtype), 0.0)
        raw = lp - old  # the log-ratio, not clipped (verl's is not); 0 where masked
        loss = torch.where(m, -(lp * adv - (0.5 * self.beta) * raw.square()), 0.0)
        return loss, _ratio_diag(torch.exp(log_ratio), m)
