"""Tabulated evaluation of a neural mirror map (GBMPO NM-GRPO, arXiv 2602.04380): the
``neural_mirror`` regularizer's ``evaluation: table``, its default (``exact`` sums the units).

:class:`MirrorTable` (behind :class:`gbmpo.objectives.mirror.TabulatedMirrorMap`, built by
:meth:`gbmpo.objectives.mirror.NeuralMirrorMap.tabulated`) reads the map's Bregman divergence
from its potential's float64 quintic Hermite table in log y (:func:`quintic_hermite_coeffs`) in
a form that keeps the divergence's relative precision next to p = q; its relative error against
the exact map (at most :data:`TABLE_RTOL` = 1e-6 of D_h and of its gradient) is measured at
build, and a table that misses it is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from gbmpo.objectives.mirror_kernels import _PHI_COEFFS, PROB_FLOOR, TABLE_CELLS
from gbmpo.objectives.tensors import compute_dtype

__all__ = ["TABLE_RTOL", "ExactMirrorMap", "MirrorTable", "quintic_hermite_coeffs"]

#: the table's guarantee: relative error of D_h and of d D_h / d log p against the exact
#: float64 map, measured at build (``table_error``); a table that misses it is refused
TABLE_RTOL = 1e-6

_TABLE_T0 = math.log(PROB_FLOOR)
_TABLE_T1 = 1.0  # the grid ends at y = e: probabilities and some margin above 1
_TABLE_CHECKS = 7  # interior check points per cell for the measured error
#: |log p - log q| <= _NEAR * Delta uses the factorised near-p = q form (q's cell polynomial)
_NEAR = 0.5
#: terms of the series of phi(d) = (e^d - 1 - d) / d^2 in the near form: |d| <= Delta / 2 < 0.006
#: and the first term left out, 0.006^6 / 8!, is below 1e-17 of phi >= 1/2
_N_PHI = 6


class ExactMirrorMap(Protocol):
    """What a table reads from the exact map it tabulates
    (:class:`gbmpo.objectives.mirror.NeuralMirrorMap`, elementwise, float64 on the grid)."""

    def potential(self, y: Tensor) -> Tensor: ...

    def derivative(self, y: Tensor) -> Tensor: ...

    def second_derivative(self, y: Tensor) -> Tensor: ...

    def bregman(self, p: Tensor, q: Tensor) -> Tensor: ...

    def _bregman_and_grad(
        self, p: Tensor, q: Tensor, want_grad: bool
    ) -> tuple[Tensor, Tensor | None]: ...


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


class _DeviceConsts(NamedTuple):
    """Per-device constants of a table's kernel (:meth:`MirrorTable._consts`)."""

    rows: tuple[Tensor, ...]
    origin: Tensor
    phi: tuple[Tensor, ...]


