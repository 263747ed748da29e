"""Closed forms and curvature kernels of the neural mirror map (:mod:`gbmpo.objectives.mirror`).

Per activation (cube, square, sqrt, cbrt, log, exp): the activation sigma, its derivative, the
mean of sigma over an interval (for the potential h) and the Bregman curvature factor K with
S(up) - S(uq) - S'(uq)(up - uq) = (up - uq)^2 K (for D_h and its gradient), each written without
cancellation; the Taylor series used near p = q; and :func:`generalized_kl`, the Bregman
divergence of the negative entropy in the same factorised form. The accuracy argument is in the
module docstring of :mod:`gbmpo.objectives.mirror` (section "Numerics").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["LOG_EPS", "generalized_kl"]

LOG_EPS = 1e-3  # the log unit is log([u]_+ + LOG_EPS)

# Below this |argument| the kernels switch from the closed form to a Taylor series.
_SERIES_THRESHOLD = 0.1
_N_SERIES = 16  # 0.1^16 / 306 < 1e-18: series truncation is below float64 rounding
# kappa(delta) = ((1 + delta) log(1 + delta) - delta) / delta^2
#              = sum_n (-1)^n delta^n / ((n + 1)(n + 2))
_KAPPA_COEFFS = tuple((-1.0) ** n / ((n + 1) * (n + 2)) for n in range(_N_SERIES))
# phi(d) = (exp(d) - 1 - d) / d^2 = sum_n d^n / (n + 2)!
PROB_FLOOR = 1e-10  # probabilities are floored here (authors' torch.maximum(p, 1e-10))
#: cells of :meth:`~gbmpo.objectives.mirror.NeuralMirrorMap.tabulated`'s grid in t = log y over
#: [log 1e-10, 1]
TABLE_CELLS = 2048
_PHI_COEFFS = tuple(1.0 / math.factorial(n + 2) for n in range(_N_SERIES))


def _horner(x: Tensor, coeffs: Sequence[float]) -> Tensor:
    """sum_n coeffs[n] x^n; 16 terms in float64, 8 in float32 (0.1^8 / 90 ~ 1e-10 < eps32)."""
    n = len(coeffs) if x.dtype == torch.float64 else min(len(coeffs), 8)
    out = torch.full_like(x, coeffs[n - 1])
    for cf in reversed(coeffs[: n - 1]):
        out = out * x + cf
    return out


def _series_or_closed(
    arg: Tensor, series: Callable[[Tensor], Tensor], closed: Callable[[Tensor], Tensor]
) -> Tensor:
    """series(arg) where |arg| < 0.1, closed(arg) elsewhere. Each branch only sees safe inputs
    (0 for series, 1 for closed where unselected), so values and gradients stay finite; a
    branch that no element needs is not computed."""
    small = arg.abs() < _SERIES_THRESHOLD
    if bool(small.all()):
        return series(arg)
    if not bool(small.any()):
        return closed(arg)
    return torch.where(
        small,
        series(torch.where(small, arg, torch.zeros_like(arg))),
        closed(torch.where(small, torch.ones_like(arg), arg)),
    )


def _gkl_over_sq(x: Tensor, y: Tensor) -> Tensor:
    """K(x, y) = (x log(x/y) - x + y) / (x - y)^2 for x, y > 0 (limit 1/(2y) at x = y).

    This is the curvature factor of the generalized KL: x log(x/y) - x + y = (x - y)^2 K(x, y).
    With delta = (x - y)/y, K = kappa(delta) / y where kappa(delta) = ((1+delta) log(1+delta) -
    delta) / delta^2 is summed as a Taylor series for |delta| < 0.1 (no cancellation) and in
    closed form otherwise. Result >= 0.
    """
    delta = (x - y) / y

    def closed(dl: Tensor) -> Tensor:
        # log(1 + delta): log1p is accurate for moderate delta; near delta = -1 (x << y, where
        # delta may round to -1) the plain difference of logs has no cancellation problem.
        moderate = dl > -0.5
        log_ratio = torch.where(
            moderate, torch.log1p(torch.where(moderate, dl, 0.0)), torch.log(x) - torch.log(y)
        )
        return ((1.0 + dl) * log_ratio - dl) / (dl * dl)

    return _series_or_closed(delta, lambda dl: _horner(dl, _KAPPA_COEFFS), closed) / y


def _exp_phi(d: Tensor) -> Tensor:
    """phi(d) = (exp(d) - 1 - d) / d^2 (limit 1/2 at d = 0); series for |d| < 0.1. Result > 0."""
    return _series_or_closed(
        d, lambda x: _horner(x, _PHI_COEFFS), lambda x: (torch.expm1(x) - x) / (x * x)
    )


def generalized_kl(p: Tensor, q: Tensor) -> Tensor:
    """Elementwise generalized (unnormalised) KL  p log(p/q) - p + q  for p, q > 0.

    The Bregman divergence of the negative entropy h(y) = y log y - y (docs/methods.md, section
    "Neural mirror map", special case v=0, a=0, c=1 of the GBMPO neural mirror map). Computed as
    (p - q)^2 K(p, q) with K >= 0 (see :func:`_gkl_over_sq`), so it is >= 0 in floating point and
    exactly 0 at p = q. Inputs must be positive (callers floor probabilities at 1e-10 first).
    """
    return (p - q).square() * _gkl_over_sq(p, q)


# --- per-activation kernels -------------------------------------------------------------------
# sigma: the activation; dsigma: its derivative; mean(b, d) = (S(b + d) - S(b)) / d, the mean of
# sigma over [b, b + d] (= sigma(b) at d = 0), so that H(y) = y * mean(b, w y); curv(up, uq, d) =
# (S(up) - S(uq) - S'(uq)(up - uq)) / d^2 with d = up - uq, so that the unit's Bregman term is
# v w (p - q)^2 curv. S is the antiderivative of sigma. All inputs satisfy u >= 0.


def _cube_mean(b: Tensor, d: Tensor) -> Tensor:
    return b**3 + 1.5 * b * b * d + b * d * d + 0.25 * d**3


def _cube_curv(up: Tensor, uq: Tensor, d: Tensor) -> Tensor:
    # (S(uq+d) - S(uq) - uq^3 d)/d^2 with S = u^4/4  =  ((d + 2 uq)^2 + 2 uq^2) / 4
    return 0.25 * ((d + 2.0 * uq).square() + 2.0 * uq.square())


def _square_mean(b: Tensor, d: Tensor) -> Tensor:
    return b * b + b * d + d * d / 3.0


def _square_curv(up: Tensor, uq: Tensor, d: Tensor) -> Tensor:
    # S = u^3/3:  uq + d/3 = (2 uq + up)/3  (>= 0 because u >= 0)
    return (2.0 * uq + up) / 3.0


def _root_pair(up: Tensor, uq: Tensor, power: float) -> tuple[Tensor, Tensor, Tensor]:
    both_zero = (up <= 0) & (uq <= 0)
    one = torch.ones_like(up)
    s = torch.where(both_zero, one, up.clamp_min(0))
    t = torch.where(both_zero, one, uq.clamp_min(0))
    if power == 0.5:  # sqrt is several times faster than pow(0.5) on CPU
        return s.sqrt(), t.sqrt(), both_zero
    return s.pow(power), t.pow(power), both_zero


def _sqrt_mean(b: Tensor, d: Tensor) -> Tensor:
    # S = (2/3) u^{3/2};  (S(s^2) - S(t^2)) / (s^2 - t^2) = (2/3)(s^2 + s t + t^2) / (s + t)
    s, t, zero = _root_pair(b + d, b, 0.5)
    return torch.where(zero, torch.zeros_like(s), (2.0 / 3.0) * (s * s + s * t + t * t) / (s + t))


def _sqrt_curv(up: Tensor, uq: Tensor, d: Tensor) -> Tensor:
    # B_S = (1/3)(s - t)^2 (2 s + t) and s - t = d / (s + t)  =>  (2 s + t) / (3 (s + t)^2)
    s, t, zero = _root_pair(up, uq, 0.5)
    st = s + t  # divide twice rather than by (s + t)^2, which underflows for tiny u
    return torch.where(zero, torch.zeros_like(s), ((2.0 * s + t) / st) / (3.0 * st))


def _cbrt_mean(b: Tensor, d: Tensor) -> Tensor:
    # S = (3/4) u^{4/3};  (s^4 - t^4)/(s^3 - t^3) = (s + t)(s^2 + t^2)/(s^2 + s t + t^2)
    s, t, zero = _root_pair(b + d, b, 1.0 / 3.0)
    val = 0.75 * (s + t) * (s * s + t * t) / (s * s + s * t + t * t)
    return torch.where(zero, torch.zeros_like(s), val)


def _cbrt_curv(up: Tensor, uq: Tensor, d: Tensor) -> Tensor:
    # B_S = (1/4)(s - t)^2 (3 s^2 + 2 s t + t^2) and s - t = d / (s^2 + s t + t^2)
    s, t, zero = _root_pair(up, uq, 1.0 / 3.0)
    q2 = s * s + s * t + t * t  # divide twice rather than by q2^2, which underflows for tiny u
    val = ((3.0 * s * s + 2.0 * s * t + t * t) / q2) / (4.0 * q2)
    return torch.where(zero, torch.zeros_like(s), val)


def _log_mean(b: Tensor, d: Tensor) -> Tensor:
    # S = u_e log u_e - u_e (u_e = u + eps): mean = log(b_e) + d K(b_e + d, b_e)
    be = b.clamp_min(0) + LOG_EPS
    return torch.log(be) + d * _gkl_over_sq(be + d, be)


def _log_curv(up: Tensor, uq: Tensor, d: Tensor) -> Tensor:
    return _gkl_over_sq(up.clamp_min(0) + LOG_EPS, uq.clamp_min(0) + LOG_EPS)


def _exp_mean(b: Tensor, d: Tensor) -> Tensor:
    # (e^{b+d} - e^b)/d = e^b (1 + d phi(d))
    return torch.exp(b) * (1.0 + d * _exp_phi(d))


def _exp_curv(up: Tensor, uq: Tensor, d: Tensor) -> Tensor:
    return torch.exp(uq) * _exp_phi(d)


def _sigma(act: str, u: Tensor) -> Tensor:
    if act == "cube":
        return u**3
    if act == "square":
        return u * u
    if act == "sqrt":
        return u.clamp_min(0).sqrt()
    if act == "cbrt":
        return u.clamp_min(0).pow(1.0 / 3.0)
    if act == "log":
        return torch.log(u.clamp_min(0) + LOG_EPS)
    return torch.exp(u)


def _dsigma(act: str, u: Tensor) -> Tensor:
    if act == "cube":
        return 3.0 * u * u
    if act == "square":
        return 2.0 * u
    if act == "sqrt":
        return 0.5 * u.clamp_min(0).rsqrt()  # +inf at u = 0
    if act == "cbrt":
        return u.clamp_min(0).pow(-2.0 / 3.0) / 3.0  # +inf at u = 0
    if act == "log":
        return 1.0 / (u.clamp_min(0) + LOG_EPS)
    return torch.exp(u)


def _sqrt_curv_diff(
    up: Tensor, uq: Tensor, d: Tensor, positive: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`_sqrt_curv` and sqrt(up) - sqrt(uq) from the same roots. ``positive``: every
    b_j > 0, so u >= b_j > 0 and the u = 0 case (and its selects) cannot occur."""
    if positive:
        s, t = up.sqrt(), uq.sqrt()
        st = s + t
        return ((2.0 * s + t) / st) / (3.0 * st), s - t
    s, t, zero = _root_pair(up, uq, 0.5)
    st = s + t
    curv = torch.where(zero, torch.zeros_like(s), ((2.0 * s + t) / st) / (3.0 * st))
    return curv, torch.where(zero, torch.zeros_like(s), s - t)


