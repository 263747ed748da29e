r"""f-divergences between the policy and the reference: sampled-token estimators and exact
full-vocabulary forms (docs/methods.md, section "f-divergences").

For a convex :math:`f` with :math:`f(1) = 0` (Csiszár 1967; Ali and Silvey 1966), with
:math:`p = \pi_\theta(\cdot\mid h)`, :math:`q = \pi_{\text{ref}}(\cdot\mid h)` and the ratio
:math:`w_v = p_v / q_v`,

.. math::
    D_f(\pi_\theta\,\|\,\pi_{\text{ref}}) = \sum_v q_v\, f(w_v)
      = \mathbb E_{v\sim\pi_\theta}\big[g(t_v)\big],\qquad
    g(t) = \frac{f(e^t) - f'(1)(e^t - 1)}{e^t},\quad t = \log p_v - \log q_v .

Subtracting :math:`f'(1)(w - 1)` changes nothing in expectation (:math:`\mathbb E_q[w - 1] = 0`)
and makes :math:`f \ge 0`, hence :math:`g \ge 0` on every token (the k3 construction of
Schulman 2020: for :math:`f = w\log w`, :math:`g = \rho - 1 - \log\rho` with
:math:`\rho = 1/w`).

* ``fkl``: KL(π_ref ‖ π) = Σ q log(q/p); f(w) = -log w;
* ``js``: Jensen–Shannon, ½ KL(p ‖ m) + ½ KL(q ‖ m) with m = (p + q)/2;
  f(w) = ½[w log(2w/(1+w)) + log(2/(1+w))];
* ``chi2``: Pearson χ²(π ‖ π_ref) = Σ (p - q)²/q; f(w) = (w - 1)²;
* ``hellinger``: squared Hellinger H² = ½ Σ (√p - √q)² = 1 - Σ √(pq); f(w) = ½(√w - 1)²;
* ``tv``: total variation ½ Σ |p - q|; f(w) = ½|w - 1|;
* ``alpha``: Amari's α-divergence Σ [αp + (1-α)q - p^α q^(1-α)] / (α(1-α));
  f(w) = (αw + 1 - α - w^α) / (α(1-α));
* ``kl_chi2``: KL(π ‖ π_ref) + (weight/2) χ²(π ‖ π_ref); f(w) = w log w + (weight/2)(w - 1)².

(JS: Lin 1991; Hellinger with the ½ so that H² ∈ [0, 1]; Amari 1985 / Cichocki and Amari 2010:
α → 1 gives KL(π ‖ π_ref), α → 0 gives KL(π_ref ‖ π), α = ½ gives 4 H², α = 2 gives ½ χ²;
KL–χ²: the mixture that PMD-mean regularises by, arXiv 2602.05933, with a constant weight here
where the paper's is adaptive.) DPH-RL (arXiv 2509.07430) regularises by the mass-covering ones
(forward KL, JS) to keep pass@k; f-GRPO (arXiv 2602.05946) trains with general f.

**Sampled estimator** (:func:`sampled_value`). On tokens sampled from :math:`\pi_{\text{old}}`
the per-token value is

.. math::
    \hat D = w_o\, g(\log\pi_\theta - \log\pi_{\text{ref}}),\qquad
    w_o = \exp(\log\pi_\theta - \log\pi_{\text{old}}) \ \ (\text{not detached}),

whose expectation over :math:`v \sim \pi_{\text{old}}` is exactly :math:`D_f` at that position,
and whose expected gradient is exactly :math:`\nabla_\theta D_f` (the importance weight carries
the score-function term, as in RPG's ``kl_k3_is``, arXiv 2505.17508). With no ``old_logp`` (on
policy) :math:`w_o = \exp(\log\pi_\theta - \mathrm{SG}(\log\pi_\theta))`: value :math:`g`,
gradient :math:`(g' + g)\nabla\log\pi_\theta`. Both value and gradient are unbiased per position
for every divergence here (conditionally on the prefix; the prefix distribution's own
dependence on :math:`\theta` is the surrogate's business, as for every per-token regularizer).

**Exact form** (:func:`full_rows`): :math:`\sum_v` over the whole vocabulary from the two
log-softmax rows, as :math:`q_v f(w_v)` where :math:`w_v \le 1` and as :math:`p_v g(t_v)` where
:math:`w_v > 1` (the same number; each side is evaluated where it cannot overflow or underflow to
a lost term).

**Numerical safety** (docs/methods.md, section "Numerical safety"): every exponential that can
grow (:math:`e^{|t|}`) is exact for arguments up to E = :func:`~gbmpo.objectives.regularizers.
exp_bound` (22.18 in float32, 177.45 in float64) and continues on its tangent line beyond, so
values and gradients are finite for any finite log-probs (in particular at ±1000 logits) and
exact in the normal range. ``tv`` has the subgradient 0 at :math:`p = q`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gbmpo.objectives.full_vocab import RowDivergence
from gbmpo.objectives.regularizers import (
    REGULARIZERS,
    Regularizer,
    _compute,
    _exp_of_log,
    _tangent_beyond,
    exp_bound,
)

__all__ = [
    "F_DIVERGENCES",
    "FDivergence",
    "f_divergence",
    "full_rows",
    "sampled_value",
]

_LOG2 = math.log(2.0)


def _expm1_safe(t: Tensor) -> Tensor:
    """e^t - 1, exact for t <= E (:func:`~gbmpo.objectives.regularizers.exp_bound`), on its
    tangent (e^E - 1) + e^E (t - E) beyond."""
    e = exp_bound(t.dtype)
    return _tangent_beyond(t, torch.expm1, math.expm1(e), math.exp(e), e)


@dataclass(frozen=True)
class FDivergence:
    r"""One f-divergence as two halves of the same function of the log-ratio t = log p - log q:

    * ``f_neg(t)`` = :math:`f(e^t) - f'(1)(e^t - 1)` for t <= 0 (per unit of reference mass),
    * ``g_pos(t)`` = the same divided by :math:`e^t`, for t >= 0 (per unit of policy mass).

    Each is only ever evaluated on its own half-line, where it is finite."""

    name: str
    f_neg: Callable[[Tensor], Tensor]
    g_pos: Callable[[Tensor], Tensor]
    description: str


def sampled_value(div: FDivergence, t: Tensor) -> Tensor:
    r""":math:`g(t) = [f(e^t) - f'(1)(e^t - 1)]\,e^{-t}` for any t: ``g_pos`` for t >= 0,
    ``f_neg(t) * e^{-t}`` (tangent-safe exponential) for t < 0."""
    pos = t >= 0
    tp, tn = t.clamp_min(0.0), t.clamp_max(0.0)
    return torch.where(pos, div.g_pos(tp), div.f_neg(tn) * _exp_of_log(-tn))


def full_rows(div: FDivergence, log_p: Tensor, log_q: Tensor) -> Tensor:
    r""":math:`D_f = \sum_v q_v f(w_v) = \sum_v p_v g(t_v)` over the last dimension, from
    log-softmax rows (finite): :math:`q_v f` where :math:`t_v < 0`, :math:`p_v g` where
    :math:`t_v \ge 0`."""
    t = log_p - log_q
    pos = t >= 0
    tp, tn = t.clamp_min(0.0), t.clamp_max(0.0)
    terms = torch.where(pos, log_p.exp() * div.g_pos(tp), log_q.exp() * div.f_neg(tn))
    return terms.sum(-1)


# --- the divergences (t = log p - log q; f_neg on t <= 0, g_pos on t >= 0) ---------------------


def _fkl() -> FDivergence:
    # f = -log w + (w - 1)  (f'(1) = -1)
    return FDivergence(
        "fkl",
        lambda t: torch.expm1(t) - t,
        lambda t: -torch.expm1(-t) - t * torch.exp(-t),
        "KL(pi_ref || pi) = sum_v q_v log(q_v / p_v)",
    )


def _rkl() -> FDivergence:
    # f = w log w - (w - 1)  (f'(1) = 1); g = t - 1 + e^-t (k3)
    return FDivergence(
        "rkl",
        lambda t: torch.exp(t) * t - torch.expm1(t),
        lambda t: t + torch.expm1(-t),
        "KL(pi || pi_ref) = sum_v p_v log(p_v / q_v)",
    )


def _chi2() -> FDivergence:
    # f = (w - 1)^2, f'(1) = 0; g = w - 2 + 1/w
    return FDivergence(
        "chi2",
        lambda t: torch.expm1(t).square(),
        lambda t: _expm1_safe(t) + torch.expm1(-t),
        "Pearson chi^2(pi || pi_ref) = sum_v (p_v - q_v)^2 / q_v",
    )


def _hellinger() -> FDivergence:
    # f = (sqrt w - 1)^2 / 2; g = (1 - w^-1/2)^2 / 2
    return FDivergence(
        "hellinger",
        lambda t: 0.5 * torch.expm1(0.5 * t).square(),
        lambda t: 0.5 * torch.expm1(-0.5 * t).square(),
        "H^2 = 1/2 sum_v (sqrt p_v - sqrt q_v)^2 = 1 - sum_v sqrt(p_v q_v)",
    )


def _log_cosh(y: Tensor) -> Tensor:
    """log cosh y without cancellation: ½ log1p(sinh² y) for |y| < 1, else
    |y| + log1p(e^{-2|y|}) - log 2."""
    a = y.abs()
    small = 0.5 * torch.log1p(torch.sinh(a.clamp_max(1.0)).square())
    large = a + torch.log1p(torch.exp(-2.0 * a)) - _LOG2
    return torch.where(a < 1.0, small, large)


def js_core(t: Tensor) -> Tensor:
    r""":math:`h(t) = \tfrac12 t \tanh(t/2) - \log\cosh(t/2) = \log 2 - H(\sigma(t))` (H the
    binary entropy in nats), even in t, :math:`\ge 0`, :math:`\approx t^2/8` near 0. The
    Jensen–Shannon integrand is :math:`f(w) = \tfrac{1+w}{2} h(\log w)` (Lin 1991): with
    :math:`m = (1+w)/2` and :math:`a = w/(1+w)`, :math:`f = m[\log 2 + a\log a + (1-a)\log(1-a)]`.
    Both terms of h are accurate to a relative rounding error and agree to first order only in
    sign, so h keeps its relative accuracy near t = 0, where the direct form
    :math:`\tfrac12[w\log\tfrac{2w}{1+w} + \log\tfrac{2}{1+w}]` cancels to below 0 in float32."""
    return 0.5 * t * torch.tanh(0.5 * t) - _log_cosh(0.5 * t)


def _js() -> FDivergence:
    # f = 1/2 [w log(2w/(1+w)) + log(2/(1+w))] = (1 + w)/2 h(t), f'(1) = 0 (js_core)
    def f_neg(t: Tensor) -> Tensor:
        return 0.5 * (1.0 + torch.exp(t)) * js_core(t)

    def g_pos(t: Tensor) -> Tensor:
        return 0.5 * (1.0 + torch.exp(-t)) * js_core(t)

    return FDivergence(
        "js", f_neg, g_pos,
        "JS = 1/2 KL(pi || m) + 1/2 KL(pi_ref || m), m = (pi + pi_ref) / 2",
    )  # fmt: skip


def _tv() -> FDivergence:
    return FDivergence(
        "tv",
        lambda t: 0.5 * torch.expm1(t).abs(),
        lambda t: 0.5 * torch.expm1(-t).abs(),
        "TV = 1/2 sum_v |p_v - q_v|",
    )


def _alpha(alpha: float) -> FDivergence:
    r"""Amari's α-divergence; α = 1 and α = 0 are the two KLs (their own formulas, exact)."""
    if alpha == 1.0:
        base = _rkl()
    elif alpha == 0.0:
        base = _fkl()
    else:
        a = float(alpha)
        c = 1.0 / (a * (1.0 - a))

        # f = [a (w - 1) - (w^a - 1)] / (a (1 - a));  g = f / w
        def f_neg(t: Tensor) -> Tensor:
            return c * (a * torch.expm1(t) - _expm1_safe(a * t))

        def g_pos(t: Tensor) -> Tensor:
            return c * ((1.0 - a) * torch.expm1(-t) - _expm1_safe((a - 1.0) * t))

        return FDivergence(
            "alpha", f_neg, g_pos,
            f"Amari alpha-divergence (alpha={a:g}): "
            "sum_v [a p_v + (1 - a) q_v - p_v^a q_v^(1-a)] / (a (1 - a))",
        )  # fmt: skip
    return FDivergence(
        "alpha", base.f_neg, base.g_pos, f"Amari alpha-divergence (alpha={alpha:g}): "
        + base.description
    )  # fmt: skip


