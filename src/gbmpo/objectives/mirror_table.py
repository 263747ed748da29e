"""Tabulated evaluation of a neural mirror map: an explicit, opt-in option, never the default.

:class:`TabulatedMirrorMap` (built by :meth:`gbmpo.objectives.mirror.NeuralMirrorMap.tabulated`)
reads h, h', h'' of a fixed map from a float64 quintic Hermite table in log y
(:func:`quintic_hermite_coeffs`), with its error against the exact map measured at build.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gbmpo.objectives.mirror import (
    N_UNITS,
    PROB_FLOOR,
    TABLE_CELLS,
    NeuralMirrorMap,
    _compute_dtype,
)

__all__ = ["TabulatedMirrorMap", "quintic_hermite_coeffs"]

_TABLE_T0 = math.log(PROB_FLOOR)
_TABLE_T1 = 1.0  # the grid ends at y = e: probabilities and some margin above 1
_TABLE_CHECKS = 7  # interior check points per cell for the measured error


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
    """A :class:`NeuralMirrorMap` whose h, h', h'' (and so D_h) are read from a table: an
    explicit, opt-in evaluation (:meth:`NeuralMirrorMap.tabulated`); the exact map stays the
    default everywhere.

    The potential is a fixed 1-D function between ES steps, so it is tabulated once, in float64,
    on a uniform grid of ``cells`` cells in t = log y over [log 1e-10, 1] (probabilities and a
    margin above 1; arguments beyond e, which are no probabilities, use the exact map):
    on each cell h(e^t) is the quintic Hermite interpolant of the exact h, dh/dt = y h'(y) and
    d^2h/dt^2 = y h'(y) + y^2 h''(y) at the two knots (:func:`quintic_hermite_coeffs`), so the
    tabulated H is C^2 in t and its derivatives are the tabulated h' and h'' (H' = dH/dy,
    H'' = d^2H/dy^2): values and gradients are one consistent function. Then

        D(p, q) = max(H(p) - H(q) - H'(q)(p - q), 0),  dD/dp = H'(p) - H'(q),
        dD/dq = -H''(q)(p - q),

    in float64 (returned in the exact map's compute dtype). The error is *measured* at build, on
    ``7 * cells`` interior points against the exact float64 map: :attr:`table_error` holds
    max |H - h|, max |H' - h'| and max |H'' - h''| (absolute), so |D - D_h| <= 2 err_h +
    err_h' |p - q| + float64 rounding of the difference (~1e-16 (|h(p)| + |h(q)| + |h'(q)(p -
    q)|)). Unlike the exact factorised form, the value is a difference of table entries: for
    p very close to q its *relative* error is not small (its absolute error stays at the bound
    above), which is why it is not the default.
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
        self.cells = cells
        self._dt = (_TABLE_T1 - _TABLE_T0) / cells
        t = torch.linspace(_TABLE_T0, _TABLE_T1, cells + 1, dtype=torch.float64)
        y = torch.exp(t)
        y[0] = PROB_FLOOR
        h = NeuralMirrorMap.potential(self, y)
        g = NeuralMirrorMap.derivative(self, y)
        h2 = NeuralMirrorMap.second_derivative(self, y)
        ht = y * g  # dh/dt
        htt = ht + y * y * h2  # d^2h/dt^2
        dt = self._dt
        coef = quintic_hermite_coeffs(
            h[:-1], h[1:], dt * ht[:-1], dt * ht[1:], dt * dt * htt[:-1], dt * dt * htt[1:]
        )
        self._table_cpu = coef.t().contiguous()  # [6, cells]: c_k of every cell in row k
        self._tables: dict[torch.device, Tensor] = {}
        # measured error at interior points of every cell
        frac = torch.arange(1, _TABLE_CHECKS + 1, dtype=torch.float64) / (_TABLE_CHECKS + 1)
        tc = (t[:-1, None] + dt * frac[None, :]).reshape(-1)
        yc = torch.exp(tc)
        hh, gg, g2 = self._eval(yc, order=2)
        self.table_error = {
            "h": float((hh - NeuralMirrorMap.potential(self, yc)).abs().max()),
            "dh": float((gg - NeuralMirrorMap.derivative(self, yc)).abs().max()),
            "d2h": float((g2 - NeuralMirrorMap.second_derivative(self, yc)).abs().max()),
        }

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

    def _eval(self, y: Tensor, order: int) -> tuple[Tensor, ...]:
        """(H, H', H'') up to ``order`` at float64 y >= 1e-10 (NaN propagates)."""
        top = math.exp(_TABLE_T1)
        above = y.numel() > 0 and float(y.max()) > top
        # in-place arithmetic on few buffers throughout: for [64 x 1024] float64 arguments
        # each fresh temporary costs the allocator and page faults more than its arithmetic
        u = torch.log(y.clamp_max(top) if above else y).sub_(_TABLE_T0).mul_(1.0 / self._dt)
        idx = torch.nan_to_num_(u.floor(), nan=0.0).clamp_(0, self.cells - 1)
        s = u.sub_(idx)
        # the table is stored [6, cells]: one gather gives six contiguous coefficient rows
        ix = idx.reshape(1, -1).long().expand(6, -1)
        rows = torch.gather(self._table(y.device), 1, ix)
        c0, c1, c2, c3, c4, c5 = rows.view(6, *y.shape).unbind(0)
        hss = None
        if order >= 2:
            hss = 2.0 * c2 + s * (6.0 * c3 + s * (12.0 * c4 + s * (20.0 * c5)))
        # Horner for H, and for dH/ds from Horner's partial sums (synthetic division):
        # b4 = c4 + s c5, ..., b1 = c1 + s b2, H = c0 + s b1; dH/ds = b1 + s (b2 + s (b3 +
        # s (b4 + s c5)))
        b4 = c4.addcmul_(s, c5)
        b3 = c3.addcmul_(s, b4)
        b2 = c2.addcmul_(s, b3)
        b1 = c1.addcmul_(s, b2)
        h = c0.addcmul_(s, b1)
        hs = c5.mul_(s).add_(b4).mul_(s).add_(b3).mul_(s).add_(b2).mul_(s).add_(b1)
        dy = y * self._dt
        out = [h, hs.div_(dy)]  # dH/dy = (dH/ds) / (Delta y)
        if hss is not None:
            # H'' = (d2H/ds2 / Delta - dH/ds) / (Delta y^2), with dH/ds = H' Delta y
            out.append((hss / self._dt - hs * dy) / (dy * y))
        if above:  # beyond the grid: the exact map there
            over = y > top
            yo = y[over]
            exact = (NeuralMirrorMap.potential, NeuralMirrorMap.derivative,
                     NeuralMirrorMap.second_derivative)  # fmt: skip
            for k in range(len(out)):
                out[k] = out[k].masked_scatter(over, exact[k](self, yo))
        return tuple(out)

    def _tab_prep(self, y: Tensor) -> tuple[Tensor, torch.dtype]:
        dt = _compute_dtype(y)
        return y.to(torch.float64).clamp_min(PROB_FLOOR), dt

    def potential(self, y: Tensor) -> Tensor:
        """The tabulated h(y) (floored at 1e-10; exact beyond y = e)."""
        y64, dt = self._tab_prep(y)
        return self._eval(y64, 1)[0].to(dt)

    def derivative(self, y: Tensor) -> Tensor:
        """The tabulated h'(y) = dH/dy."""
        y64, dt = self._tab_prep(y)
        return self._eval(y64, 1)[1].to(dt)

    def second_derivative(self, y: Tensor) -> Tensor:
        """The tabulated h''(y) = d^2H/dy^2."""
        y64, dt = self._tab_prep(y)
        return self._eval(y64, 2)[2].to(dt)

    def _bregman_and_grad(
        self, p: Tensor, q: Tensor, want_grad: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Tabulated D(p, q) and dD/dp = H'(p) - H'(q) (class docstring), in p's dtype."""
        p64, q64 = p.to(torch.float64), q.to(torch.float64)
        hp, gp = self._eval(p64, 1)
        hq, gq = self._eval(q64, 1)
        value = hp.sub_(hq).sub_(gq * (p64 - q64)).clamp_min_(0.0).to(p.dtype)
        return value, gp.sub_(gq).to(p.dtype) if want_grad else None

    def tabulated(self, cells: int = TABLE_CELLS) -> TabulatedMirrorMap:
        return TabulatedMirrorMap(self, cells) if cells != self.cells else self

    def __repr__(self) -> str:
        return f"Tabulated{super().__repr__()[:-1]}, cells={self.cells})"