def _cbrt_curv_diff(
    up: Tensor, uq: Tensor, d: Tensor, positive: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`_cbrt_curv` and cbrt(up) - cbrt(uq) from the same roots (``positive`` as in
    :func:`_sqrt_curv_diff`)."""
    if positive:
        s, t = up.pow(1.0 / 3.0), uq.pow(1.0 / 3.0)
        q2 = s * s + s * t + t * t
        return ((3.0 * s * s + 2.0 * s * t + t * t) / q2) / (4.0 * q2), s - t
    s, t, zero = _root_pair(up, uq, 1.0 / 3.0)
    q2 = s * s + s * t + t * t
    val = ((3.0 * s * s + 2.0 * s * t + t * t) / q2) / (4.0 * q2)
    zeros = torch.zeros_like(s)
    return torch.where(zero, zeros, val), torch.where(zero, zeros, s - t)


def _log_curv_diff(
    up: Tensor, uq: Tensor, d: Tensor, positive: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`_log_curv` and log(up + eps) - log(uq + eps) = log1p(d_e / uq_e)."""
    pe, qe = up.clamp_min(0) + LOG_EPS, uq.clamp_min(0) + LOG_EPS
    return _gkl_over_sq(pe, qe), torch.log1p((pe - qe) / qe)


def _exp_curv_diff(
    up: Tensor, uq: Tensor, d: Tensor, positive: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`_exp_curv` and exp(up) - exp(uq) = exp(uq) (d + d^2 phi(d)), from the same phi."""
    eq, phi = torch.exp(uq), _exp_phi(d)
    return eq * phi, eq * (d + d * d * phi)


#: activations folded into polynomial coefficients (:meth:`NeuralMirrorMap._poly`): the sums
#: over their units of v (w y + b)^3 and v (w y + b)^2 are one cubic in y
_POLY = ("cube", "square")
_CURV_DIFF: dict[str, Callable[[Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor]]] = {
    "sqrt": _sqrt_curv_diff,
    "cbrt": _cbrt_curv_diff,
    "log": _log_curv_diff,
    "exp": _exp_curv_diff,
}


_MEAN: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "cube": _cube_mean,
    "square": _square_mean,
    "sqrt": _sqrt_mean,
    "cbrt": _cbrt_mean,
    "log": _log_mean,
    "exp": _exp_mean,
}
_CURV: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "cube": _cube_curv,
    "square": _square_curv,
    "sqrt": _sqrt_curv,
    "cbrt": _cbrt_curv,
    "log": _log_curv,
    "exp": _exp_curv,
}
