"""Neural mirror map: a learnable separable convex potential (GBMPO NM-GRPO, PMD-MM).

GBMPO (arXiv 2602.04380, "neural mirror map" regularizer) takes the omega-potential
parameterisation of Alfano et al., "Meta-learning the mirror map in policy mirror descent"
(arXiv 2402.05187): the derivative of the potential on a probability y in (0, 1] is

    h'(y) = sum_{j=1}^{126} v_j sigma_{k(j)}(w_j y + b_j) + a y + c log y,

with 21 units each of the activations (in this order) cube u^3, square u^2, sqrt([u]_+),
cbrt([u]_+), log([u]_+ + 1e-3) and exp(u). The potential is the antiderivative

    h(y) = sum_j v_j H_j(y) + (a / 2) y^2 + c (y log y - y),
    H_j(y) = int_0^y sigma(w_j s + b_j) ds,

and the regularizer is its Bregman divergence D_h(p, q) = h(p) - h(q) - h'(q) (p - q) on the
probabilities of the sampled token (docs/methods.md, section "Neural mirror map"). The parameter
vector has the authors' 380-value layout ``[v(126), w(126), b(126), a, c]``.

Convexity by construction. h''(y) = sum_j v_j w_j sigma'(u_j) + a + c / y. Every activation is
non-decreasing on u >= 0, so h'' >= 0 on (0, inf) when v, w, a, c >= 0 *and* u_j = w_j y + b_j
>= 0 for y > 0, which needs b_j >= 0: the square unit u^2 decreases for u < 0 (so with b < 0 and
v, w > 0 it contributes a *negative* curvature 2 v w u), and the clamped units [u]_+ would switch
off. :class:`NeuralMirrorMap` therefore stores only parameters with every entry of v, w, b, a, c
>= 0 and rejects anything else. Evolution strategies search an unconstrained vector theta in R^380
that :meth:`NeuralMirrorMap.from_unconstrained` maps to parameters by the projection
``phi = max(theta, 0)`` (see that method for why projection rather than softplus).

Numerics. Every Bregman term is evaluated in the factorised form ``(p - q)^2 * K(p, q)`` with
K >= 0 written without cancellation (closed forms below, Taylor series for small arguments), so
the divergence is >= 0 in floating point, exactly 0 at p = q, and needs no division by w_j. This
replaces the authors' ``|w_j| < 1e-12`` switch to the linear primitive sigma(b_j) y: here the
w_j -> 0 limit is reached continuously (for w_j = 0 the unit contributes sigma(b_j) y to h and 0
to D_h). Probabilities are floored at 1e-10 before anything is computed, as in the authors' code.
Math is float64 for float64 inputs and float32 for every other dtype (bf16 log-probs underflow).

The per-activation closed forms and curvature kernels K, their Taylor series near p = q, and
:func:`~gbmpo.objectives.mirror_kernels.generalized_kl` are in
:mod:`gbmpo.objectives.mirror_kernels`.

Tabulated evaluation (the regularizer's ``evaluation: table``, its default; ``exact`` sums the
units): :meth:`NeuralMirrorMap.tabulated` returns a
:class:`~gbmpo.objectives.mirror_table.TabulatedMirrorMap` (:mod:`gbmpo.objectives.mirror_table`),
the same map with D_h read from a float64 quintic Hermite table in log y, to a relative error of
at most 1e-6 of D_h and of its gradient (measured at build, p = q included), ~30x cheaper as a
regularizer.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.mirror_kernels import (
    _CURV_DIFF,
    _MEAN,
    _POLY,
    PROB_FLOOR,
    TABLE_CELLS,
    _dsigma,
    _gkl_over_sq,
    _sigma,
)
from gbmpo.objectives.mirror_table import MirrorTable
from gbmpo.objectives.tensors import compute_dtype

__all__ = [
    "ACTIVATIONS",
    "N_UNITS",
    "PROB_FLOOR",
    "UNITS_PER_ACTIVATION",
    "VECTOR_SIZE",
    "NeuralMirrorMap",
    "TABLE_CELLS",
    "TabulatedMirrorMap",
    "as_mirror_map",
]

N_UNITS = 126
UNITS_PER_ACTIVATION = 21
ACTIVATIONS: tuple[str, ...] = ("cube", "square", "sqrt", "cbrt", "log", "exp")
VECTOR_SIZE = 3 * N_UNITS + 2  # 380 = [v(126), w(126), b(126), a, c]
FILE_FORMAT = "gbmpo.neural_mirror_map"
FILE_VERSION = 1
_BLOCKS = ("v", "w", "b")



def _as_float64_vector(x: Any) -> Tensor:
    t = torch.as_tensor(x.detach() if isinstance(x, Tensor) else x, dtype=torch.float64)
    return t.to("cpu").clone()


class NeuralMirrorMap:
    """Separable convex potential h with h'(y) = sum_j v_j sigma_j(w_j y + b_j) + a y + c log y.

    GBMPO (arXiv 2602.04380) NM-GRPO regularizer, omega-potential parameterisation of Alfano et
    al. (arXiv 2402.05187); formulas in docs/methods.md, section "Neural mirror map" and the module
    docstring. 126 units, 21 each of cube, square, sqrt, cbrt, log, exp (in that order). The
    parameters are frozen (plain float64 tensors, no autograd) and must all be >= 0, which makes h
    convex on (0, inf): h'' = sum_j v_j w_j sigma'(w_j y + b_j) + a + c / y >= 0 because every
    activation is non-decreasing for u >= 0 and b >= 0 keeps u = w y + b >= 0 for y > 0 (with b < 0
    the square unit bends down for small y and D_h can go negative). h is strictly convex when a > 0
    or c > 0.

    Special cases: ``NeuralMirrorMap(a=2.0)`` gives ProbL2, D_h = (p - q)^2;
    ``NeuralMirrorMap(c=1.0)`` gives the generalized KL p log(p/q) - p + q.

    Build from the authors' 380-value layout with :meth:`from_vector` (rejects negative entries),
    from an unconstrained ES search vector with :meth:`from_unconstrained` (projects onto >= 0),
    at random like NM-GRPO with :meth:`random`, or from a file with :meth:`load`.
    """

    name = "neural_mirror"

    def __init__(
        self,
        v: Tensor | Sequence[float] | None = None,
        w: Tensor | Sequence[float] | None = None,
        b: Tensor | Sequence[float] | None = None,
        a: float = 0.0,
        c: float = 0.0,
    ) -> None:
        parts = []
        for block, x in zip(_BLOCKS, (v, w, b), strict=True):
            if x is None:
                parts.append(torch.zeros(N_UNITS, dtype=torch.float64))
                continue
            t = _as_float64_vector(x)
            if t.shape != (N_UNITS,):
                raise ValueError(
                    f"NeuralMirrorMap block {block!r} must have shape ({N_UNITS},), "
                    f"got {tuple(t.shape)}"
                )
            parts.append(t)
        parts.append(torch.tensor([float(a), float(c)], dtype=torch.float64))
        vec = torch.cat(parts)
        _check_vector(vec)
        self._vec = vec
        blocks = vec[: 3 * N_UNITS].view(3, len(ACTIVATIONS), UNITS_PER_ACTIVATION)
        vw = blocks[0] * blocks[1]
        # Blocks whose v_j (for h, h') or v_j w_j (for D_h, h'') all vanish contribute nothing.
        self._v_active = tuple(bool((blocks[0, k] != 0).any()) for k in range(len(ACTIVATIONS)))
        self._active = tuple(bool((vw[k] != 0).any()) for k in range(len(ACTIVATIONS)))
        self._cache: dict[tuple[torch.dtype, torch.device], tuple[Tensor, ...]] = {}
        self._positive_cache: dict[tuple[torch.dtype, torch.device], tuple[bool, ...]] = {}

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_vector(cls, phi: Tensor | Sequence[float]) -> NeuralMirrorMap:
        """Build from the 380-value layout ``[v(126), w(126), b(126), a, c]`` (authors' order).

        Raises ValueError naming the block (v/w/b/a/c) and index of the first negative or
        non-finite entry: a negative entry can make h non-convex and D_h negative, so it is never
        used silently. Use :meth:`from_unconstrained` to map an arbitrary vector explicitly.
        """
        vec = _as_float64_vector(phi)
        if vec.shape != (VECTOR_SIZE,):
            raise ValueError(
                f"a neural mirror map vector must have shape ({VECTOR_SIZE},) in the layout "
                f"[v(126), w(126), b(126), a, c]; got shape {tuple(vec.shape)}"
            )
        _check_vector(vec)
        n = N_UNITS
        return cls(vec[:n], vec[n : 2 * n], vec[2 * n : 3 * n], float(vec[-2]), float(vec[-1]))

    @classmethod
    def from_unconstrained(cls, theta: Tensor | Sequence[float]) -> NeuralMirrorMap:
        """Map an ES search vector theta in R^380 to a convex map: phi = max(theta, 0).

        Every finite theta gives a valid (convex) map. The projection is the identity on the
        feasible set, so ``to_unconstrained()`` returns ``to_vector()`` and round-trips exactly;
        zeros (and hence the special cases ProbL2 and generalized KL) are reached exactly; and a
        step of size sigma in theta is a step of size sigma in the parameters, so the authors' ES
        step sizes and U[0, 0.01) init keep their meaning. (Softplus would keep every parameter
        strictly positive, so the special cases would only be approached, and its slope
        sigmoid(theta) ~ scale near the init would shrink ES steps by ~100x.) Coordinates with
        theta < 0 are inactive (parameter 0); ES can move them back above 0.
        """
        t = _as_float64_vector(theta)
        if t.shape != (VECTOR_SIZE,):
            raise ValueError(f"theta must have {VECTOR_SIZE} entries, got shape {tuple(t.shape)}")
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).nonzero()[0])
            block, idx = _locate(bad)
            raise ValueError(f"theta has a non-finite entry in block {block!r} at index {idx}")
        return cls.from_vector(t.clamp_min(0.0))

    @classmethod
    def random(cls, scale: float = 0.01, seed: int = 42) -> NeuralMirrorMap:
        """All 380 parameters i.i.d. uniform on [0, scale), as NM-GRPO's init (GBMPO code).

        Draws ``torch.rand(380)`` (float32, then stored as float64) from a local
        ``torch.Generator`` seeded with ``seed``, in the vector layout order; the global torch
        RNG is neither used nor reseeded (the authors' code calls torch.manual_seed).
        """
        if not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed))
        draw = torch.rand(VECTOR_SIZE, generator=gen, dtype=torch.float32) * scale
        return cls.from_vector(draw.to(torch.float64))

    def tabulated(self, cells: int = TABLE_CELLS) -> TabulatedMirrorMap:
        """This map with D_h read from a float64 table of ``cells`` quintic cells in log y over
        [1e-10, e] (:class:`TabulatedMirrorMap`): ~30x cheaper, relative error <= 1e-6 of D_h
        and its gradient, measured at build in ``table_error`` (a table that misses it raises
        ValueError). Built once per map and ``cells`` (~1.5 s on one CPU thread). The
        ``neural_mirror`` regularizer's default evaluation (``evaluation: exact`` keeps this
        map)."""
        cache: dict[int, TabulatedMirrorMap] = self.__dict__.setdefault("_tabulated", {})
        if cells not in cache:  # built once per map and size (the build evaluates the map)
            # on one thread: with two, the build's float64 kernels split their work by the
            # threads' timing and 2 to 3 of 10 processes measured an error of 2.9e-3 at the
            # near pairs (one thread: 10 of 10 at 1.7e-8, the same table every time)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cache[cells] = TabulatedMirrorMap(self, cells)
            finally:
                torch.set_num_threads(threads)
        return cache[cells]

    # --- inspection / serialisation -------------------------------------------------------------
    def to_vector(self) -> Tensor:
        """The 380 parameters ``[v(126), w(126), b(126), a, c]`` as a new float64 tensor."""
        return self._vec.clone()

    def to_unconstrained(self) -> Tensor:
        """A theta with ``from_unconstrained(theta) == self``: the parameters themselves."""
        return self._vec.clone()

    @property
    def v(self) -> Tensor:
        return self._vec[:N_UNITS].clone()

    @property
    def w(self) -> Tensor:
        return self._vec[N_UNITS : 2 * N_UNITS].clone()

    @property
    def b(self) -> Tensor:
        return self._vec[2 * N_UNITS : 3 * N_UNITS].clone()

    @property
    def a(self) -> float:
        return float(self._vec[-2])

    @property
    def c(self) -> float:
        return float(self._vec[-1])

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write a JSON file ``{"format": "gbmpo.neural_mirror_map", "version": 1, ..., "vector":
        [380 floats]}``; floats are written with full float64 precision (exact round trip)."""
        path = Path(path)
        doc = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "layout": "[v(126), w(126), b(126), a, c]",
            "activations": list(ACTIVATIONS),
            "units_per_activation": UNITS_PER_ACTIVATION,
            "vector": [float(x) for x in self._vec.tolist()],
        }
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NeuralMirrorMap:
        """Read a file written by :meth:`save`, or a JSON list of 380 numbers (ES output)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"neural mirror map file not found: {path}")
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON neural mirror map file ({e})") from None
        if isinstance(doc, dict):
            if doc.get("format") != FILE_FORMAT or "vector" not in doc:
                raise ValueError(
                    f"{path}: expected a JSON object with format {FILE_FORMAT!r} and a 'vector'"
                )
            if doc.get("version") != FILE_VERSION:
                raise ValueError(f"{path}: unsupported version {doc.get('version')!r}")
            doc = doc["vector"]
        if not isinstance(doc, list):
            raise ValueError(f"{path}: expected a list of {VECTOR_SIZE} numbers")
        try:
            return cls.from_vector(doc)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def __repr__(self) -> str:
        return (
            f"NeuralMirrorMap(a={self.a:.4g}, c={self.c:.4g}, |v|_1={float(self.v.sum()):.4g}, "
            f"|w|_1={float(self.w.sum()):.4g}, |b|_1={float(self.b.sum()):.4g})"
        )

    # --- the potential --------------------------------------------------------------------------
    def _params(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
        key = (dtype, device)
        if key not in self._cache:
            vec = self._vec.to(device=device, dtype=dtype)
            blocks = vec[: 3 * N_UNITS].view(3, len(ACTIVATIONS), UNITS_PER_ACTIVATION)
            self._cache[key] = (blocks[0], blocks[1], blocks[2], vec[-2], vec[-1])
        return self._cache[key]

    def _positive(self, b: Tensor) -> tuple[bool, ...]:
        """Per block: every offset b_j > 0 *in b's dtype* (a float64 1e-300 is 0 in float32),
        so that u = w y + b > 0 for every y and the u = 0 case cannot occur."""
        key = (b.dtype, b.device)
        if key not in self._positive_cache:
            self._positive_cache[key] = tuple(
                bool((b[k] > 0).all()) for k in range(len(ACTIVATIONS))
            )
        return self._positive_cache[key]

    def _poly(self, dtype: torch.dtype, device: torch.device) -> tuple[float, float, float, float]:
        """The cube and square units as one cubic, h'_poly(y) = c3 y^3 + c2 y^2 + c1 y + c0:
        sum_j v_j (w_j y + b_j)^3 gives (v w^3, 3 v w^2 b, 3 v w b^2, v b^3) summed over the
        cube units, sum_j v_j (w_j y + b_j)^2 gives (0, v w^2, 2 v w b, v b^2) over the square
        ones; all >= 0. Computed once in float64."""
        if not hasattr(self, "_poly_coeffs"):
            blocks = self._vec[: 3 * N_UNITS].view(3, len(ACTIVATIONS), UNITS_PER_ACTIVATION)
            v, w, b = blocks[0], blocks[1], blocks[2]
            cube, square = ACTIVATIONS.index("cube"), ACTIVATIONS.index("square")
            c3 = float((v[cube] * w[cube] ** 3).sum())
            c2 = float(
                3.0 * (v[cube] * w[cube] ** 2 * b[cube]).sum() + (v[square] * w[square] ** 2).sum()
            )
            c1 = float(
                3.0 * (v[cube] * w[cube] * b[cube] ** 2).sum()
                + 2.0 * (v[square] * w[square] * b[square]).sum()
            )
            c0 = float((v[cube] * b[cube] ** 3).sum() + (v[square] * b[square] ** 2).sum())
            self._poly_coeffs = (c3, c2, c1, c0)
        return self._poly_coeffs  # type: ignore[no-any-return]

    def _prep(self, *ys: Tensor) -> tuple[Tensor, ...]:
        dt = compute_dtype(*ys)
        return tuple(y.to(dt).clamp_min(PROB_FLOOR) for y in ys)

    def potential(self, y: Tensor) -> Tensor:
        """h(y) = sum_j v_j int_0^y sigma_j(w_j s + b_j) ds + (a/2) y^2 + c (y log y - y).

        Elementwise, y floored at 1e-10. Each unit integral is y * mean of sigma_j over
        [b_j, b_j + w_j y], written without division by w_j (limit sigma(b_j) y at w_j = 0).
        """
        (y,) = self._prep(y)
        v, w, b, a, c = self._params(y.dtype, y.device)
        ye = y.unsqueeze(-1)
        out = 0.5 * a * y * y + c * (torch.xlogy(y, y) - y)
        for k, act in enumerate(ACTIVATIONS):
            if self._v_active[k]:
                mean = _MEAN[act](b[k], w[k] * ye)
                out = out + y * (v[k] * mean).sum(-1)
        return out

    def derivative(self, y: Tensor) -> Tensor:
        """h'(y) = sum_j v_j sigma_j(w_j y + b_j) + a y + c log y (the inverse link; y >= 1e-10)."""
        (y,) = self._prep(y)
        v, w, b, a, c = self._params(y.dtype, y.device)
        ye = y.unsqueeze(-1)
        out = a * y + c * torch.log(y)
        c3, c2, c1, c0 = self._poly(y.dtype, y.device)
        if c3 or c2 or c1 or c0:  # the cube and square units, as one cubic
            out = out + (((c3 * y + c2) * y + c1) * y + c0)
        for k, act in enumerate(ACTIVATIONS):
            if self._v_active[k] and act not in _POLY:
                out = out + (v[k] * _sigma(act, w[k] * ye + b[k])).sum(-1)
        return out

    def second_derivative(self, y: Tensor) -> Tensor:
        """h''(y) = sum_j v_j w_j sigma_j'(w_j y + b_j) + a + c / y  (>= 0; y >= 1e-10).

        Units with v_j w_j = 0 contribute 0 (also where sigma' is infinite at u = 0).
        """
        (y,) = self._prep(y)
        v, w, b, a, c = self._params(y.dtype, y.device)
        ye = y.unsqueeze(-1)
        out = a + c / y
        c3, c2, c1, _ = self._poly(y.dtype, y.device)
        if c3 or c2 or c1:  # the cube and square units: h''_poly = 3 c3 y^2 + 2 c2 y + c1
            out = out + ((3.0 * c3 * y + 2.0 * c2) * y + c1)
        for k, act in enumerate(ACTIVATIONS):
            if not self._active[k] or act in _POLY:
                continue
            vw = v[k] * w[k]
            term = torch.where(vw != 0, vw * _dsigma(act, w[k] * ye + b[k]), 0.0)
            out = out + term.sum(-1)
        return out

    def bregman(self, p: Tensor, q: Tensor) -> Tensor:
        """D_h(p, q) = h(p) - h(q) - h'(q)(p - q), elementwise (broadcast), p, q floored at 1e-10.

        GBMPO neural mirror regularizer (docs/methods.md, section "Neural mirror map"):
        sum_j v_j [H_j(p) - H_j(q) - sigma_j(w_j q + b_j)(p - q)] + (a/2)(p - q)^2
        + c [p log(p/q) - p + q], evaluated as (p - q)^2 [sum_j v_j w_j K_j + a/2 + c K_gkl]
        with every K >= 0 (see the module docstring), so the result is >= 0 and 0 at p = q.
        Vectorised over the 21 units of each activation block. Gradients are analytic (a custom
        autograd function, nothing but p and q is saved): d D / d p = h'(p) - h'(q) and
        d D / d q = -h''(q) (p - q).
        """
        p, q = self._prep(p, q)
        p, q = torch.broadcast_tensors(p, q)
        if torch.is_grad_enabled() and (p.requires_grad or q.requires_grad):
            out: Tensor = _MirrorBregman.apply(self, p, q)
            return out
        return self._bregman_value(p, q)

    def bregman_log(self, logp: Tensor, anchor_logp: Tensor) -> Tensor:
        """D_h(exp(logp), exp(anchor_logp)): the regularizer's entry point (log-probabilities in).
        The exact map exponentiates and calls :meth:`bregman`; the tabulated map reads its
        table at the log-probabilities directly."""
        return self.bregman(torch.exp(logp), torch.exp(anchor_logp))

    def _bregman_value(self, p: Tensor, q: Tensor) -> Tensor:
        """D_h on floored, broadcast, same-dtype p and q (no autograd bookkeeping needed)."""
        return self._bregman_and_grad(p, q, want_grad=False)[0]

    def _bregman_and_grad(
        self, p: Tensor, q: Tensor, want_grad: bool
    ) -> tuple[Tensor, Tensor | None]:
        """D_h(p, q) and, with ``want_grad``, its derivative in p, h'(p) - h'(q), from the same
        per-unit quantities (the roots, exp(u_q), phi(d) of each unit serve both): the backward
        then needs no second pass over the 126 units.

        The cube and square units enter as one cubic (:meth:`_poly`): with d = p - q, their
        D is d^2 [c3 ((d/2 + q)^2 + q^2/2) + c2 (2 q + p)/3 + c1/2] (every term >= 0, the sum
        of the per-unit factorised forms) and their h'(p) - h'(q) is
        d [c3 (p^2 + p q + q^2) + c2 (p + q) + c1]."""
        v, w, b, a, c = self._params(p.dtype, p.device)
        pe, qe = p.unsqueeze(-1), q.unsqueeze(-1)
        diff = pe - qe
        d = p - q
        k_total = torch.zeros_like(p) + 0.5 * a
        grad = a * d if want_grad else None
        positive = self._positive(b)
        c3, c2, c1, _ = self._poly(p.dtype, p.device)
        if c3 or c2 or c1:
            k_total = k_total + (c3 * ((0.5 * d + q).square() + 0.5 * q * q)
                                 + c2 * (2.0 * q + p) / 3.0 + 0.5 * c1)  # fmt: skip
            if grad is not None:
                grad = grad + d * (c3 * (p * p + p * q + q * q) + c2 * (p + q) + c1)
        for k, act in enumerate(ACTIVATIONS):
            if act in _POLY or not (self._active[k] or (want_grad and self._v_active[k])):
                continue
            uq = w[k] * qe + b[k]
            up = w[k] * pe + b[k]
            curv, dsig = _CURV_DIFF[act](up, uq, w[k] * diff, positive[k])
            if self._active[k]:
                k_total = k_total + (v[k] * w[k] * curv).sum(-1)
            if grad is not None:
                grad = grad + (v[k] * dsig).sum(-1)
        if self.c != 0.0:
            k_total = k_total + c * _gkl_over_sq(p, q)
            if grad is not None:
                grad = grad + c * (torch.log(p) - torch.log(q))
        return d.square() * k_total, grad