class MirrorTable:
    """The h, h', h'' and D_h of a map (``exact``) read from a float64 table in t = log y, to a
    relative error of at most 1e-6 of D_h (measured at build, :attr:`table_error`), p = q
    included: ``objective.regularizer.params.evaluation: table`` (the default) selects it.

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

    Cost: :meth:`_kernel` (p = q skipped) and :meth:`_kernel_dense` (one Horner recurrence).
    """

    def __init__(self, exact: ExactMirrorMap, cells: int = TABLE_CELLS) -> None:
        if isinstance(cells, bool) or not isinstance(cells, int) or cells < 16:
            raise ValueError(f"cells must be an integer >= 16, got {cells!r}")
        self._exact = exact
        self.cells = cells
        self._dt = (_TABLE_T1 - _TABLE_T0) / cells
        t = torch.linspace(_TABLE_T0, _TABLE_T1, cells + 1, dtype=torch.float64)
        g, gt, gtt = self._exact_g(t)
        dt = self._dt
        coef = quintic_hermite_coeffs(
            g[:-1], g[1:], dt * gt[:-1], dt * gt[1:], dt * dt * gtt[:-1], dt * dt * gtt[1:]
        )
        # [6, cells + 1]: c_k of every cell in row k, and one cell past t1 (the last cell's
        # polynomial re-expanded about s = 1) so that t = t1 exactly needs no index clamp
        self._table_cpu = torch.cat([coef, _shift_by_one(coef[-1])[None]]).t().contiguous()
        self._tables: dict[torch.device, Tensor] = {}
        self._dev: dict[torch.device, _DeviceConsts] = {}
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
        checked = (g_exact != 0) & (delta.abs() >= 1e-6)
        err["grad_rel"] = float(((g_tab - g_exact).abs()[checked] / g_exact[checked].abs()).max())
        return err

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
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """D, d D / d log p (with ``want_grad``, else None) and, with ``want_grad_q``,
        d D / d log q, float64, at float64 log q and delta = log p - log q, both
        log-probabilities in [t0, t1] or NaN (NaN propagates)."""
        shape = tq.shape
        tq, delta = tq.reshape(-1), delta.reshape(-1).contiguous()
        bad = None
        if not math.isfinite(float(tq.sum() + delta.sum())):  # evaluated at 0, then NaN
            bad = tq.isnan() | delta.isnan()
            tq, delta = tq.nan_to_num(nan=0.0), delta.nan_to_num(nan=0.0)
        out = self._kernel(tq, tq + delta, delta, want_grad, want_grad_q)
        if bad is not None:
            for o in out:
                if o is not None:
                    o.masked_fill_(bad, math.nan)
        return tuple(None if o is None else o.view(shape) for o in out)  # type: ignore[return-value]

    def _kernel(
        self, tq: Tensor, tp: Tensor, delta: Tensor | None, want_p: bool, want_q: bool,
        dtype: torch.dtype = torch.float64,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The divergence (class docstring) and its derivatives in log p and log q, flat, in
        ``dtype``, from flat log q, log p (float32 or float64, finite, inside [t0, t1]) and
        float64 ``delta`` = log p - log q (None: formed here, exactly, from log p and log q).

        p = q (delta = 0: padding, a policy still at its reference) gives D = 0 and zero
        derivatives exactly; when more than 1/16 of the elements have it, only the others go
        through :meth:`_kernel_dense`. The compaction is branch-free, so it costs the same
        whatever the pattern of the padding: a running count of the moving elements is each
        one's slot, the p = q elements all go to slot 0, which is then set to p = q = 1 (D = 0
        and zero derivatives exactly, in the far form) and read back for them."""
        n = tq.numel()
        dev = tq.device
        if tq.dtype != tp.dtype:  # one dtype for the [2, n] buffers
            common = torch.promote_types(tq.dtype, tp.dtype)
            tq, tp = tq.to(common), tp.to(common)
        moving_mask = (tp - tq if delta is None else delta).bool()  # x - y = 0 iff x = y
        slot = torch.cumsum(moving_mask, 0)
        moving = int(slot[-1]) if n else 0
        if moving >= n - n // 16:  # (almost) nothing to skip
            tqp = torch.stack((tq, tp))
            out = self._kernel_dense(tqp, delta, want_p, want_q, moving == n)
            return tuple(None if o is None else o.to(dtype) for o in out)  # type: ignore[return-value]
        slot = torch.where(moving_mask, slot, 0)
        tqp = torch.empty((2, moving + 1), dtype=tq.dtype, device=dev)
        tqp[0].scatter_(0, slot, tq)
        tqp[1].scatter_(0, slot, tp)
        tqp[:, 0].zero_()
        if delta is not None:
            delta = torch.empty(moving + 1, dtype=delta.dtype, device=dev).scatter_(0, slot, delta)
            delta[0] = 0.0
        out = self._kernel_dense(tqp, delta, want_p, want_q, None)
        return tuple(  # type: ignore[return-value]
            None if o is None else o.to(dtype).index_select(0, slot) for o in out
        )

    def _kernel_dense(
        self, tqp: Tensor, delta: Tensor | None, want_p: bool, want_q: bool,
        moving: bool | None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """:meth:`_kernel` on every element of ``tqp`` = [log q; log p] ([2, n]), float64 out.
        The near form is taken where 0 < |delta| < Delta / 2; ``moving``: True where no delta
        is 0 (one test fewer), None where only element 0 is (a compacted batch's slot 0, left
        to the far form). Each step is one pass over both points at once: the cell coordinates
        (u = (t - t0) / Delta, index by truncation, s = frac(u)), six gathers, one Horner
        recurrence for P and P' (synthetic division), the far form everywhere, then the near
        form on the few elements with 0 < |delta| < Delta / 2 only (from q's coefficients and
        P'(s_q), already at hand), which it overwrites."""
        n = tqp.shape[1]
        consts = self._consts(tqp.device)
        inv = 1.0 / self._dt
        # float64 first, then float64-only arithmetic (mixed-dtype arithmetic runs at about
        # half the speed per element on CPU)
        t = tqp.to(torch.float64)
        if delta is None:  # exact for float32 inputs
            t_q, t_p = t.unbind()
            delta = t_p - t_q
        u = torch.add(consts.origin, t, alpha=inv).view(-1)  # q's elements first, then p's
        ix = u.to(torch.int32)  # u >= 0: truncation is the floor; u = cells reads the padding
        s = u.frac_()
        c = tuple(row.index_select(0, ix) for row in consts.rows)
        # 0 < |delta| < Delta / 2: delta = 0 (p = q) is exactly 0 in the far form (the same
        # cell and s at both points; e^0 = 1), so it stays there
        half = 0.5 * self._dt
        if moving is False:
            near = delta.abs().sub_(0.5 * half).abs_().lt_(0.5 * half).nonzero().view(-1)
        else:
            near = delta.abs().lt_(half).nonzero().view(-1)
            if moving is None:  # element 0 (delta = 0) is the first index found
                near = near[1:]
        # q's cell coordinate and c2..c5 there (the first n flat elements are q's), before
        # Horner overwrites them
        q_near = tuple(x.index_select(0, near) for x in (s, *c[2:])) if near.numel() else ()
        d2q = _d2p_rows(*(x[:n] for x in (s, *c[2:]))) if want_q else None
        g, dg = _p_and_dp_(s, c)  # G and Delta G' at log q (first half) and log p
        g0, g1 = g.view(2, n).unbind()
        dg0, dg1 = dg.view(2, n).unbind()
        e = torch.exp(delta)
        grad = grad_q = None
        if want_p:
            grad = dg1.addcmul_(e, dg0, value=-1.0).mul_(inv)
        em1 = e.sub_(1.0)  # no cancellation where the far form is kept (|delta| > Delta / 2)
        if d2q is not None:
            grad_q = d2q.mul_(inv * inv).sub_(dg0, alpha=inv).mul_(em1).neg_()
        value = g1.sub_(g0).addcmul_(em1, dg0, value=-inv)
        if near.numel():
            nv, ng, ngq = _near_form(
                delta.index_select(0, near), dg0.index_select(0, near), *q_near, self._dt,
                want_p, want_q, consts.phi,
            )
            value.index_copy_(0, near, nv)
            if grad is not None and ng is not None:
                grad.index_copy_(0, near, ng)
            if grad_q is not None and ngq is not None:
                grad_q.index_copy_(0, near, ngq)
        return value.clamp_min_(0.0), grad, grad_q

    def _consts(self, device: torch.device) -> _DeviceConsts:
        """The table's rows c_k, the origin -t0 / Delta and the first :data:`_N_PHI` Taylor
        coefficients of phi (0-dim, one fused multiply-add per Horner step in
        :func:`_near_form`), float64 on ``device``, cached."""
        if device not in self._dev:
            rows = self._table(device)
            phi = torch.tensor(_PHI_COEFFS[:_N_PHI], dtype=torch.float64, device=device)
            origin = torch.full((1, 1), -_TABLE_T0 / self._dt, dtype=torch.float64, device=device)
            self._dev[device] = _DeviceConsts(tuple(rows.unbind()), origin, tuple(phi.unbind()))
        return self._dev[device]

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
        next to q. Log-probabilities below log 1e-10 are floored (gradient 0 there); beyond
        log y = 1 (no probabilities) the exact map is used."""
        dtype = compute_dtype(logp, anchor_logp)
        logp, anchor_logp = torch.broadcast_tensors(logp, anchor_logp)
        if torch.is_grad_enabled() and (logp.requires_grad or anchor_logp.requires_grad):
            out: Tensor = _TableBregmanLog.apply(self, logp, anchor_logp, dtype)
            return out
        return self._log_forward(logp, anchor_logp, dtype, False, False)[0]

    def _log_forward(
        self, logp: Tensor, anchor_logp: Tensor, dtype: torch.dtype, want_p: bool, want_q: bool
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """D and its derivatives in log p and log q (zero below the floor), in ``dtype``:
        inputs inside the grid (the common case, checked by one ``aminmax`` each) go to
        :meth:`_kernel` as they are; otherwise they are converted to float64 and clamped, NaN
        propagates, and elements beyond log y = 1 (no probabilities) take the exact map."""
        shape = logp.shape
        lp, lq = logp.detach().reshape(-1), anchor_logp.detach().reshape(-1)
        f64 = torch.float64
        if lp.numel() == 0:
            empty = lp.to(dtype).view(shape)
            return empty, (empty if want_p else None), (empty if want_q else None)
        ends = torch.stack((*torch.aminmax(lp), *torch.aminmax(lq))).tolist()  # NaN shows
        if all(_TABLE_T0 <= x <= _TABLE_T1 for x in ends):  # the common case
            out = self._kernel(lq, lp, None, want_p, want_q, dtype)
            return tuple(None if o is None else o.view(shape) for o in out)  # type: ignore[return-value]
        # NaN or inf (evaluated at 0, then NaN), beyond the grid, below the floor
        tq, tp = lq.to(f64, copy=True), lp.to(f64, copy=True)
        bad: Tensor | None = ~(torch.isfinite(tq) & torch.isfinite(tp))
        if bool(bad.any()):
            tq.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            tp.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        else:
            bad = None
        over = (tq > _TABLE_T1) | (tp > _TABLE_T1)  # the exact map there (below)
        below = None
        if want_p or want_q:  # gradient 0 below the floor
            below = (tq >= _TABLE_T0, tp >= _TABLE_T0)
        tq.clamp_(_TABLE_T0, _TABLE_T1)
        tp.clamp_(_TABLE_T0, _TABLE_T1)
        delta = tp - tq
        value, gp, gq = self._kernel(tq, tp, delta, want_p, want_q, dtype)
        if below is not None:
            if gp is not None:
                gp.mul_(below[1])
            if gq is not None:
                gq.mul_(below[0])
        if bool(over.any()):
            self._exact_at(over, lp, lq, value, gp, gq)
        if bad is not None:
            for o in (value, gp, gq):
                if o is not None:
                    o.masked_fill_(bad, math.nan)
        return tuple(  # type: ignore[return-value]
            None if o is None else o.view(shape) for o in (value, gp, gq)
        )

    def _exact_at(
        self, where: Tensor, lp: Tensor, lq: Tensor, value: Tensor, gp: Tensor | None,
        gq: Tensor | None,
    ) -> None:
        """Overwrite D and its log-derivatives p (h'(p) - h'(q)), -q h''(q)(p - q) at the
        flat positions ``where`` with the exact map's (beyond the grid)."""
        idx = where.nonzero().view(-1)
        p = lp.index_select(0, idx).to(torch.float64).exp()
        q = lq.index_select(0, idx).to(torch.float64).exp()
        d, dh = self._exact._bregman_and_grad(
            p.clamp_min(PROB_FLOOR), q.clamp_min(PROB_FLOOR), want_grad=gp is not None
        )
        value.index_copy_(0, idx, d.to(value.dtype))
        if gp is not None and dh is not None:
            gp.index_copy_(0, idx, (p * dh * (p >= PROB_FLOOR)).to(gp.dtype))
        if gq is not None:
            h2 = self._exact.second_derivative(q.clamp_min(PROB_FLOOR))
            gq.index_copy_(
                0, idx, (-q * h2 * (p.clamp_min(PROB_FLOOR) - q) * (q >= PROB_FLOOR)).to(gq.dtype)
            )

    def _apply(self, tq: Tensor, delta: Tensor, dtype: torch.dtype) -> Tensor:
        if torch.is_grad_enabled() and (tq.requires_grad or delta.requires_grad):
            out: Tensor = _TableBregman.apply(self, tq, delta)
        else:
            out = self._bregman_t(tq, delta, want_grad=False)[0]
        return out.to(dtype)


def _shift_by_one(c: Tensor) -> Tensor:
    """Coefficients of Q(s) = P(1 + s) from those of P(s) = sum_k c_k s^k (last dim):
    q_j = sum_{k >= j} binom(k, j) c_k (binomial expansion)."""
    n = c.shape[-1]
    return torch.stack(
        [sum(math.comb(k, j) * c[..., k] for k in range(j, n)) for j in range(n)], dim=-1
    )


def _p_and_dp_(s: Tensor, c: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """P(s) and P'(s) of P(s) = sum_k c_k s^k by Horner with the partial sums reused
    (synthetic division: b4 = c4 + s c5, ..., b1 = c1 + s b2, P = c0 + s b1, and P' = a1 with
    a4 = b4 + s c5, a3 = b3 + s a4, a2 = b2 + s a3, a1 = b1 + s a2): nine fused multiply-adds,
    overwriting the coefficient tensors c."""
    c0, c1, c2, c3, c4, c5 = c
    b4 = c4.addcmul_(s, c5)
    b3 = c3.addcmul_(s, b4)
    b2 = c2.addcmul_(s, b3)
    b1 = c1.addcmul_(s, b2)
    value = c0.addcmul_(s, b1)
    a = c5
    for b in (b4, b3, b2, b1):  # four passes, unrolled by the interpreter
        torch.addcmul(b, s, a, out=a)
    return value, a


def _d2p_rows(s: Tensor, c2: Tensor, c3: Tensor, c4: Tensor, c5: Tensor) -> Tensor:
    """P''(s) = 2 (c2 + 3 s (c3 + 2 s (c4 + (5/3) s c5))) (Horner; new tensor)."""
    o = torch.addcmul(c4, s, c5, value=5.0 / 3.0)
    o = torch.addcmul(c3, s, o, value=2.0)
    return torch.addcmul(c2, s, o, value=3.0).mul_(2.0)


def _near_form(
    delta: Tensor, dpq: Tensor, s: Tensor, c2: Tensor, c3: Tensor, c4: Tensor, c5: Tensor,
    dt: float, want_p: bool, want_q: bool, phi_coeffs: Sequence[Tensor],
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The near-p = q forms of :class:`MirrorTable` on q's cell polynomial P, from delta =
    log p - log q, P'(s_q), s_q and c2..c5, with h = delta / Delta and a_j = P^(j)(s_q) / j!:

        R = (P(s + h) - P(s) - P'(s) h) / h^2 = a2 + h (a3 + h (a4 + h a5)),
        Q / 2 = (P'(s + h) - P'(s)) / (2 h) = a2 + 1.5 h (a3 + (4/3) h (a4 + 1.25 h a5)),
        D = h^2 (R - Delta P'(s) phi),
        d D / d log p = 2 h / Delta (Q / 2 - (Delta / 2) (P'(s) + delta P'(s) phi)),
        d D / d log q = -(2 a2 / Delta^2 - P'(s) / Delta) delta (1 + delta phi),

    phi(delta) = (e^delta - 1 - delta) / delta^2 by its Taylor series (``phi_coeffs``;
    |delta| < 0.006: the terms left out are below 1e-17)."""
    inv = 1.0 / dt
    h = delta * inv
    a4 = torch.addcmul(c4, s, c5, value=5.0)
    a3 = torch.addcmul(c4, s, c5, value=2.5)
    a3 = torch.addcmul(c3, s, a3, value=4.0, out=a3)
    a2 = torch.addcmul(c4, s, c5, value=5.0 / 3.0)
    a2 = torch.addcmul(c3, s, a2, value=2.0, out=a2)
    a2 = torch.addcmul(c2, s, a2, value=3.0, out=a2)
    r = torch.addcmul(a4, h, c5)
    r = torch.addcmul(a3, h, r, out=r)
    r = torch.addcmul(a2, h, r, out=r)
    phi = torch.mul(delta, phi_coeffs[-1]).add_(phi_coeffs[-2])
    for cf in reversed(phi_coeffs[:-2]):
        phi = torch.addcmul(cf, delta, phi, out=phi)
    w = dpq * phi  # P'(s) phi
    value = r.sub_(w, alpha=dt).mul_(h).mul_(h)
    grad = grad_q = None
    if want_p:
        qh = torch.addcmul(a4, h, c5, value=1.25)
        qh = torch.addcmul(a3, h, qh, value=4.0 / 3.0, out=qh)
        qh = torch.addcmul(a2, h, qh, value=1.5, out=qh)  # Q / 2
        grad = qh.sub_(dpq, alpha=0.5 * dt).addcmul_(delta, w, value=-0.5 * dt)
        grad = grad.mul_(h).mul_(2.0 * inv)
    if want_q:  # -(2 a2 / Delta^2 - P'(s) / Delta) (delta + delta^2 phi)
        grad_q = torch.mul(a2, -2.0 * inv * inv).add_(dpq, alpha=inv).mul_(delta)
        grad_q = grad_q.addcmul_(grad_q, delta * phi)
    return value, grad, grad_q


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
    in the forward pass (class docstring of :class:`MirrorTable`). Kept for numerics:
    near p = q the gradient's factorised form avoids the cancellation autograd would form
    through the compacted kernel (tests/objectives/test_mirror_table.py gradchecks it)."""

    @staticmethod
    def forward(
        ctx: Any, table: MirrorTable, logp: Tensor, anchor_logp: Tensor, dtype: torch.dtype
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
    """The tabulated D(log p, log q) with its analytic gradients (class docstring); kept for
    the same cancellation as :class:`_TableBregmanLog`."""

    @staticmethod
    def forward(ctx: Any, table: MirrorTable, tq: Tensor, delta: Tensor) -> Tensor:
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
