r"""Clip intervals without a closed form, found by bisection, with the measures they invert.

The root finder :func:`bisect_interval`, the ``neural_mirror`` measure and interval
:func:`mirror_interval` (bisection tabulated in :math:`p` per map and radius, with its table
machinery) and the ``dppo_kl`` measure and interval :func:`dppo_kl_interval`. The other
measures, the closed-form intervals and the registry are in
:mod:`gbmpo.objectives.clip_measures`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.mirror import PROB_FLOOR, NeuralMirrorMap

__all__ = [
    "BINARY_KL_EPS",
    "BISECT_ITERS",
    "MIRROR_TABLE_TOL",
    "binary_kl",
    "bisect_interval",
    "check_radius",
    "dppo_kl_interval",
    "measure_dppo_kl",
    "measure_mirror",
    "mirror_interval",
]

#: DPPO's code adds this to both 1 - p terms of the binary KL (kept for parity)
BINARY_KL_EPS = 1e-8


def check_radius(name: str, value: float) -> float:
    """``value`` as a float: a finite radius > 0 (TypeError / ValueError naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def measure_mirror(w: Tensor, p_old: Tensor, mirror: NeuralMirrorMap) -> Tensor:
    r""":math:`f(w) = D_h(w p, p)` for a neural mirror map :math:`h` (GBMPO NM-GRPO,
    arXiv 2602.04380; :meth:`NeuralMirrorMap.bregman`, probabilities floored at 1e-10)."""
    return mirror.bregman(w * p_old, p_old)


def binary_kl(p_old: Tensor, logp_old: Tensor, p_new: Tensor, logp_new: Tensor) -> Tensor:
    r"""Binary KL :math:`\mathrm{KL}(\mathrm{Bern}(p)\,\|\,\mathrm{Bern}(p'))
    = p(\log p - \log p') + (1-p)\log\frac{1-p+\epsilon}{1-p'+\epsilon}`,
    :math:`\epsilon = 10^{-8}` as in DPPO's code (DPPO-Binary-KL, arXiv 2602.04879); the log-probs
    are passed so that the first term needs no log of a rounded probability."""
    one = 1.0 + BINARY_KL_EPS
    return p_old * (logp_old - logp_new) + (1.0 - p_old) * torch.log((one - p_old) / (one - p_new))


def measure_dppo_kl(w: Tensor, p_old: Tensor) -> Tensor:
    r""":math:`f(w) = \mathrm{KL}(\mathrm{Bern}(p)\,\|\,\mathrm{Bern}(wp))` (:func:`binary_kl`;
    DPPO-Binary-KL, arXiv 2602.04879)."""
    return binary_kl(p_old, torch.log(p_old), w * p_old, torch.log(w) + torch.log(p_old))


#: bisection steps of :func:`bisect_interval`: each halves a log-ratio bracket of width at most
#: log(1 / 1e-10) = 23.03, so the error in log w is at most 23.03 / 2^60 = 2.0e-17, below the
#: float64 spacing near the roots: the ends are exact up to float64 rounding of f.
BISECT_ITERS = 60


# ---------------------------------------------------------------------------- root finder


def bisect_interval(
    f: Callable[[Tensor], Tensor],
    delta_low: float,
    delta_high: float,
    w_min: Tensor,
    w_max: Tensor,
    iters: int = BISECT_ITERS,
) -> tuple[Tensor, Tensor]:
    r"""The ends of :math:`\{w \in [w_{\min}, w_{\max}] : f(w) \le \delta\}` by vectorised
    bisection in :math:`\log w`, float64, elementwise over the shape of ``w_min`` / ``w_max``.

    Needs :math:`w_{\min} \le 1 \le w_{\max}`, :math:`f(1) = 0`, :math:`f` non-increasing below
    1 and non-decreasing above (any Bregman :math:`D_h(wp, p)`). Each end keeps the inside side
    of its bracket, so :math:`f(l), f(u) \le \delta` up to rounding; error
    :math:`2^{-\text{iters}}\log(w_{\max} / w_{\min})` in :math:`\log w` (below 2e-17 for
    probabilities down to 1e-10 with 60 steps). Lower end 0 where :math:`f(w_{\min}) \le
    \delta_{\text{low}}`, upper end :math:`+\infty` where :math:`f(w_{\max}) \le
    \delta_{\text{high}}`.
    """
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    lo_w = w_min.to(torch.float64)
    hi_w = w_max.to(torch.float64)
    lo_w, hi_w = torch.broadcast_tensors(lo_w, hi_w)
    if bool((lo_w > 1.0).any()) or bool((hi_w < 1.0).any()) or bool((lo_w <= 0).any()):
        raise ValueError("bisect_interval needs 0 < w_min <= 1 <= w_max")

    def g(t: Tensor) -> Tensor:
        return f(torch.exp(t))

    zero = torch.zeros_like(lo_w)
    # lower end: inside at t = 0, outside at t = log w_min (unless the whole side is inside)
    a, b = torch.log(lo_w), zero.clone()
    for _ in range(iters):
        mid = 0.5 * (a + b)
        inside = g(mid) <= dl
        b = torch.where(inside, mid, b)
        a = torch.where(inside, a, mid)
    low = torch.where(g(torch.log(lo_w)) <= dl, zero, torch.exp(b))
    # upper end: inside at t = 0, outside at t = log w_max
    a, b = zero.clone(), torch.log(hi_w)
    for _ in range(iters):
        mid = 0.5 * (a + b)
        inside = g(mid) <= dh
        a = torch.where(inside, mid, a)
        b = torch.where(inside, b, mid)
    high = torch.where(g(torch.log(hi_w)) <= dh, torch.full_like(zero, math.inf), torch.exp(a))
    return low, high


def mirror_interval(
    p_old: Tensor,
    mirror: NeuralMirrorMap,
    delta_low: float,
    delta_high: float,
    *,
    method: str = "table",
    tol: float | None = None,
) -> tuple[Tensor, Tensor]:
    r"""``neural_mirror``, per token: the ends of :math:`\{w : D_h(wp, p) \le \delta\}` over
    :math:`w \in [10^{-10}/p, 1/p]` (GBMPO NM-GRPO, arXiv 2602.04380): 0 / :math:`+\infty`
    where the range's end stays inside. float64.

    ``method="bisect"``: :func:`bisect_interval` per token (2 x 60 map evaluations).
    ``"table"`` (default): each end is a function of :math:`p` for a fixed map and radius, so it
    is bisected once at the knots of a grid in :math:`\log p` (cached per map, side and radius)
    and read from a cubic Hermite interpolant (:class:`_MirrorEndTable`), the grid refined until
    it matches fresh bisections at every cell midpoint to ``tol`` (default
    :data:`MIRROR_TABLE_TOL` = 1e-8; absolute in :math:`w` below, in :math:`\log w` above);
    tokens in cells that miss it are bisected."""
    if method == "bisect":
        p = p_old.to(torch.float64).clamp(PROB_FLOOR, 1.0)
        w_min = (PROB_FLOOR / p).clamp_max(1.0)
        w_max = 1.0 / p
        return bisect_interval(
            lambda w: measure_mirror(w, p, mirror), delta_low, delta_high, w_min, w_max
        )
    if method != "table":
        raise ValueError(f"unknown mirror_interval method {method!r}; valid: table, bisect")
    dl = check_radius("delta_low", delta_low)
    dh = check_radius("delta_high", delta_high)
    tol = MIRROR_TABLE_TOL if tol is None else check_radius("tol", tol)
    p = p_old.to(torch.float64).clamp(PROB_FLOOR, 1.0)
    t = torch.log(p)  # read by both ends
    low = _mirror_end_table(mirror, "low", dl, tol).evaluate(p, t)
    high = _mirror_end_table(mirror, "high", dh, tol).evaluate(p, t)
    return low, high


#: default tolerance (in log w) of :func:`mirror_interval`'s tables
MIRROR_TABLE_TOL = 1e-8
_TABLE_START_CELLS = 128
_TABLE_MAX_CELLS = 4096
_GRADED_R0 = -40.0  # the graded table's grid starts at t* + length e^-40
_TABLE_BAD_CELLS = 4  # refinement stops when at most this many cells miss tol
_LOG_FLOOR = math.log(PROB_FLOOR)
_TABLES: weakref.WeakKeyDictionary[NeuralMirrorMap, dict[tuple[str, float, float], Any]] = (
    weakref.WeakKeyDictionary()
)


def _mirror_end_table(
    mirror: NeuralMirrorMap, side: str, delta: float, tol: float
) -> _MirrorEndTable:
    per_map = _TABLES.setdefault(mirror, {})
    key = (side, delta, tol)
    if key not in per_map:
        per_map[key] = _MirrorEndTable(mirror, side, delta, tol)
    table: _MirrorEndTable = per_map[key]
    return table


def _cubic_hermite_coeffs(x0: Tensor, x1: Tensor, d0: Tensor, d1: Tensor) -> Tensor:
    """[a0..a3] (rows) of the cubic P(s) = sum_k a_k s^k on [0, 1] with P(0) = x0, P(1) = x1,
    P'(0) = d0, P'(1) = d1 (cubic Hermite interpolation)."""
    return torch.stack([x0, d0, 3.0 * (x1 - x0) - 2.0 * d0 - d1, 2.0 * (x0 - x1) + d0 + d1])


class _MirrorEndTable:
    r"""One end of the ``neural_mirror`` interval as a function of :math:`t = \log p`, for a
    fixed map, side and radius (see :func:`mirror_interval`).

    ``low``: :math:`\phi(p) = D_h(10^{-10}, p)` grows with :math:`p` (its derivative is
    :math:`h''(p)(p - 10^{-10}) \ge 0`), so the end is 0 exactly for :math:`p \le p^*`;
    ``high``: :math:`\phi(p) = D_h(1, p)` falls with :math:`p`, so the end is :math:`\infty`
    exactly for :math:`p \ge p^*`. :math:`p^*` is bisected in :math:`\log p` (100 steps).
    Between, :math:`x(t) = \log w` of the end is smooth (implicit function theorem:
    :math:`dy/dp = h''(p)(y - p)/(h'(y) - h'(p))` for the root :math:`y = wp`, and
    :math:`dx/dt = (p/y)\,dy/dp - 1`); at the threshold the root is the floor (``low``) or 1
    (``high``) exactly. Knots: roots by :func:`bisect_interval`'s bisection, derivatives by
    that formula, interpolation cubic Hermite in :math:`t` of :math:`w` (``low``, so ``tol``
    is absolute there: the lower end lies in [0, 1]) or of :math:`\log w` (``high``, relative).
    The cell count doubles (up to 4,096) until at most 4 cell midpoints miss a fresh bisection
    by more than ``tol``; those cells (``bad_cells``: the first few above the lower end's
    threshold, where the root leaves the floor like the inverse of :math:`y \log y` and no
    polynomial fits) get a second, log-graded table (:meth:`_graded`), and any cell that
    still misses ``tol`` is solved per token by that bisection. ``error``:
    the largest midpoint error of the other cells."""

    def __init__(self, mirror: NeuralMirrorMap, side: str, delta: float, tol: float) -> None:
        self.side, self.delta = side, delta
        self._mirror = mirror
        self._tables: dict[torch.device, Tensor] = {}
        self._tables_bad: dict[torch.device, Tensor] = {}
        self._graded_tables: dict[torch.device, Tensor] = {}
        edge = PROB_FLOOR if side == "low" else 1.0
        t_star = self._threshold(edge)
        self.p_star = math.exp(t_star)
        # the range with a finite, non-zero end: [t*, 0] (low) or [log 1e-10, t*] (high)
        a, b = (t_star, 0.0) if side == "low" else (_LOG_FLOOR, t_star)
        self.t0, self.cells, self.bad_cells = a, 0, 0
        self.error = 0.0
        if not b > a:  # the end is 0 / inf for every p
            return
        cells = _TABLE_START_CELLS
        t = torch.linspace(a, b, cells + 1, dtype=torch.float64)
        x = self._roots(t)
        if side == "low":  # the root is the floor at t*
            x[0] = PROB_FLOOR / math.exp(a)
        else:  # the root is 1 at t*
            x[-1] = -b
        while True:
            dxdt = self._slope(t, x)
            width = (b - a) / cells
            coef = _cubic_hermite_coeffs(x[:-1], x[1:], width * dxdt[:-1], width * dxdt[1:])
            mid_t = 0.5 * (t[:-1] + t[1:])
            mid_x = self._roots(mid_t)
            approx = ((coef[3] * 0.5 + coef[2]) * 0.5 + coef[1]) * 0.5 + coef[0]
            cell_error = (approx - mid_x).abs()
            if int((cell_error > tol).sum()) <= _TABLE_BAD_CELLS or cells >= _TABLE_MAX_CELLS:
                break
            # refine: the midpoints (already solved) become knots
            t = torch.stack([t[:-1], mid_t], dim=1).reshape(-1)
            t = torch.cat([t, torch.tensor([b], dtype=torch.float64)])
            x = torch.cat([torch.stack([x[:-1], mid_x], dim=1).reshape(-1), x[-1:]])
            cells *= 2
        # cells that still miss tol (next to the lower end's threshold, where the root leaves
        # the floor like the inverse of y log y) are solved per token by bisection instead
        bad = cell_error > tol
        self.cells, self.width = cells, (b - a) / cells
        self._coef_cpu = coef.contiguous()
        self.graded_length = 0.0
        n_first = int(bad.long().cumprod(0).sum()) if side == "low" else 0
        if n_first:  # the first cells above the threshold: a graded table (see _graded)
            err_g = self._graded(a, n_first * self.width, tol)
            if err_g <= tol:
                bad[:n_first] = False
                cell_error[:n_first] = err_g
        self.bad_cells = int(bad.sum())
        self.error = float(cell_error[~bad].max()) if self.bad_cells < cells else 0.0
        self._bad_cpu = bad
        # one constant cell on each side of the grid, so that the 0 / inf ends need no mask:
        # low: 0 below t* (and the value at log p = 0 above it, unreachable); high: the
        # value at the floor below (unreachable) and inf above t* (exp(inf) = inf)
        first, last = coef[0, 0], coef[:, -1].sum()  # the end at t0 and at the grid's top
        below = torch.zeros(4, 1, dtype=torch.float64)
        above = torch.zeros(4, 1, dtype=torch.float64)
        if side == "low":
            above[0] = last
        else:
            below[0] = first
            above[0] = math.inf
        self._padded_cpu = torch.cat([below, coef, above], dim=1).contiguous()
        self._t_star = float(torch.log(torch.tensor(self.p_star, dtype=torch.float64)))

    def _graded(self, t_star: float, length: float, tol: float) -> float:
        """A table of the lower end over (t*, t* + length] in r = log((t - t*) / length), r in
        [-40, 0]: the root leaves the floor like the inverse of y log y, whose non-polynomial
        part is smooth in r (log-graded cells towards t*). Cubic Hermite of w in r
        (dw/dr = (t - t*) dw/dt), cells doubled up to 4,096 until every midpoint is within tol;
        below r = -40 the end is its value at t* + length e^-40 (it moves by less than dw/dt
        times 4e-18 length there). Returns the largest midpoint error (> tol: not used)."""
        cells = 64
        while True:
            r = torch.linspace(_GRADED_R0, 0.0, cells + 1, dtype=torch.float64)
            gap = length * torch.exp(r)
            t = t_star + gap
            x = self._roots(t)
            dxdr = self._slope(t, x) * gap
            width = -_GRADED_R0 / cells
            coef = _cubic_hermite_coeffs(x[:-1], x[1:], width * dxdr[:-1], width * dxdr[1:])
            mid = t_star + length * torch.exp(0.5 * (r[:-1] + r[1:]))
            approx = ((coef[3] * 0.5 + coef[2]) * 0.5 + coef[1]) * 0.5 + coef[0]
            err = float((approx - self._roots(mid)).abs().max())
            if err <= tol or cells >= _TABLE_MAX_CELLS:
                break
            cells *= 2
        if err <= tol:
            self.graded_length, self.graded_cells = length, cells
            self._graded_cpu = coef.contiguous()
        return err

    def _phi(self, t: Tensor, edge: float) -> Tensor:
        p = torch.exp(t)
        return self._mirror.bregman(torch.full_like(p, edge), p)

    def _threshold(self, edge: float) -> float:
        """t* = log p* (module docstring of the class): the boundary between p whose end is 0
        (``low``) / inf (``high``) and p whose end is finite, by 100 bisection steps."""
        lo = torch.tensor([_LOG_FLOOR], dtype=torch.float64)
        hi = torch.tensor([0.0], dtype=torch.float64)
        inside_lo = bool(self._phi(lo, edge) <= self.delta)
        inside_hi = bool(self._phi(hi, edge) <= self.delta)
        if self.side == "low":  # phi grows: inside at small p
            if inside_hi:
                return 0.0
            if not inside_lo:
                return _LOG_FLOOR
        else:  # phi falls: inside at large p
            if inside_lo:
                return _LOG_FLOOR
            if not inside_hi:
                return 0.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            inside = bool(self._phi(mid, edge) <= self.delta)
            if inside == (self.side == "low"):
                lo = mid
            else:
                hi = mid
        return float(lo if self.side == "low" else hi)

    def _roots(self, t: Tensor) -> Tensor:
        """The interpolated value (``low``: w, ``high``: log w) of the end at log p = t, by
        :func:`bisect_interval`'s bisection (one side)."""
        p = torch.exp(t)
        lo_w = (PROB_FLOOR / p).clamp_max(1.0)
        hi_w = 1.0 / p
        f = lambda w: measure_mirror(w, p, self._mirror)  # noqa: E731
        if self.side == "low":
            a, b = torch.log(lo_w), torch.zeros_like(p)
            for _ in range(BISECT_ITERS):
                mid = 0.5 * (a + b)
                inside = f(torch.exp(mid)) <= self.delta
                b = torch.where(inside, mid, b)
                a = torch.where(inside, a, mid)
            return torch.exp(b)
        a, b = torch.zeros_like(p), torch.log(hi_w)
        for _ in range(BISECT_ITERS):
            mid = 0.5 * (a + b)
            inside = f(torch.exp(mid)) <= self.delta
            a = torch.where(inside, mid, a)
            b = torch.where(inside, b, mid)
        return a

    def _slope(self, t: Tensor, x: Tensor) -> Tensor:
        """dx/dt at the knots (class docstring): ``low`` dw/dt = dy/dp - w, ``high``
        d log w/dt = (p / y) dy/dp - 1."""
        p = torch.exp(t)
        y = x * p if self.side == "low" else torch.exp(x + t)
        m = self._mirror
        dydp = m.second_derivative(p) * (y - p) / (m.derivative(y) - m.derivative(p))
        return dydp - x if self.side == "low" else p / y * dydp - 1.0

    def evaluate(self, p: Tensor, t: Tensor | None = None) -> Tensor:
        """The end for float64 ``p`` in [1e-10, 1] (any shape); ``t``: log p when the caller
        has it. The constant cells on both sides of the grid give the 0 / inf ends: cell
        j = floor(u) + 1 of u = (log p - t0) / width (``low``: j = ceil(u), u from log p*),
        clamped to [0, cells + 1], so the tokens past the threshold read 0 (``low``,
        p <= p*) or inf (``high``, u >= cells) without a mask."""
        if t is None:
            t = torch.log(p)
        if self.cells == 0:
            return torch.full_like(p, 0.0 if self.side == "low" else math.inf)
        dev = p.device
        if dev not in self._tables:
            self._tables[dev] = self._padded_cpu.to(dev)
            self._tables_bad[dev] = self._bad_cpu.to(dev)
            if self.graded_length:
                self._graded_tables[dev] = self._graded_cpu.to(dev)
        rows = self._tables[dev]
        # in-place arithmetic on few buffers (fresh [64 x 1024] float64 temporaries cost more
        # in allocation than in arithmetic)
        if self.side == "low":
            # measured from log p* as torch rounds it, and cell j = ceil(u): p <= p* (u <= 0)
            # reads the constant cell 0 exactly as the threshold test p <= p* decides
            u = torch.sub(t, self._t_star).mul_(1.0 / self.width)
            cj = u.ceil()
            s = u.sub_(cj).add_(1.0)
        else:
            u = torch.sub(t, self.t0).mul_(1.0 / self.width)
            cj = u.floor()
            s = u.sub_(cj)
            cj.add_(1.0)
        ix = cj.clamp_(0.0, self.cells + 1).to(torch.int32).view(-1)
        a0, a1, a2, a3 = (rows[k].index_select(0, ix).view(p.shape) for k in range(4))
        w = a0.addcmul_(s, a1.addcmul_(s, a2.addcmul_(s, a3)))
        if self.graded_length:  # the first cells above the lower end's threshold
            half = 0.5 * self.graded_length
            # 0 < log p - log p* < length (the difference first: its sign is exact)
            near = torch.sub(t, self._t_star).sub_(half).abs_().lt_(half).view(-1)
            near = near.nonzero().view(-1)
            if near.numel():
                gap = t.reshape(-1).index_select(0, near) - self._t_star
                r = torch.log(gap / self.graded_length).clamp(_GRADED_R0, 0.0)
                ug = (r - _GRADED_R0) * (self.graded_cells / -_GRADED_R0)
                ig = ug.floor().clamp_(0, self.graded_cells - 1)
                sg = ug - ig
                g0, g1, g2, g3 = self._graded_tables[dev][:, ig.long()].unbind(0)
                w.view(-1).index_copy_(0, near, g0 + sg * (g1 + sg * (g2 + sg * g3)))
        if self.bad_cells:
            cell = (ix.long() - 1).clamp_(0, self.cells - 1)
            inside = (ix > 0) & (ix <= self.cells)
            solve = (self._tables_bad[dev][cell] & inside).nonzero().view(-1)
            if solve.numel():
                roots = self._roots(t.reshape(-1).index_select(0, solve))
                w.view(-1).index_copy_(0, solve, roots)
        if self.side == "high":
            w = w.exp_()
        return w


#: the smallest ratio the ``dppo_kl`` interval's bisection looks at (:func:`dppo_kl_interval`)
DPPO_KL_W_MIN = 1e-300


def dppo_kl_interval(p_old: Tensor, delta_low: float, delta_high: float) -> tuple[Tensor, Tensor]:
    r"""``dppo_kl``, per token: the ends of :math:`\{w : \mathrm{KL}(\mathrm{Bern}(p)\,\|\,
    \mathrm{Bern}(wp)) \le \delta\}` by :func:`bisect_interval` over
    :math:`w \in [10^{-300}, 1/p]` (DPPO-Binary-KL, arXiv 2602.04879). The binary KL is convex in
    :math:`w` with minimum 0 at :math:`w = 1`; it grows without bound as :math:`wp \to 1` only
    through DPPO's :math:`\epsilon = 10^{-8}`, so the upper end is finite for small radii. As
    :math:`w \to 0` it grows like :math:`p \log(1/w)`, slowly for a small :math:`p`: the lower
    end can lie far below :math:`10^{-10}/p` (:math:`p = 0.011`, :math:`\delta = 0.2`:
    :math:`w \approx 3 \cdot 10^{-9}`), so the bracket reaches down to :math:`10^{-300}` (the
    measure is evaluated from :math:`\log w`); a radius not reached there has no lower end."""
    p = p_old.to(torch.float64).clamp(PROB_FLOOR, 1.0)
    w_min = torch.full_like(p, DPPO_KL_W_MIN)
    w_max = 1.0 / p
    return bisect_interval(lambda w: measure_dppo_kl(w, p), delta_low, delta_high, w_min, w_max)