def _kl_chi2(weight: float) -> FDivergence:
    kl, chi = _rkl(), _chi2()
    half = 0.5 * float(weight)
    return FDivergence(
        "kl_chi2",
        lambda t: kl.f_neg(t) + half * chi.f_neg(t),
        lambda t: kl.g_pos(t) + half * chi.g_pos(t),
        f"KL(pi || pi_ref) + ({float(weight):g} / 2) chi^2(pi || pi_ref)",
    )


def _number(name: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"regularizer {name!r}: {key} must be a finite number, got {value!r}")
    return float(value)


def f_divergence(name: str, **params: float) -> FDivergence:
    """The :class:`FDivergence` of a registered f-divergence regularizer ``name`` (``alpha``
    takes ``alpha``, ``kl_chi2`` takes ``weight`` >= 0)."""
    if name == "alpha":
        return _alpha(_number(name, "alpha", params.pop("alpha", 0.5)))
    if name == "kl_chi2":
        w = _number(name, "weight", params.pop("weight", 1.0))
        if w < 0:
            raise ValueError(f"regularizer 'kl_chi2': weight must be >= 0, got {w!r}")
        return _kl_chi2(w)
    makers = {"fkl": _fkl, "js": _js, "chi2": _chi2, "hellinger": _hellinger, "tv": _tv}
    if name not in makers:
        raise ValueError(f"{name!r} is not an f-divergence; valid: {', '.join(F_DIVERGENCES)}")
    return makers[name]()