class TabulatedMirrorMap(NeuralMirrorMap):
    """A :class:`NeuralMirrorMap` whose h, h', h'' and D_h are read from a float64 quintic
    table in log y (:class:`~gbmpo.objectives.mirror_table.MirrorTable`): relative error
    <= 1e-6 of D_h and its gradient, measured at build (``table_error``). Built by
    :meth:`NeuralMirrorMap.tabulated`; ``evaluation: table`` (the default) selects it."""

    def __init__(self, mirror: NeuralMirrorMap, cells: int = TABLE_CELLS) -> None:
        if not isinstance(mirror, NeuralMirrorMap):
            raise TypeError(
                "TabulatedMirrorMap is built from a map: use NeuralMirrorMap.<constructor>(...)"
                f".tabulated(), not TabulatedMirrorMap constructors (got {type(mirror).__name__})"
            )
        vec = mirror.to_vector()
        n = N_UNITS
        super().__init__(vec[:n], vec[n : 2 * n], vec[2 * n : 3 * n], float(vec[-2]),
                         float(vec[-1]))  # fmt: skip
        self._lookup = MirrorTable(NeuralMirrorMap.from_vector(vec), cells)
        self.cells = cells
        self.table_error = self._lookup.table_error

    @classmethod
    def from_vector(cls, phi: Tensor | Sequence[float]) -> NeuralMirrorMap:
        """Not for a table: build the map, then call ``.tabulated()`` on it."""
        raise TypeError(
            "TabulatedMirrorMap is built from a map: use NeuralMirrorMap.<constructor>(...)"
            ".tabulated()"
        )

    def potential(self, y: Tensor) -> Tensor:
        return self._lookup.potential(y)

    def derivative(self, y: Tensor) -> Tensor:
        return self._lookup.derivative(y)

    def second_derivative(self, y: Tensor) -> Tensor:
        return self._lookup.second_derivative(y)

    def bregman(self, p: Tensor, q: Tensor) -> Tensor:
        return self._lookup.bregman(p, q)

    def bregman_log(self, logp: Tensor, anchor_logp: Tensor) -> Tensor:
        return self._lookup.bregman_log(logp, anchor_logp)

    def tabulated(self, cells: int = TABLE_CELLS) -> TabulatedMirrorMap:
        return self if cells == self.cells else TabulatedMirrorMap(self, cells)

    def __repr__(self) -> str:
        return f"Tabulated{super().__repr__()[:-1]}, cells={self.cells})"


