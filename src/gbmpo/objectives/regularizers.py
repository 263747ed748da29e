"""Selected-token regularizers: per-token divergence values on the sampled token's log-probs.

Every regularizer is built by name with :func:`get_regularizer` and is a callable taking keyword
arguments only

    reg(logp=, old_logp=None, anchor_logp=None, mask=None) -> Tensor[B, T]

returning per-token values (the caller multiplies by its coefficient and aggregates). Inputs are
log-probabilities of the *sampled* token under the policy (``logp``, with grad), the anchor
(``anchor_logp``: the frozen reference, or, RPG-style, the rollout policy; the caller's choice) and
optionally the rollout policy (``old_logp``). Math is float32 whatever the input dtype (float64
stays float64). ``mask`` ({0,1} or bool, same shape) zeroes padded positions; their inputs are
replaced by 0 before computing so that garbage there cannot produce NaN values or gradients.

Numerical safety (docs/methods.md, section "Numerical safety"): for finite log-probs every
regularizer returns a finite value and a finite gradient in float32, bf16/fp16 (computed in float32)
and float64, with or without ``clamp``. The exp-based ones (``kl_k3``, ``kl_k3_is``, ``rpg_rkl``,
``rpg_ufkl``, ``rpg_urkl``) are exact for log-ratios up to E = :func:`exp_bound` (22.18 in float32,
177.45 in float64; a ratio of 4.3e9 in float32) and continue on their tangent line beyond, so their
gradient there is the constant value it has at E (the plain formulas overflow at log-ratio 88.7 in
float32: inf values without ``clamp``, NaN gradients (inf * 0) with it). ``clamp`` then clips the
value with zero gradient where it binds, as verl and the RPG code do. Masked positions may hold
anything (NaN, +-inf): they give 0 and exactly 0 gradient.

Notation: l = logp, r = anchor_logp, o = old_logp, p = exp(l), q = exp(r), rho = q / p,
w = exp(l - r) (RPG, anchor r). "d/dl" is the derivative of the per-token value with respect to
the policy log-prob (the gradient weight on grad log pi_theta).

==================  ==============================================  ========  ===============
name                value                                           d/dl      source
==================  ==============================================  ========  ===============
``none``            0                                               0
``kl_k1``           l - r                                           1         Schulman 2020
``kl_k2``           (l - r)^2 / 2                                   l - r     Schulman 2020
``kl_k3``           rho - 1 - log rho                               1 - rho   Schulman; TRL
``kl_k3_is``        w_o (rho - 1 - log rho), w_o = exp(l - o)       see fn    RPG 2505.17508
``kl_k1_st``        l - r (value of k1)                             l - r     verl ``k1+``
``kl_k3_st``        rho - 1 - log rho (value of k3)                 l - r     verl ``k3+``
``prob_l2``         (p - q)^2                                       2(p-q)p   GBMPO 2602.04380
``log_l2``          (l - r)^2                                       2(l - r)  GBMPO code (L2)
``neural_mirror``   D_h(p, q) of a NeuralMirrorMap                  (h'(p)-h'(q))p  GBMPO
``rpg_fkl``         -log w                                          -1        RPG Table 1
``rpg_rkl``         w log w                                         w(log w+1)  RPG Table 1
``rpg_ufkl``        w - log w - 1                                   w - 1     RPG Table 4
``rpg_urkl``        w (log w - 1) + 1                               w log w   RPG Table 4
==================  ==============================================  ========  ===============

The f-divergences ``fkl``, ``js``, ``chi2``, ``hellinger``, ``tv``, ``alpha`` and ``kl_chi2``
are registered by :mod:`gbmpo.objectives.f_divergences` (importing :mod:`gbmpo.objectives`
registers them).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.mirror import NeuralMirrorMap, as_mirror_map
from gbmpo.objectives.potentials import NegEntropy, Square
from gbmpo.objectives.tensors import compute_dtype
from gbmpo.registry import Registry

__all__ = [
    "REGULARIZERS",
    "Regularizer",
    "exp_bound",
    "get_regularizer",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k1_st",
    "kl_k3_is",
    "kl_k3_st",
    "log_l2",
    "mirror_bregman",
    "prob_l2",
    "rpg_fkl",
    "rpg_rkl",
    "rpg_ufkl",
    "rpg_urkl",
]


# --- the formulas (pure functions on float tensors of equal shape) ----------------------------


def _clamp(x: Tensor, clamp: float | None) -> Tensor:
    return x if clamp is None else x.clamp(-clamp, clamp)


def exp_bound(dtype: torch.dtype) -> float:
    """E = log(largest finite number of the compute dtype) / 4: 22.18 for float32 (and bf16 /
    fp16 inputs, which are computed in float32), 177.45 for float64.

    The exp-based regularizers are exact for log-ratios t <= E and continue on their tangent
    line beyond (:func:`_tangent_beyond`). The quarter keeps e^E (about 4.3e9 in float32), its
    square (Adam's second moment of such a gradient) and sums of very many such terms finite.
    """
    return _EXP_BOUND_F64 if dtype == torch.float64 else _EXP_BOUND_F32


_EXP_BOUND_F32 = 0.25 * math.log(torch.finfo(torch.float32).max)
_EXP_BOUND_F64 = 0.25 * math.log(torch.finfo(torch.float64).max)


def _compute(*xs: Tensor) -> tuple[Tensor, ...]:
    """The inputs in the compute dtype: float64 stays, everything else becomes float32."""
    dt = compute_dtype(*xs)
    return tuple(x.to(dt) for x in xs)


def _tangent_beyond(
    t: Tensor, f: Callable[[Tensor], Tensor], f_e: float, df_e: float, bound: float
) -> Tensor:
    """f(t) for t <= E = ``bound``; f(E) + f'(E) (t - E) beyond (``f_e`` = f(E), ``df_e`` = f'(E)).

    f is evaluated only on min(t, E), so neither the value nor the gradient can overflow (the
    issue-15 failure: exp(t) = inf for t > 88.7 in float32, then inf * 0 = NaN in the backward
    of a clamp). For t <= E the result is f(t) bit for bit (the tangent branch is not selected
    and gets a zero gradient); beyond E the value grows linearly and the derivative is the
    constant f'(E) (the exact one would be ~e^t), so the penalty keeps pulling back.
    """
    inside = f(t.clamp_max(bound))
    return torch.where(t > bound, f_e + df_e * (t - bound), inside)


def kl_k1(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    """k1 = log p - log q (Schulman 2020, "Approximating KL divergence"; verl ``kl``).

    Unbiased estimator of KL(pi_theta || pi_ref) on samples of pi_theta, can be negative;
    d/dlogp = 1 (so as a loss term its expected gradient on-policy is 0; docs/methods.md, section
    "KL estimators").
    """
    return logp - anchor_logp


def kl_k2(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    """k2 = (log p - log q)^2 / 2 (Schulman 2020; verl ``mse``). d/dlogp = log p - log q."""
    return 0.5 * (logp - anchor_logp).square()


def kl_k3(logp: Tensor, anchor_logp: Tensor, clamp: float | None = None) -> Tensor:
    """k3 = rho - 1 - log rho, rho = q / p (Schulman 2020; TRL's ``per_token_kl``, verl's
    ``low_var_kl``; docs/methods.md, "KL estimators"), computed as expm1(log rho) - log rho:
    d/dlogp = 1 - rho.

    ``clamp=c`` clips the value to [-c, c] (zero gradient where it binds; verl: 10, TRL: none).
    For log rho > E = :func:`exp_bound` (22.18 in float32) it continues on its tangent line, so
    value and gradient stay finite where the plain formula overflows (log rho > 88.7 in
    float32); below E it is the plain formula bit for bit (TRL parity). float32 (float64 stays).
    """
    logp, anchor_logp = _compute(logp, anchor_logp)
    log_rho = anchor_logp - logp
    return _clamp(_k3_of_log(log_rho), clamp)


def _k3_of_log(t: Tensor) -> Tensor:
    """e^t - 1 - t, exact for t <= E, on its tangent beyond (see :func:`kl_k3`)."""
    e = exp_bound(t.dtype)
    return _tangent_beyond(t, lambda x: torch.expm1(x) - x, math.expm1(e) - e, math.expm1(e), e)


def _exp_of_log(t: Tensor) -> Tensor:
    """e^t, exact for t <= E, on its tangent e^E (1 + t - E) beyond."""
    e = exp_bound(t.dtype)
    return _tangent_beyond(t, torch.exp, math.exp(e), math.exp(e), e)


def kl_k3_is(
    logp: Tensor, anchor_logp: Tensor, old_logp: Tensor | None = None, clamp: float | None = None
) -> Tensor:
    """Importance-corrected k3: w_o * k3(l, r) with w_o = exp(logp - old_logp) (not detached).

    RPG (arXiv 2505.17508, section 3; docs/methods.md, section "KL estimators"): on tokens sampled
    from pi_old, the off-policy-correct estimate of KL(pi_theta || pi_ref) is E_old[w_o k3]; the
    same as TRL's ``use_bias_correction_kl`` (DeepSeek-V3.2). d/dlogp = w_o (k3 + 1 - rho).
    With ``old_logp=None`` the tokens are taken as on-policy: w_o = exp(l - SG(l)), which has
    value 1 but carries the score-function gradient, giving d/dlogp = k3 + 1 - rho, whose
    expectation under pi_theta is the exact reverse-KL gradient. ``clamp`` clips k3 as in
    :func:`kl_k3` before weighting. Both exponentials (w_o and rho) are exact for log-ratios
    <= :func:`exp_bound` and continue on their tangent lines beyond, so value and gradient are
    finite for any finite log-probs (see :func:`kl_k3`).
    """
    logp, anchor_logp = _compute(logp, anchor_logp)
    anchor = logp.detach() if old_logp is None else old_logp.to(logp.dtype)
    return _exp_of_log(logp - anchor) * kl_k3(logp, anchor_logp, clamp)


def kl_k1_st(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    """Straight-through k1: the value of k1 = l - r with the gradient of k2 = (l - r)^2 / 2.

    ``k2 - SG(k2) + SG(k1)``, verl 0.9.1's ``kl_loss_type: k1+`` ("Rethinking KL
    regularization in RLHF", arXiv 2510.01555; docs/methods.md, section "KL estimators"). The
    value is k1's (unbiased for KL(pi_theta || pi_ref) on samples of pi_theta) and
    d/dlogp = l - r, whose expectation on-policy is the exact reverse-KL gradient (k1's own
    gradient, 1, has expectation 0).
    """
    logp, anchor_logp = _compute(logp, anchor_logp)
    k2 = kl_k2(logp, anchor_logp)
    return k2 - k2.detach() + kl_k1(logp, anchor_logp).detach()


def kl_k3_st(logp: Tensor, anchor_logp: Tensor, clamp: float | None = None) -> Tensor:
    """Straight-through k3: the value of k3 (:func:`kl_k3`, clipped to [-c, c] with ``clamp``)
    with the gradient of k2, d/dlogp = l - r (verl 0.9.1's ``k3+``, arXiv 2510.01555).

    verl's ``k3+`` takes its forward value from ``low_var_kl`` (always clipped to [-10, 10]);
    ``clamp=10`` is that. The clip acts on the value only: the k2 gradient is never cut.
    """
    logp, anchor_logp = _compute(logp, anchor_logp)
    k2 = kl_k2(logp, anchor_logp)
    return k2 - k2.detach() + kl_k3(logp, anchor_logp, clamp).detach()


def prob_l2(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    """ProbL2: (p - q)^2 with p = exp(logp), q = exp(anchor_logp) (GBMPO, arXiv 2602.04380).

    The Bregman divergence of h(y) = y^2 on the sampled token (docs/methods.md, section "GBMPO
    regularizers"); d/dlogp = 2 (p - q) p. The authors' code floors p and q at 1e-10; that is only
    needed for logarithms, so no floor is applied here (the value changes by < 1e-20 and a floor
    would cut the gradient of tokens with p < 1e-10).
    """
    return (torch.exp(logp) - torch.exp(anchor_logp)).square()


def log_l2(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    """(log p - log q)^2: GBMPO code's ``L2GRPOTrainer`` (superseded by ProbL2; = 2 k2).

    d/dlogp = 2 (log p - log q). (docs/methods.md, section "GBMPO regularizers".)
    """
    return (logp - anchor_logp).square()


def mirror_bregman(logp: Tensor, anchor_logp: Tensor, mirror: NeuralMirrorMap) -> Tensor:
    """D_h(p, q) for a neural mirror map h, p = exp(logp), q = exp(anchor_logp) floored at 1e-10.

    GBMPO NM-GRPO (arXiv 2602.04380; docs/methods.md, section "Neural mirror map").
    d/dlogp = (h'(p) - h'(q)) p.
    """
    return mirror.bregman_log(logp, anchor_logp)


def rpg_fkl(logp: Tensor, anchor_logp: Tensor, clamp: float | None = None) -> Tensor:
    """-log w, w = exp(logp - anchor_logp): RPG FKL, KL(pi_anchor || pi_theta) (arXiv 2505.17508).

    Fully differentiable KL part of RPG Table 1 (code ``kl_loss_type=rpg_fkl``, docs/methods.md,
    section "RPG"); d/dlogp = -1. The RPG code does not clamp this one.
    """
    return _clamp(anchor_logp - logp, clamp)


def rpg_rkl(logp: Tensor, anchor_logp: Tensor, clamp: float | None = None) -> Tensor:
    """w log w: RPG RKL, KL(pi_theta || pi_anchor) (arXiv 2505.17508 Table 1; code ``rpg_rkl``).

    d/dlogp = w (log w + 1). The RPG code clamps the value to [-10, 10] (``clamp=10``).
    For log w > E = :func:`exp_bound` the value continues on its tangent,
    e^E E + e^E (E + 1)(log w - E), so value and gradient stay finite (see :func:`kl_k3`).
    """
    logp, anchor_logp = _compute(logp, anchor_logp)
    log_w = logp - anchor_logp
    e = exp_bound(log_w.dtype)
    ee = math.exp(e)
    val = _tangent_beyond(log_w, lambda t: torch.exp(t) * t, ee * e, ee * (e + 1.0), e)
    return _clamp(val, clamp)


def rpg_ufkl(logp: Tensor, anchor_logp: Tensor, clamp: float | None = None) -> Tensor:
    """w - log w - 1: RPG UFKL, UKL(pi_anchor || pi_theta) (arXiv 2505.17508 Table 4).

    d/dlogp = w - 1. Computed as expm1(log w) - log w (>= 0). RPG code clamps to [-10, 10].
    For log w > E = :func:`exp_bound` it continues on its tangent (as k3 in :func:`kl_k3`).
    """
    logp, anchor_logp = _compute(logp, anchor_logp)
    return _clamp(_k3_of_log(logp - anchor_logp), clamp)


def rpg_urkl(logp: Tensor, anchor_logp: Tensor, clamp: float | None = None) -> Tensor:
    """w (log w - 1) + 1: RPG URKL, UKL(pi_theta || pi_anchor) (arXiv 2505.17508 Table 4).

    Same gradient as the paper's w log w - w, shifted to be >= 0: d/dlogp = w log w.
    RPG code clamps to [-10, 10]. For log w > E = :func:`exp_bound` the value continues on its
    tangent, e^E (E - 1) + 1 + e^E E (log w - E), so value and gradient stay finite.
    """
    logp, anchor_logp = _compute(logp, anchor_logp)
    log_w = logp - anchor_logp
    e = exp_bound(log_w.dtype)
    ee = math.exp(e)
    val = _tangent_beyond(
        log_w, lambda t: torch.exp(t) * (t - 1.0) + 1.0, ee * (e - 1.0) + 1.0, ee * e, e
    )
    return _clamp(val, clamp)


# --- the callable wrapper ---------------------------------------------------------------------

#: ``(l, r, o) -> [B, T]``: a regularizer's per-token formula (policy, anchor, rollout log-probs)
Formula = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]

#: constructor arguments of the hand-derivative layer, accepted and ignored (autograd forms
#: every gradient now)
_RETIRED = ("value_and_grad", "value_and_backward", "zero_at_zero")


class Regularizer:
    """A named per-token regularizer: ``reg(logp=, old_logp=None, anchor_logp=None, mask=None)
    -> [B, T]``, the ``formula(l, r, o)`` on the compute dtype with masked inputs set to 0 and
    masked values 0; gradients come from autograd.

    ``needs_ref``: the caller must pass ``anchor_logp`` (False for ``none``); ``params``: the
    construction parameters; ``full``: its exact full-vocabulary form for ``estimator: full``
    (a :class:`~gbmpo.objectives.potentials.Potential` or a
    :class:`~gbmpo.objectives.full_vocab.RowDivergence`; ``None``: refused), described by
    ``full_description``; ``clampable``: it takes a ``clamp`` parameter. The retired keywords
    ``value_and_grad``, ``value_and_backward`` and ``zero_at_zero`` are ignored with a
    DeprecationWarning.
    """

    def __init__(
        self,
        name: str,
        formula: Formula,
        *,
        needs_ref: bool = True,
        params: Mapping[str, Any] | None = None,
        full: Any = None,
        full_description: str | None = None,
        clampable: bool = False,
        **retired: Any,
    ) -> None:
        unknown = sorted(set(retired) - set(_RETIRED))
        if unknown:
            raise TypeError(f"Regularizer() got unexpected keyword arguments: {unknown}")
        if retired:
            warnings.warn(
                f"regularizer {name!r}: {', '.join(sorted(retired))} no longer used (autograd "
                "forms every gradient); drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        self.name = name
        self._formula = formula
        self.needs_ref = needs_ref
        self.params = dict(params or {})
        self.full = full
        self.full_description = (
            full_description if full_description is not None
            else getattr(full, "description", None) if full is not None else None
        )
        self.clampable = clampable

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Regularizer({self.name!r}{', ' if args else ''}{args})"

    def __call__(
        self,
        *,
        logp: Tensor,
        old_logp: Tensor | None = None,
        anchor_logp: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        dtype = compute_dtype(logp)
        if not self.needs_ref:  # ``none``: no anchor to compare with
            return torch.zeros(logp.shape, dtype=dtype, device=logp.device)
        if anchor_logp is None:
            raise ValueError(f"regularizer {self.name!r} needs anchor_logp (got None)")
        given = {"anchor_logp": anchor_logp, "old_logp": old_logp, "mask": mask}
        for key, t in given.items():
            if t is not None and t.shape != logp.shape:
                raise ValueError(
                    f"regularizer {self.name!r}: {key} has shape {tuple(t.shape)} but logp has "
                    f"shape {tuple(logp.shape)}"
                )
        lp, an = logp.to(dtype), anchor_logp.to(dtype)
        old = None if old_logp is None else old_logp.to(dtype)
        if mask is None:
            return self._formula(lp, an, old)
        keep = mask.to(torch.bool)
        lp, an = torch.where(keep, lp, 0.0), torch.where(keep, an, 0.0)
        old = None if old is None else torch.where(keep, old, 0.0)
        return torch.where(keep, self._formula(lp, an, old), 0.0)


#: built-ins plus plugins of the ``gbmpo.regularizers`` entry-point group (factories returning a
#: :class:`Regularizer`)
REGULARIZERS: Registry[Callable[..., Regularizer]] = Registry(
    "regularizer", entry_point_group="gbmpo.regularizers"
)


def _check_clamp(name: str, clamp: float | None) -> float | None:
    if clamp is None:
        return None
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float)):
        raise TypeError(f"regularizer {name!r}: clamp must be a number or None, got {clamp!r}")
    if not (math.isfinite(clamp) and clamp > 0):
        raise ValueError(f"regularizer {name!r}: clamp must be finite and > 0, got {clamp!r}")
    return float(clamp)


@REGULARIZERS.register("none")
def _make_none() -> Regularizer:
    return Regularizer("none", lambda l, r, o: torch.zeros_like(l), needs_ref=False)


#: the exact form of the KL family (``estimator: full``)
_KL_FULL = "KL(pi_theta || pi_ref) = sum_v p_v log(p_v / q_v)"


@REGULARIZERS.register("kl_k1")
def _make_k1() -> Regularizer:
    return Regularizer("kl_k1", lambda l, r, o: kl_k1(l, r), full=NegEntropy(),
                       full_description=_KL_FULL)  # fmt: skip


@REGULARIZERS.register("kl_k2")
def _make_k2() -> Regularizer:
    return Regularizer("kl_k2", lambda l, r, o: kl_k2(l, r), full=NegEntropy(),
                       full_description=_KL_FULL)  # fmt: skip


def _clampable(name: str, fn: Callable[..., Tensor], uses_old: bool = False) -> None:
    """Register ``name``: ``fn(l, r[, o], clamp)`` with a checked ``clamp`` parameter."""

    def make(clamp: float | None = None) -> Regularizer:
        c = _check_clamp(name, clamp)
        formula: Formula = ((lambda l, r, o: fn(l, r, o, c)) if uses_old
                            else (lambda l, r, o: fn(l, r, c)))  # fmt: skip
        full = {"full": NegEntropy(), "full_description": _KL_FULL} if name.startswith("kl") \
            else {}  # fmt: skip
        return Regularizer(name, formula, params={"clamp": c}, clampable=True, **full)

    make.__doc__ = f"{name}: {fn.__doc__}"
    if name.startswith("rpg_"):
        make.__doc__ += (
            "\nThe anchor is ``anchor_logp``: the objective's ``anchor: old`` passes the rollout "
            "log-probs there (RPG's iterative reference), ``anchor: ref`` the frozen reference's."
        )
    REGULARIZERS.register(name, make)


_clampable("kl_k3", kl_k3)
_clampable("kl_k3_is", kl_k3_is, uses_old=True)


@REGULARIZERS.register("kl_k1_st")
def _make_k1_st() -> Regularizer:
    return Regularizer("kl_k1_st", lambda l, r, o: kl_k1_st(l, r), full=NegEntropy(),
                       full_description=_KL_FULL)  # fmt: skip


_clampable("kl_k3_st", kl_k3_st)


@REGULARIZERS.register("prob_l2")
def _make_prob_l2() -> Regularizer:
    return Regularizer("prob_l2", lambda l, r, o: prob_l2(l, r), full=Square(),
                       full_description="sum_v (p_v - q_v)^2")  # fmt: skip


@REGULARIZERS.register("log_l2")
def _make_log_l2() -> Regularizer:
    return Regularizer("log_l2", lambda l, r, o: log_l2(l, r))


@REGULARIZERS.register("neural_mirror")
def _make_neural_mirror(
    mirror: NeuralMirrorMap | str | os.PathLike[str] | None = None,
    evaluation: str | None = None,
) -> Regularizer:
    m = as_mirror_map(mirror)
    if evaluation is None:  # the default: the table, or the exact map where it misses its bound
        m = _default_evaluation(m)
    elif evaluation == "table":  # D_h from a float64 table, relative error <= 1e-6 (measured)
        m = m.tabulated()
    elif evaluation != "exact":
        raise ValueError(f"neural_mirror evaluation must be 'exact' or 'table', got {evaluation!r}")
    return Regularizer(
        "neural_mirror", lambda l, r, o: mirror_bregman(l, r, m), params={"mirror": m},
        full=m, full_description="sum_v D_h(p_v, q_v) with the map's h",
    )  # fmt: skip


def _default_evaluation(m: NeuralMirrorMap) -> NeuralMirrorMap:
    """The default ``evaluation``: the map's table (relative error <= 1e-6 of D_h and its
    gradient, measured at build), or the exact map with a warning for a map whose table misses
    that bound (``evaluation: table`` raises instead)."""
    try:
        return m.tabulated()
    except ValueError as e:
        warnings.warn(f"neural_mirror: {e}; evaluating the exact map", stacklevel=3)
        return m


for _name, _fn in (
    ("rpg_fkl", rpg_fkl),
    ("rpg_rkl", rpg_rkl),
    ("rpg_ufkl", rpg_ufkl),
    ("rpg_urkl", rpg_urkl),
):
    _clampable(_name, _fn)


def get_regularizer(name: str, **params: Any) -> Regularizer:
    """Build the regularizer registered as ``name`` with ``params`` (see :data:`REGULARIZERS`).

    Parameters: ``kl_k3``/``kl_k3_is``: ``clamp``; ``neural_mirror``: ``mirror`` (a
    NeuralMirrorMap, a path to a saved map, or None for ``NeuralMirrorMap.random(0.01, 42)``)
    and ``evaluation`` (``table``, the default: :meth:`NeuralMirrorMap.tabulated`, relative
    error <= 1e-6 of D_h and its gradient, the exact map with a warning for a map whose table
    misses that; ``exact``: the map's 126 units per token);
    ``rpg_*``: ``clamp`` (the anchor is the caller's ``anchor_logp``). An unknown name raises
    UnknownNameError listing the valid names; an unknown parameter raises TypeError naming it. A
    plugin factory must return a :class:`Regularizer` (TypeError otherwise, naming the plugin).
    """
    reg = REGULARIZERS.build(name, **params)
    if not isinstance(reg, Regularizer):
        origin = REGULARIZERS.origins.get(name, "built in")
        raise TypeError(
            f"regularizer {name!r} ({origin}) returned {type(reg).__name__}, expected a "
            "gbmpo.objectives.Regularizer (wrap the per-token formula in Regularizer(name, fn))"
        )
    return reg