#: the f-divergence regularizers registered here
F_DIVERGENCES: tuple[str, ...] = ("fkl", "js", "chi2", "hellinger", "tv", "alpha", "kl_chi2")


def _regularizer(div: FDivergence, params: dict[str, float]) -> Regularizer:
    def formula(logp: Tensor, anchor_logp: Tensor, old_logp: Tensor | None) -> Tensor:
        lp, rp = _compute(logp, anchor_logp)
        anchor = lp.detach() if old_logp is None else old_logp.to(lp.dtype)
        return _exp_of_log(lp - anchor) * sampled_value(div, lp - rp)

    def rows(log_p: Tensor, log_q: Tensor) -> Tensor:
        return full_rows(div, log_p, log_q)

    return Regularizer(
        div.name,
        formula,
        params=params,
        full=RowDivergence(div.name, rows, div.description),
    )


def _register() -> None:
    def simple(name: str) -> Callable[[], Regularizer]:
        def make() -> Regularizer:
            return _regularizer(f_divergence(name), {})

        make.__doc__ = f"{name}: {f_divergence(name).description} (gbmpo.objectives.f_divergences)"
        return make

    for name in ("fkl", "js", "chi2", "hellinger", "tv"):
        REGULARIZERS.register(name, simple(name))

    def make_alpha(alpha: float = 0.5) -> Regularizer:
        """alpha: Amari alpha-divergence with parameter ``alpha`` (1: KL(pi || pi_ref), 0:
        KL(pi_ref || pi))."""
        return _regularizer(f_divergence("alpha", alpha=alpha), {"alpha": float(alpha)})

    def make_kl_chi2(weight: float = 1.0) -> Regularizer:
        """kl_chi2: KL(pi || pi_ref) + (weight / 2) chi^2(pi || pi_ref) (PMD-mean's mixture)."""
        return _regularizer(f_divergence("kl_chi2", weight=weight), {"weight": float(weight)})

    REGULARIZERS.register("alpha", make_alpha)
    REGULARIZERS.register("kl_chi2", make_kl_chi2)


_register()