class _MirrorBregman(torch.autograd.Function):
    """D_h(p, q) with the analytic gradients h'(p) - h'(q) (in p) and -h''(q)(p - q) (in q).
    Kept for memory: autograd would save the 126 units' [B, T, 21] intermediates; this saves
    p and q (tests/objectives/test_mirror.py gradchecks it in float64)."""

    @staticmethod
    def forward(ctx: Any, mirror: NeuralMirrorMap, p: Tensor, q: Tensor) -> Tensor:
        ctx.mirror = mirror
        value, dp = mirror._bregman_and_grad(p, q, want_grad=ctx.needs_input_grad[1])
        ctx.save_for_backward(p, q, dp if dp is not None else torch.empty(0))
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None, Tensor | None]:
        p, q, dp = ctx.saved_tensors
        m: NeuralMirrorMap = ctx.mirror
        grad_p = grad_q = None
        if ctx.needs_input_grad[1]:
            grad_p = grad * dp  # h'(p) - h'(q), formed in the forward pass
        if ctx.needs_input_grad[2]:
            grad_q = -grad * m.second_derivative(q) * (p - q)
        return None, grad_p, grad_q


def _locate(i: int) -> tuple[str, int]:
    """Block name and index inside the block for position i of the 380-vector."""
    if i < 3 * N_UNITS:
        return _BLOCKS[i // N_UNITS], i % N_UNITS
    return ("a", 0) if i == 3 * N_UNITS else ("c", 0)


def _check_vector(vec: Tensor) -> None:
    bad_finite = ~torch.isfinite(vec)
    if bad_finite.any():
        i = int(bad_finite.nonzero()[0])
        block, idx = _locate(i)
        raise ValueError(
            f"neural mirror map parameter {block}[{idx}] is not finite ({float(vec[i])!r})"
        )
    neg = vec < 0
    if neg.any():
        i = int(neg.nonzero()[0])
        block, idx = _locate(i)
        where = f"{block}[{idx}]" if block in _BLOCKS else block
        raise ValueError(
            f"neural mirror map parameter {where} (block {block!r}, index {idx}) is negative "
            f"({float(vec[i]):.6g}); negative entries in total: {int(neg.sum())}. "
            "v, w, b, a, c must all be >= 0 for a convex potential (a negative entry "
            "can make the Bregman divergence negative). Use NeuralMirrorMap.from_unconstrained("
            "theta) to project an unconstrained vector onto the feasible set explicitly."
        )


_DEFAULT_MAP: NeuralMirrorMap | None = None


def as_mirror_map(mirror: NeuralMirrorMap | str | os.PathLike[str] | None) -> NeuralMirrorMap:
    """Resolve a ``mirror`` option: a map is returned as is, a path is loaded with
    :meth:`NeuralMirrorMap.load`, and None gives ``NeuralMirrorMap.random(scale=0.01, seed=42)``
    (the NM-GRPO default init), one object per process: a map is immutable, and the tables
    built from it (:meth:`NeuralMirrorMap.tabulated`, the clip measure's interval tables) are
    cached per map object, so a fresh default map per call would rebuild them every call."""
    global _DEFAULT_MAP
    if mirror is None:
        if _DEFAULT_MAP is None:
            _DEFAULT_MAP = NeuralMirrorMap.random(scale=0.01, seed=42)
        return _DEFAULT_MAP
    if isinstance(mirror, NeuralMirrorMap):
        return mirror
    if isinstance(mirror, (str, os.PathLike)):
        return NeuralMirrorMap.load(mirror)
    raise TypeError(
        "mirror must be a NeuralMirrorMap, a path to a saved map, or None; "
        f"got {type(mirror).__name__}"
    )
