r"""Clipping by a policy divergence: the admissible ratio interval of each measure.

The unified clipping framework of ATR-GRPO (arXiv 2602.05494) keeps a token's importance ratio
:math:`w = \pi_\theta(o_t)/\pi_{\text{old}}(o_t)` inside the region

.. math::
    \mathcal R_\delta = \{\, w > 0 : f(w) \le \delta \,\},\qquad f(1) = 0,

of a policy-divergence measure :math:`f` that decreases on :math:`(0, 1]` and increases on
:math:`[1, \infty)`, so :math:`\mathcal R_\delta` is an interval :math:`[l, u] \ni 1`. With an
asymmetric radius the lower end uses :math:`\delta_{\text{low}}` (the part :math:`w \le 1`) and
the upper end :math:`\delta_{\text{high}}` (:math:`w \ge 1`). The surrogate
:class:`gbmpo.objectives.surrogates.DivergenceClipSurrogate` (``divergence_clip``) then applies
the PPO clip with these bounds. The measures (:data:`CLIP_MEASURES`):

* ``ratio``: :math:`f(w) = |w - 1|`, :math:`[\max(0, 1-\delta), 1+\delta]` (PPO / GRPO clip);
* ``k1``: :math:`f(w) = |\log w|`, :math:`[e^{-\delta}, e^{\delta}]` (ATR-GRPO);
* ``k2``: :math:`f(w) = \tfrac12 \log^2 w`, :math:`[e^{-\sqrt{2\delta}}, e^{\sqrt{2\delta}}]`
  (ATR-GRPO);
* ``k3``: :math:`f(w) = w - 1 - \log w`, :math:`[-W_0(z), -W_{-1}(z)]` with Lambert W
  (ATR-GRPO's KL3 trust region);
* ``prob_l2``: :math:`f(w) = (w p - p)^2 = (w-1)^2 p^2`,
  :math:`[\max(0, 1-\sqrt\delta/p), 1+\sqrt\delta/p]`, per token (GBMPO arXiv 2602.04380);
* ``neural_mirror``: :math:`f(w) = D_h(w p, p)`, bisection tabulated in :math:`p`, per token
  (GBMPO);
* ``dppo_tv``: :math:`f(w) = |w p - p|`, the total variation between the binary distributions
  :math:`(p, 1-p)` and :math:`(wp, 1-wp)`, :math:`[\max(0, 1-\delta/p), 1+\delta/p]`, per token
  (DPPO-Binary-TV, arXiv 2602.04879);
* ``dppo_kl``: :math:`f(w) = p\log\frac{1}{w} + (1-p)\log\frac{1-p}{1-wp}`, the binary KL
  :math:`\mathrm{KL}(\mathrm{Bern}(p)\,\|\,\mathrm{Bern}(wp))`, bisection, per token
  (DPPO-Binary-KL, arXiv 2602.04879).

(:math:`z = -e^{-(1+\delta)}`; :math:`p = \pi_{\text{old}}(o_t)`, the sampled token's
probability under the rollout policy.) The last two are GBMPO's Bregman divergences between the
token's new and old probability, :math:`D_h(\pi_\theta(o_t), \pi_{\text{old}}(o_t))` with
:math:`\pi_\theta(o_t) = w\,p`, used here as clipping measures instead of penalties; their
interval depends on :math:`p`, so their bounds are per-token tensors. ``prob_l2`` is exactly the
``prob_l2`` regularizer of :mod:`gbmpo.objectives.regularizers`, :math:`(p_\theta - q)^2`, the
Bregman divergence of :math:`h(y) = y^2` (not :math:`\tfrac12 y^2`, which would halve it and give
:math:`\sqrt{2\delta}/p`). ``neural_mirror`` and ``dppo_kl`` have no closed form: their ends are
found by bisection, in :mod:`gbmpo.objectives.clip_bisection` (``neural_mirror``'s solved once
per map and radius on a grid of :math:`p`).
The lower end is 0 (no lower clip) where the region reaches :math:`w \to 0`, the upper
end :math:`+\infty` where it contains every attainable ratio (:math:`w \le 1/p`).

The two DPPO measures come with DPPO's loss instead of PPO's clip (see
:func:`dppo_valid_mask` and :func:`gbmpo.objectives.surrogates.dppo_loss`): the token's gradient
is masked where the divergence leaves the region in the direction its advantage pushes, which is
the same set of tokens the clip with these bounds removes, and the mask is evaluated directly on
the divergence (as DPPO's code does) rather than through the interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from scipy.special import lambertw
from torch import Tensor

from gbmpo.objectives.clip_bisection import (
    BINARY_KL_EPS,
    binary_kl,
    check_radius,
    dppo_kl_interval,
    measure_dppo_kl,
    measure_mirror,
    mirror_interval,
)
from gbmpo.registry import Registry

__all__ = [
    "CLIP_MEASURES",
    "CLIP_MEASURE_REGISTRY",
    "BINARY_KL_EPS",
    "ClipMeasure",
    "DPPO_MEASURES",
    "PER_TOKEN_MEASURES",
    "atr_bounds",
    "binary_kl",
    "dppo_tv_interval",
    "dppo_valid_mask",
    "k1_interval",
    "k2_interval",
    "k3_interval",
    "measure_k1",
    "measure_k2",
    "measure_dppo_kl",
    "measure_dppo_tv",
    "measure_k3",
    "measure_mirror",
    "measure_prob_l2",
    "measure_ratio",
    "prob_l2_interval",
    "ratio_interval",
]

#: every measure ``divergence_clip`` accepts
CLIP_MEASURES: tuple[str, ...] = (
    "ratio", "k1", "k2", "k3", "prob_l2", "neural_mirror", "dppo_tv", "dppo_kl",
)  # fmt: skip
#: measures whose interval depends on the token's old probability (tensor bounds)
PER_TOKEN_MEASURES: tuple[str, ...] = ("prob_l2", "neural_mirror", "dppo_tv", "dppo_kl")
#: measures that bring DPPO's masked, truncated-importance-weight loss (arXiv 2602.04879)
DPPO_MEASURES: tuple[str, ...] = ("dppo_tv", "dppo_kl")


# --------------------------------------------------------------------------------- measures


def measure_ratio(w: Tensor) -> Tensor:
    r""":math:`f(w) = |w - 1|`: the ratio clip of PPO / GRPO as a divergence (ATR-GRPO,
    arXiv 2602.05494, the framework's first instance)."""
    return (w - 1.0).abs()


def measure_k1(w: Tensor) -> Tensor:
    r""":math:`f(w) = |\log w|`: the k1 estimator's magnitude (ATR-GRPO, arXiv 2602.05494)."""
    return torch.log(w).abs()


def measure_k2(w: Tensor) -> Tensor:
    r""":math:`f(w) = \tfrac12 \log^2 w`: the k2 estimator (ATR-GRPO, arXiv 2602.05494)."""
    return 0.5 * torch.log(w).square()


def measure_k3(w: Tensor) -> Tensor:
    r""":math:`f(w) = w - 1 - \log w`: the k3 estimator, ATR-GRPO's KL3 trust region
    (arXiv 2602.05494)."""
    return w - 1.0 - torch.log(w)


def measure_prob_l2(w: Tensor, p_old: Tensor) -> Tensor:
    r""":math:`f(w) = (w p - p)^2 = (w - 1)^2 p^2`: the ProbL2 Bregman divergence
    (:math:`h(y) = y^2`) between the token's new probability :math:`w p` and old one :math:`p`
    (GBMPO, arXiv 2602.04380; the ``prob_l2`` regularizer's formula)."""
    return (w * p_old - p_old).square()


def measure_dppo_tv(w: Tensor, p_old: Tensor) -> Tensor:
    r""":math:`f(w) = |w p - p|`: total variation between the binary distributions
    :math:`(p, 1-p)` and :math:`(p', 1-p')`, :math:`p' = wp` (DPPO-Binary-TV, Qi et al.,
    arXiv 2602.04879, "binary approximation" of the TV trust region)."""
    return (w * p_old - p_old).abs()


def dppo_valid_mask(
    measure: str,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    delta_low: float,
    delta_high: float,
) -> Tensor:
    r"""DPPO's trust-region mask (Qi et al., arXiv 2602.04879, DPPO-Binary-TV / -KL), bool:
    :math:`M = [D(p, p') \le \delta_{\text{high}} \lor p' \le p]` for :math:`A > 0`, else
    :math:`[D(p, p') \le \delta_{\text{low}} \lor p' \ge p]`, with :math:`p`, :math:`p'` the
    old and new probabilities of the token and :math:`D` the binary TV :math:`|p' - p|`
    (``dppo_tv``) or :func:`binary_kl` (``dppo_kl``).

    A token keeps its gradient unless its probability moved beyond the radius in the direction
    its advantage pushes: the set the clip with :func:`dppo_tv_interval` /
    :func:`~gbmpo.objectives.clip_bisection.dppo_kl_interval` keeps, evaluated directly.
    Inputs are detached."""
    lp, old = logp.detach(), old_logp.detach()
    p_new, p_old = torch.exp(lp), torch.exp(old)
    if measure == "dppo_tv":
        diff = p_new - p_old
        pos, neg = diff <= delta_high, diff >= -delta_low
    elif measure == "dppo_kl":
        kl = binary_kl(p_old, old, p_new, lp)
        pos = (kl <= delta_high) | (p_new <= p_old)
        neg = (kl <= delta_low) | (p_new >= p_old)
    else:
        raise ValueError(f"not a DPPO measure: {measure!r}; valid: {', '.join(DPPO_MEASURES)}")
    return torch.where(adv > 0, pos, neg)


# ------------------------------------------------------------------------- closed forms


def ratio_interval(delta_low: float, delta_high: float) -> tuple[float, float]:
    r"""``ratio``: :math:`|w-1| \le \delta` gives :math:`[\max(0, 1-\delta_{\text{low}}),
    1+\delta_{\text{high}}]` (PPO's clip with :math:`\varepsilon = \delta`)."""
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    return max(0.0, 1.0 - dl), 1.0 + dh


def k1_interval(delta_low: float, delta_high: float) -> tuple[float, float]:
    r"""``k1``: :math:`|\log w| \le \delta` gives :math:`[e^{-\delta_{\text{low}}},
    e^{\delta_{\text{high}}}]` (ATR-GRPO, arXiv 2602.05494)."""
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    return math.exp(-dl), math.exp(dh)


def k2_interval(delta_low: float, delta_high: float) -> tuple[float, float]:
    r"""``k2``: :math:`\tfrac12\log^2 w \le \delta` gives :math:`[e^{-\sqrt{2\delta_{\text{low}}}},
    e^{\sqrt{2\delta_{\text{high}}}}]` (ATR-GRPO, arXiv 2602.05494)."""
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    return math.exp(-math.sqrt(2.0 * dl)), math.exp(math.sqrt(2.0 * dh))


def atr_bounds(delta: float) -> tuple[float, float]:
    r"""ATR-GRPO ratio bounds: the interval where :math:`\mathrm{KL3}(w) = w - 1 - \log w \le
    \delta` (UCF, arXiv 2602.05494 §KL3 clipping):

    .. math::
        l_\delta = -W_0(z),\quad u_\delta = -W_{-1}(z),\quad z = -e^{-(1+\delta)},

    with :math:`W_0, W_{-1}` the two real branches of Lambert W (``scipy.special.lambertw``).
    E.g. ``atr_bounds(0.02) == (0.8131..., 1.2135...)``.
    """
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise TypeError(f"delta must be a number, got {type(delta).__name__}")
    if not (math.isfinite(delta) and delta > 0):
        raise ValueError(f"ATR delta must be finite and > 0, got {delta!r}")
    z = -math.exp(-(1.0 + float(delta)))
    w0 = complex(lambertw(z, 0))
    wm1 = complex(lambertw(z, -1))
    low, high = -w0.real, -wm1.real
    if not (0.0 < low < 1.0 < high) or abs(w0.imag) > 1e-9 or abs(wm1.imag) > 1e-9:
        raise ValueError(f"Lambert W gave no real interval for delta={delta!r}: ({low}, {high})")
    return low, high


def k3_interval(delta_low: float, delta_high: float) -> tuple[float, float]:
    r"""``k3``: :math:`w - 1 - \log w \le \delta` gives :math:`[-W_0(z_{\text{low}}),
    -W_{-1}(z_{\text{high}})]`, :math:`z = -e^{-(1+\delta)}` (:func:`atr_bounds`, ATR-GRPO
    arXiv 2602.05494)."""
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    return atr_bounds(dl)[0], atr_bounds(dh)[1]


def prob_l2_interval(p_old: Tensor, delta_low: float, delta_high: float) -> tuple[Tensor, Tensor]:
    r"""``prob_l2``, per token: :math:`(w-1)^2 p^2 \le \delta` gives
    :math:`|w - 1| \le \sqrt\delta / p`, i.e.
    :math:`[\max(0, 1 - \sqrt{\delta_{\text{low}}}/p),\ 1 + \sqrt{\delta_{\text{high}}}/p]`
    (GBMPO ProbL2, arXiv 2602.04380; :math:`h(y) = y^2` as in the ``prob_l2`` regularizer).
    ``p_old`` is the sampled token's old probability (any shape); computed in float64."""
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    p = p_old.to(torch.float64)
    return (1.0 - math.sqrt(dl) / p).clamp_min(0.0), 1.0 + math.sqrt(dh) / p


def dppo_tv_interval(p_old: Tensor, delta_low: float, delta_high: float) -> tuple[Tensor, Tensor]:
    r"""``dppo_tv``, per token: :math:`|wp - p| \le \delta` gives
    :math:`[\max(0, 1 - \delta_{\text{low}}/p),\ 1 + \delta_{\text{high}}/p]` (DPPO-Binary-TV,
    arXiv 2602.04879); float64."""
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    p = p_old.to(torch.float64)
    return (1.0 - dl / p).clamp_min(0.0), 1.0 + dh / p


# ------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class ClipMeasure:
    """What ``divergence_clip`` needs of a measure: its admissible interval and its kind.

    Exactly one of ``bounds`` (token-independent measures) and ``interval`` (per-token ones)
    is set."""

    name: str
    #: ``(delta_low, delta_high) -> (l, u)``: the interval, the same for every token
    bounds: Callable[[float, float], tuple[float, float]] | None = None
    #: ``(p_old, delta_low, delta_high, mirror) -> (l, u)``: float64 tensors of ``p_old``'s shape
    interval: Callable[[Tensor, float, float, Any], tuple[Tensor, Tensor]] | None = None
    #: DPPO's masked, truncated-importance-weight loss instead of the PPO clip
    dppo: bool = False
    #: takes a neural mirror map (``mirror``)
    needs_mirror: bool = False

    def __post_init__(self) -> None:
        if (self.bounds is None) == (self.interval is None):
            raise ValueError(f"clip measure {self.name!r}: give exactly one of bounds, interval")

    @property
    def per_token(self) -> bool:
        """Whether the interval depends on the token's old probability."""
        return self.interval is not None


#: the measures ``divergence_clip`` accepts, by name (an unknown name lists the valid ones);
#: a plugin adds one with ``CLIP_MEASURE_REGISTRY.register(name, ClipMeasure(...))``
CLIP_MEASURE_REGISTRY: Registry[ClipMeasure] = Registry("clip measure")


def _prob_l2_interval(p_old: Tensor, lo: float, hi: float, mirror: Any) -> tuple[Tensor, Tensor]:
    return prob_l2_interval(p_old, lo, hi)


def _dppo_tv_interval(p_old: Tensor, lo: float, hi: float, mirror: Any) -> tuple[Tensor, Tensor]:
    return dppo_tv_interval(p_old, lo, hi)


def _mirror_interval(p_old: Tensor, lo: float, hi: float, mirror: Any) -> tuple[Tensor, Tensor]:
    return mirror_interval(p_old, mirror, lo, hi)


def _dppo_kl_interval(p_old: Tensor, lo: float, hi: float, mirror: Any) -> tuple[Tensor, Tensor]:
    return dppo_kl_interval(p_old, lo, hi)


for _m in (
    ClipMeasure("ratio", bounds=ratio_interval),
    ClipMeasure("k1", bounds=k1_interval),
    ClipMeasure("k2", bounds=k2_interval),
    ClipMeasure("k3", bounds=k3_interval),
    ClipMeasure("prob_l2", interval=_prob_l2_interval),
    ClipMeasure("neural_mirror", interval=_mirror_interval, needs_mirror=True),
    ClipMeasure("dppo_tv", interval=_dppo_tv_interval, dppo=True),
    ClipMeasure("dppo_kl", interval=_dppo_kl_interval, dppo=True),
):
    CLIP_MEASURE_REGISTRY.register(_m.name, _m)
del _m
