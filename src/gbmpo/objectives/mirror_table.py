"""Tabulated evaluation of a neural mirror map (GBMPO NM-GRPO, arXiv 2602.04380), selected by
the ``neural_mirror`` regularizer's ``evaluation: table`` (the exact map is the default).

:class:`TabulatedMirrorMap` (built by :meth:`gbmpo.objectives.mirror.NeuralMirrorMap.tabulated`)
reads the map's Bregman divergence from its potential's float64 quintic Hermite table in log y
(:func:`quintic_hermite_coeffs`) in a form that keeps the divergence's relative precision next
to p = q; its relative error against the exact map (at most :data:`TABLE_RTOL` = 1e-6 of D_h and
of its gradient) is measured at build, and a table that misses it is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.mirror import (
    N_UNITS,
    PROB_FLOOR,
    TABLE_CELLS,
    NeuralMirrorMap,
)
from gbmpo.objectives.mirror_kernels import _PHI_COEFFS, _horner
from gbmpo.objectives.tensors import compute_dtype

__all__ = ["TABLE_RTOL", "TabulatedMirrorMap", "quintic_hermite_coeffs"]

#: the table's guarantee: relative error of D_h and of d D_h / d log p against the exact
#: float64 map, measured at build (``table_error``); a table that misses it is refused
TABLE_RTOL = 1e-6

_TABLE_T0 = math.log(PROB_FLOOR)
_TABLE_T1 = 1.0  # the grid ends at y = e: probabilities and some margin above 1
_TABLE_CHECKS = 7  # interior check points per cell for the measured error
#: |log p - log q| <= _NEAR * Delta uses the factorised near-p = q form (q's cell polynomial)
_NEAR = 0.5
#: terms of the series of phi(d) = (e^d - 1 - d) / d^2 in the near form: |d| <= Delta / 2 < 0.006
#: and 0.006^7 / 9! < 1e-21
_N_PHI = 8


def quintic_hermite_coeffs(
    f0: Tensor, f1: Tensor, d0: Tensor, d1: Tensor, e0: Tensor, e1: Tensor
) -> Tensor:
    """Coefficients [c0..c5] (last dim) of the quintic P(s) = sum_k c_k s^k on [0, 1] with
    P(0) = f0, P(1) = f1, P'(0) = d0, P'(1) = d1, P''(0) = e0, P''(1) = e1 (quintic Hermite
    interpolation; e.g. Burden & Faires, "Numerical Analysis", Hermite interpolation). Its
    error on a cell of width Delta is at most Delta^6 max|f^(6)| / 46080 (the Hermite remainder
    f^(6)(xi) s^3 (1 - s)^3 Delta^6 / 6!, with max s^3 (1 - s)^3 = 1/64)."""
    df = f1 - f0
    return torch.stack(
        [
            f0,
            d0,
            0.5 * e0,
            10.0 * df - 6.0 * d0 - 4.0 * d1 - 1.5 * e0 + 0.5 * e1,
            -15.0 * df + 8.0 * d0 + 7.0 * d1 + 1.5 * e0 - e1,
            6.0 * df - 3.0 * (d0 + d1) - 0.5 * (e0 - e1),
        ],
        dim=-1,
    )


class TabulatedMirrorMap(NeuralMirrorMap):
    """A :class:`NeuralMirrorMap` whose D_h is read from a float64 table in t = log y, to a
    relative error of at most 1e-6 of D_h (measured at build, :attr:`table_error`), p = q
    included: ``objective.regularizer.params.evaluation: table`` selects it.

    What is tabulated. G(t) = D_h(e^t, y0), the map's own Bregman divergence from the floor
    y0 = 1e-10, evaluated exactly (factorised form, :meth:`NeuralMirrorMap.bregman`) with
    G'(t) = y (h'(y) - h'(y0)) and G''(t) = G'(t) + y^2 h''(y), y = e^t, on a uniform grid of
    ``cells`` cells over [log 1e-10, 1]; on each cell G is the quintic Hermite interpolant
    P(s), s = (t - t_k) / Delta, of G, Delta G', Delta^2 G'' at the two knots
    (:func:`quintic_hermite_coeffs`). G differs from h by an affine function of y, which no
    Bregman divergence sees, and it is small where y is small (G ~ y^2 h''), so the table's
    *relative* accuracy carries over to small probabilities.

    The divergence, with delta = log p - log q, x and s_q the cell coordinates of log p and
    log q in q's cell (x = s_q + delta / Delta), phi(delta) = (e^delta - 1 - delta) / delta^2:

    Since h'(q)(p - q) = G'(t_q)(e^delta - 1) (the affine part cancels),
    D_h(p, q) = G(t_p) - G(t_q) - G'(t_q)(e^delta - 1)
              = [G(t_p) - G(t_q) - G'(t_q) delta] - G'(t_q)(e^delta - 1 - delta), evaluated as

    * near p = q (|delta| <= Delta / 2; q's cell polynomial, extrapolated by at most half a
      cell): D = delta^2 [R(x, s_q) / Delta^2 - P'(s_q) phi(delta) / Delta], with
      R(x, y) = (P(x) - P(y) - P'(y)(x - y)) / (x - y)^2
             = c2 + c3 (x + 2y) + c4 (x^2 + 2xy + 3y^2) + c5 (x^3 + 2x^2 y + 3x y^2 + 4y^3)
      and phi by its Taylor series: the factorised form, with no cancellation of the
      O(delta^2) divergence against O(1) table values (the two terms in the bracket are of the
      sizes G''/2 and G'/2, whose difference y^2 h''(y) / 2 is a fixed fraction of them);
    * elsewhere: D = P_p(s_p) - P_q(s_q) - P'_q(s_q)(e^delta - 1) / Delta (relative rounding
      ~1e-16 G / D, below 1e-9 for |delta| >= Delta / 2 on the maps tested);

    clamped at 0. Gradients are analytic (custom autograd function): in log p,
    p (h'(p) - h'(q)) = G'(t_p) - e^delta G'(t_q) (near p = q: delta [Q(x, s_q) / Delta^2 -
    (1 + delta phi) P'(s_q) / Delta] with Q the divided difference of P'), and in log q,
    -q h''(q)(p - q) = -(G''(t_q) - G'(t_q)) expm1(delta). Arguments beyond y = e (no
    probabilities) use the exact map. Math is float64; the result has the exact map's dtype.
    """

    def __init__(self, mirror: NeuralMirrorMap, cells: int = TABLE_CELLS) -> None:
        if not isinstance(mirror, NeuralMirrorMap):
            raise TypeError(
                "TabulatedMirrorMap is built from a map: use NeuralMirrorMap.<constructor>(...)"
                f".tabulated(), not TabulatedMirrorMap constructors (got {type(mirror).__name__})"
            )
        if isinstance(cells, bool) or not isinstance(cells, int) or cells < 16:
            raise ValueError(f"cells must be an integer >= 16, got {cells!r}")
        n = N_UNITS
        vec = mirror.to_vector()
        super().__init__(vec[:n], vec[n : 2 * n], vec[2 * n : 3 * n], float(vec[-2]),
                         float(vec[-1]))  # fmt: skip
        self._exact = NeuralMirrorMap.from_vector(vec)
        self.cells = cells
        self._dt = (_TABLE_T1 - _TABLE_T0) / cells
        t = torch.linspace(_TABLE_T0, _TABLE_T1, cells + 1, dtype=torch.float64)
        g, gt, gtt = self._exact_g(t)
        dt = self._dt
        coef = quintic_hermite_coeffs(
            g[:-1], g[1:], dt * gt[:-1], dt * gt[1:], dt * dt * gtt[:-1], dt * dt * gtt[1:]
        )
        self._table_cpu = coef.t().contiguous()  # [6, cells]: c_k of every cell in row k
        self._tables: dict[torch.device, Tensor] = {}
        y0 = torch.tensor([PROB_FLOOR], dtype=torch.float64)
        self._h0 = float(self._exact.potential(y0)[0])
        self._g0 = float(self._exact.derivative(y0)[0])
        self.table_error = self._measure_error()
        worst = max(self.table_error["bregman_rel"], self.table_error["grad_rel"])
        if not worst <= TABLE_RTOL:  # also catches NaN
            raise ValueError(
                f"the tabulated neural mirror map misses its error bound: measured relative "
                f"error {worst:.3g} of D_h or its gradient > {TABLE_RTOL:g} with {cells} cells; "
                "use more cells or evaluation 'exact'"
            )

    def _exact_g(self, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """G(t) = D_h(e^t, y0), G'(t) = y (h'(y) - h'(y0)), G''(t) = G' + y^2 h''(y), exactly
        (the factorised D_h and its cancellation-free h'(y) - h'(y0))."""
        y = torch.exp(t).clamp_min(PROB_FLOOR)
        y0 = torch.full_like(y, PROB_FLOOR)
        g, dh = self._exact._bregman_and_grad(y, y0, want_grad=True)
        assert dh is not None
        gt = y * dh
        return g, gt, gt + y * y * self._exact.second_derivative(y)

    def _measure_error(self) -> dict[str, float]:
        """Errors against the exact float64 map, measured at build. ``h``, ``dh``: max |H - h|,
        |H' - h'| (absolute) at 7 interior points of every cell; ``d2h``: max |H'' - h''| / h''
        there. ``bregman_rel``: max |D - D_h| / D_h over pairs (p, q) with q at 2 interior
        points of every cell below y = 1 and p = q e^{+-o} (rounded to float64, inside
        [1e-10, 1]) for o in {1e-12, 1e-9, 1e-6, 1e-3, Delta / 2, Delta, 1.5 Delta, 0.05,
        0.5, 3, 25}, log p - log q taken as log1p((p - q) / q) so that both sides see the same
        float64 pair; ``grad_rel``: the same for d D / d log p = p (h'(p) - h'(q)) where
        |log p - log q| >= 1e-6."""
        frac = torch.arange(1, _TABLE_CHECKS + 1, dtype=torch.float64) / (_TABLE_CHECKS + 1)
        t = torch.linspace(_TABLE_T0, _TABLE_T1, self.cells + 1, dtype=torch.float64)
        tc = (t[:-1, None] + self._dt * frac[None, :]).reshape(-1)
        yc = torch.exp(tc)
        h2 = self._exact.second_derivative(yc)
        err = {
            "h": float((self.potential(yc) - self._exact.potential(yc)).abs().max()),
            "dh": float((self.derivative(yc) - self._exact.derivative(yc)).abs().max()),
            "d2h": float(((self.second_derivative(yc) - h2).abs() / h2).max()),
        }
        offs = torch.tensor([1e-12, 1e-9, 1e-6, 1e-3, 0.5 * self._dt, self._dt, 1.5 * self._dt,
                             0.05, 0.5, 3.0, 25.0], dtype=torch.float64)  # fmt: skip
        offs = torch.cat([offs, -offs])
        tq = t[:-1, None] + self._dt * torch.tensor([[0.3, 0.8]], dtype=torch.float64)
        tq = tq.reshape(-1)
        tq = tq[tq <= 0.0]
        q = tq.exp()[:, None].expand(-1, offs.numel()).reshape(-1)
        p = (tq[:, None] + offs[None, :]).exp().reshape(-1)
        keep = (p >= PROB_FLOOR) & (p <= 1.0) & (p != q)
        p, q = p[keep], q[keep]
        d_exact, gp_exact = self._exact._bregman_and_grad(p, q, want_grad=True)
        assert gp_exact is not None
        tq, delta = _log_pair(p, q)
        d_tab, g_tab, _ = self._bregman_t(tq, delta, want_grad=True)
        assert g_tab is not None
        pos = d_exact > 0
        err["bregman_rel"] = float(((d_tab - d_exact).abs()[pos] / d_exact[pos]).max())
        g_exact = p * gp_exact
        # below |delta| ~ 1e-6 the exact map's own float64 gradient loses digits (its unit
        # differences see p and q rounded), so it is no reference there
        nz = (g_exact != 0) & (delta.abs() >= 1e-6)
        err["grad_rel"] = float(((g_tab - g_exact).abs()[nz] / g_exact[nz].abs()).max())
        return err

    @classmethod
    def from_vector(cls, phi: Tensor | Sequence[float]) -> NeuralMirrorMap:
        """Not for a table: build the map, then call ``.tabulated()`` on it."""
        raise TypeError(
            "TabulatedMirrorMap is built from a map: use NeuralMirrorMap.<constructor>(...)"
            ".tabulated()"
        )

    def _table(self, device: torch.device) -> Tensor:
        if device not in self._tables:
            self._tables[device] = self._table_cpu.to(device)
        return self._tables[device]

    def _cell(self, t: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Cell coordinate s in [0, 1] of float64 t in [t0, t1] and the six coefficients of its
        cell, each a contiguous tensor shaped like t (NaN propagates through s, its cell is 0).
        """
        u = t.sub(_TABLE_T0).mul_(1.0 / self._dt)
        idx = torch.nan_to_num_(u.floor(), nan=0.0).clamp_(0, self.cells - 1)
        s = u.sub_(idx)
        ix = idx.long().view(-1)
        rows = self._table(t.device)
        return s, tuple(rows[k].index_select(0, ix).view(t.shape) for k in range(6))

    @staticmethod
    def _p(s: Tensor, c: tuple[Tensor, ...]) -> Tensor:
        """P(s) = sum_k c_k s^k (Horner)."""
        c0, c1, c2, c3, c4, c5 = c
        o = torch.addcmul(c4, s, c5)
        for ck in (c3, c2, c1, c0):
            o = torch.addcmul(ck, s, o)
        return o

    @staticmethod
    def _dp(s: Tensor, c: tuple[Tensor, ...]) -> Tensor:
        """P'(s) = c1 + 2 s (c2 + 1.5 s (c3 + (4/3) s (c4 + 1.25 s c5))) (Horner)."""
        _, c1, c2, c3, c4, c5 = c
        o = torch.addcmul(c4, s, c5, value=1.25)
        o = torch.addcmul(c3, s, o, value=4.0 / 3.0)
        o = torch.addcmul(c2, s, o, value=1.5)
        return torch.addcmul(c1, s, o, value=2.0)

    @staticmethod
    def _d2p(s: Tensor, c: tuple[Tensor, ...]) -> Tensor:
        """P''(s) = 2 (c2 + 3 s (c3 + 2 s (c4 + (5/3) s c5)))."""
        _, _, c2, c3, c4, c5 = c
        o = torch.addcmul(c4, s, c5, value=5.0 / 3.0)
        o = torch.addcmul(c3, s, o, value=2.0)
        return torch.addcmul(c2, s, o, value=3.0).mul_(2.0)

    def _g(self, t: Tensor, order: int) -> tuple[Tensor, ...]:
        """(G, G', G'') up to ``order`` at float64 t in [t0, t1]."""
        s, c = self._cell(t)
        out = [self._p(s, c)]
        if order >= 1:
            out.append(self._dp(s, c) / self._dt)
        if order >= 2:
            out.append(self._d2p(s, c) / self._dt**2)
        return tuple(out)

    def _bregman_t(
        self, tq: Tensor, delta: Tensor, want_grad: bool, want_grad_q: bool = False
    ) -> tuple[Tensor, ...]:
        """D, d D / d log p (with ``want_grad``, else None) and, with ``want_grad_q``,
        d D / d log q, at float64 log q and delta = log p - log q, both log-probabilities in
        [t0, t1] (class docstring). The far form is evaluated for every element, the near
        form for the elements with |delta| <= Delta / 2 only, which it then overwrites."""
        inv = 1.0 / self._dt
        tq, delta = tq.contiguous(), delta.contiguous()
        # in place on the gathered coefficients throughout: fresh [64 x 1024] float64
        # temporaries cost the allocator and page faults more than their arithmetic here
        sq, cq = self._cell(tq)
        d2q = self._d2p(sq, cq) if want_grad_q else None
        gq, dpq = _p_and_dp_(sq, cq)  # G(t_q), Delta G'(t_q)
        sp, cp = self._cell(tq + delta)
        gp, dpp = _p_and_dp_(sp, cp)
        e = torch.exp(delta)
        em1 = e - 1.0  # no cancellation where the far form is used (|delta| > Delta / 2)
        grad = grad_q = None
        if d2q is not None:
            grad_q = d2q.mul_(inv * inv).sub_(dpq, alpha=inv).mul_(em1).neg_()
        value = gp.sub_(gq).sub_(em1.mul_(dpq), alpha=inv)
        if want_grad:
            grad = dpp.sub_(e.mul_(dpq)).mul_(inv)
        near = (delta.abs() <= _NEAR * self._dt).view(-1).nonzero().view(-1)
        if near.numel():
            nv, ng, ngq = self._near(tq.view(-1)[near], delta.view(-1)[near], want_grad)
            value.view(-1).index_copy_(0, near, nv)
            if grad is not None and ng is not None:
                grad.view(-1).index_copy_(0, near, ng)
            if grad_q is not None:
                grad_q.view(-1).index_copy_(0, near, ngq)
        return value.clamp_min_(0.0), grad, grad_q

    def _near(
        self, tq: Tensor, delta: Tensor, want_grad: bool
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """The near-p = q forms (class docstring) on q's cell polynomial: D, d D / d log p and
        d D / d log q, for |delta| <= Delta / 2."""
        inv = 1.0 / self._dt
        sq, c = self._cell(tq)
        _, _, c2, c3, c4, c5 = c
        x = sq + delta * inv
        dpq = self._dp(sq, c)
        phi = _horner(delta, _PHI_COEFFS[:_N_PHI])
        xx, xy, yy = x * x, x * sq, sq * sq
        r = (
            c2
            + c3 * (x + 2.0 * sq)
            + c4 * (xx + 2.0 * xy + 3.0 * yy)
            + c5 * (x * xx + 2.0 * xx * sq + 3.0 * x * yy + 4.0 * sq * yy)
        )
        d2 = delta * delta
        value = d2 * (r * inv**2 - dpq * phi * inv)
        grad = None
        if want_grad:
            qd = (
                2.0 * c2
                + 3.0 * c3 * (x + sq)
                + 4.0 * c4 * (xx + xy + yy)
                + 5.0 * c5 * ((x + sq) * (xx + yy))
            )
            grad = delta * (qd * inv**2 - (1.0 + delta * phi) * dpq * inv)
        em1 = delta * (1.0 + delta * phi)
        grad_q = -(self._d2p(sq, c) * inv**2 - dpq * inv) * em1
        return value, grad, grad_q

    def _beyond(self, *ts: Tensor) -> bool:
        return any(t.numel() > 0 and float(t.max()) > _TABLE_T1 for t in ts)

    def potential(self, y: Tensor) -> Tensor:
        """The tabulated h(y) = G(log y) + h(y0) + h'(y0)(y - y0) (floored at 1e-10; exact
        beyond y = e)."""
        y64, dt = self._tab_prep(y)
        if self._beyond(torch.log(y64)):
            return self._exact.potential(y)
        return (self._g(torch.log(y64), 0)[0] + self._h0 + self._g0 * (y64 - PROB_FLOOR)).to(dt)

    def derivative(self, y: Tensor) -> Tensor:
        """The tabulated h'(y) = G'(log y) / y + h'(y0)."""
        y64, dt = self._tab_prep(y)
        if self._beyond(torch.log(y64)):
            return self._exact.derivative(y)
        return (self._g(torch.log(y64), 1)[1] / y64 + self._g0).to(dt)

    def second_derivative(self, y: Tensor) -> Tensor:
        """The tabulated h''(y) = (G''(log y) - G'(log y)) / y^2."""
        y64, dt = self._tab_prep(y)
        if self._beyond(torch.log(y64)):
            return self._exact.second_derivative(y)
        _, g1, g2 = self._g(torch.log(y64), 2)
        return ((g2 - g1) / (y64 * y64)).to(dt)

    def _tab_prep(self, y: Tensor) -> tuple[Tensor, torch.dtype]:
        dt = compute_dtype(y)
        return y.to(torch.float64).clamp_min(PROB_FLOOR), dt

    def bregman(self, p: Tensor, q: Tensor) -> Tensor:
        """The tabulated D_h(p, q) (class docstring), p, q floored at 1e-10; exact map beyond
        y = e."""
        dtype = compute_dtype(p, q)
        p64, q64 = (
            p.to(torch.float64).clamp_min(PROB_FLOOR),
            q.to(torch.float64).clamp_min(PROB_FLOOR),
        )
        p64, q64 = torch.broadcast_tensors(p64, q64)
        top = math.exp(_TABLE_T1)
        if self._beyond(p64.detach().log(), q64.detach().log()):
            # the elements beyond the grid (no probabilities) from the exact map, the rest
            # from the table
            over = (p64 > top) | (q64 > top)
            inside = self.bregman(p64.clamp_max(top), q64.clamp_max(top)).to(dtype)
            exact = self._exact.bregman(p64[over], q64[over]).to(dtype)
            return inside.masked_scatter(over, exact)
        tq, delta = _log_pair(p64, q64)
        return self._apply(tq, delta, dtype)

    def bregman_log(self, logp: Tensor, anchor_logp: Tensor) -> Tensor:
        """D_h(e^logp, e^anchor_logp) from the log-probabilities directly (no exp and log):
        delta = logp - anchor_logp is exact in float64, so D keeps its relative precision for p
        next to q. Log-probabilities below log 1e-10 are floored (gradient 0 there)."""
        dtype = compute_dtype(logp, anchor_logp)
        logp, anchor_logp = torch.broadcast_tensors(logp, anchor_logp)
        if self._beyond(logp.detach(), anchor_logp.detach()):
            over = (logp > _TABLE_T1) | (anchor_logp > _TABLE_T1)
            inside = self.bregman_log(logp.clamp_max(_TABLE_T1), anchor_logp.clamp_max(_TABLE_T1))
            exact = self._exact.bregman(torch.exp(logp[over]), torch.exp(anchor_logp[over]))
            return inside.masked_scatter(over, exact.to(inside.dtype))
        if torch.is_grad_enabled() and (logp.requires_grad or anchor_logp.requires_grad):
            out: Tensor = _TableBregmanLog.apply(self, logp, anchor_logp, dtype)
            return out
        return self._log_forward(logp, anchor_logp, dtype, False, False)[0]

    def _log_forward(
        self, logp: Tensor, anchor_logp: Tensor, dtype: torch.dtype, want_p: bool, want_q: bool
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """D and its derivatives in log p and log q (zero below the floor), in ``dtype``."""
        tp = logp.detach().to(torch.float64, copy=True).clamp_min_(_TABLE_T0)
        tq = anchor_logp.detach().to(torch.float64, copy=True).clamp_min_(_TABLE_T0)
        value, gp, gq = self._bregman_t(tq, tp.sub_(tq), want_grad=want_p, want_grad_q=want_q)
        if gq is not None:
            if float(anchor_logp.detach().min()) < _TABLE_T0:
                gq.mul_(anchor_logp.detach() >= _TABLE_T0)
            gq = gq.to(dtype)
        if gp is not None:
            if float(logp.detach().min()) < _TABLE_T0:
                gp.mul_(logp.detach() >= _TABLE_T0)
            gp = gp.to(dtype)
        return value.to(dtype), gp, gq

    def _apply(self, tq: Tensor, delta: Tensor, dtype: torch.dtype) -> Tensor:
        if torch.is_grad_enabled() and (tq.requires_grad or delta.requires_grad):
            out: Tensor = _TableBregman.apply(self, tq, delta)
        else:
            out = self._bregman_t(tq, delta, want_grad=False)[0]
        return out.to(dtype)

    def tabulated(self, cells: int = TABLE_CELLS) -> TabulatedMirrorMap:
        return TabulatedMirrorMap(self, cells) if cells != self.cells else self

    def __repr__(self) -> str:
        return f"Tabulated{super().__repr__()[:-1]}, cells={self.cells})"


def _p_and_dp_(s: Tensor, c: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """P(s) and P'(s) of P(s) = sum_k c_k s^k by Horner with the partial sums reused
    (synthetic division: b4 = c4 + s c5, ..., b1 = c1 + s b2, P = c0 + s b1, P' = b1 +
    s (b2 + s (b3 + s (b4 + s c5)))), overwriting the coefficient tensors c."""
    c0, c1, c2, c3, c4, c5 = c
    b4 = c4.addcmul_(s, c5)
    b3 = c3.addcmul_(s, b4)
    b2 = c2.addcmul_(s, b3)
    b1 = c1.addcmul_(s, b2)
    value = c0.addcmul_(s, b1)
    slope = c5.mul_(s).add_(b4).mul_(s).add_(b3).mul_(s).add_(b2).mul_(s).add_(b1)
    return value, slope


def _log_pair(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """(log q, log p - log q) for float64 p, q > 0, the difference as log1p((p - q) / q) where
    p is within a factor 2 of q (p - q is then exact, so delta keeps full relative precision
    for p next to q)."""
    tq = torch.log(q)
    r = (p - q) / q
    close = r.abs() <= 0.5
    delta = torch.where(close, torch.log1p(torch.where(close, r, 0.0)), torch.log(p) - tq)
    return tq, delta


class _TableBregmanLog(torch.autograd.Function):
    """The tabulated D(log p, log q) of log-probabilities with its analytic gradients, formed
    in the forward pass (class docstring of :class:`TabulatedMirrorMap`)."""

    @staticmethod
    def forward(
        ctx: Any, table: TabulatedMirrorMap, logp: Tensor, anchor_logp: Tensor, dtype: torch.dtype
    ) -> Tensor:
        value, gp, gq = table._log_forward(
            logp, anchor_logp, dtype, ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        )
        ctx.save_for_backward(
            gp if gp is not None else torch.empty(0), gq if gq is not None else torch.empty(0)
        )
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None, Tensor | None, None]:
        gp, gq = ctx.saved_tensors
        return (
            None,
            grad * gp if ctx.needs_input_grad[1] else None,
            grad * gq if ctx.needs_input_grad[2] else None,
            None,
        )


class _TableBregman(torch.autograd.Function):
    """The tabulated D(log p, log q) with its analytic gradients (class docstring)."""

    @staticmethod
    def forward(ctx: Any, table: TabulatedMirrorMap, tq: Tensor, delta: Tensor) -> Tensor:
        # inputs (log q, delta = log p - log q): d/d delta = d/d log p, d/d log q (delta
        # fixed) = d/d log p + d/d log q (p fixed)
        need_q = ctx.needs_input_grad[1]
        value, gp, gq = table._bregman_t(
            tq, delta, want_grad=need_q or ctx.needs_input_grad[2], want_grad_q=need_q
        )
        ctx.save_for_backward(
            gp if gp is not None else torch.empty(0), gq if gq is not None else torch.empty(0)
        )
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None, Tensor | None]:
        gp, gq = ctx.saved_tensors
        return (
            None,
            grad * (gp + gq) if ctx.needs_input_grad[1] else None,
            grad * gp if ctx.needs_input_grad[2] else None,
        )
