"""Separable convex potentials h for Bregman divergences D_h(p, q) = h(p) - h(q) - h'(q)(p - q).

A potential acts elementwise on probabilities; the full-vocabulary divergence of
:mod:`gbmpo.objectives.full_vocab` sums D_h over the vocabulary (docs/methods.md, section
"Sampled-token and full-vocabulary divergences"), the selected-token regularizers of
:mod:`gbmpo.objectives.regularizers` evaluate it on the sampled token only (GBMPO, arXiv
2602.04380). Registry :data:`POTENTIALS`; build with :func:`get_potential`:

=================  ============================  ==========================================
name               h(y)                          D_h(p, q)
=================  ============================  ==========================================
``neg_entropy``    y log y - y                   p log(p/q) - p + q (sums to KL(p||q))
``square``         y^2                           (p - q)^2 (GBMPO ProbL2)
``prob_l2``        alias of ``square``
``neural_mirror``  GBMPO neural mirror map       see :class:`NeuralMirrorMap`
=================  ============================  ==========================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from gbmpo.objectives.mirror import (
    PROB_FLOOR,
    NeuralMirrorMap,
    as_mirror_map,
)
from gbmpo.objectives.mirror_kernels import generalized_kl
from gbmpo.objectives.tensors import compute_dtype
from gbmpo.registry import Registry

__all__ = [
    "POTENTIALS",
    "NegEntropy",
    "Potential",
    "Square",
    "as_potential",
    "get_potential",
]


@runtime_checkable
class Potential(Protocol):
    """A separable potential: elementwise h, h' and a numerically safe Bregman divergence."""

    name: str

    def potential(self, y: Tensor) -> Tensor: ...

    def derivative(self, y: Tensor) -> Tensor: ...

    def bregman(self, p: Tensor, q: Tensor) -> Tensor: ...


class NegEntropy:
    """h(y) = y log y - y, h'(y) = log y; D_h(p, q) = p log(p/q) - p + q (generalized KL).

    Summed over a normalised distribution D_h is exactly KL(p || q) (the -p + q terms cancel);
    it is the geometry of natural policy gradient / KL-regularised GRPO (PMD-MM, arXiv
    2402.05187; docs/methods.md, sections "Neural mirror map" and "Sampled-token and
    full-vocabulary divergences"). Elementwise inputs are floored at 1e-10.
    """

    name = "neg_entropy"

    def potential(self, y: Tensor) -> Tensor:
        y = y.to(compute_dtype(y)).clamp_min(PROB_FLOOR)
        return torch.xlogy(y, y) - y

    def derivative(self, y: Tensor) -> Tensor:
        return torch.log(y.to(compute_dtype(y)).clamp_min(PROB_FLOOR))

    def bregman(self, p: Tensor, q: Tensor) -> Tensor:
        dt = compute_dtype(p, q)
        return generalized_kl(p.to(dt).clamp_min(PROB_FLOOR), q.to(dt).clamp_min(PROB_FLOOR))

    def __repr__(self) -> str:
        return "NegEntropy()"


class Square:
    """h(y) = y^2, h'(y) = 2 y; D_h(p, q) = (p - q)^2.

    GBMPO's ProbL2 regularizer ("L2 in probability space", arXiv 2602.04380; docs/methods.md,
    section "GBMPO regularizers"). No floor is needed (no logarithm).
    """

    name = "square"

    def potential(self, y: Tensor) -> Tensor:
        return y.to(compute_dtype(y)).square()

    def derivative(self, y: Tensor) -> Tensor:
        return 2.0 * y.to(compute_dtype(y))

    def bregman(self, p: Tensor, q: Tensor) -> Tensor:
        dt = compute_dtype(p, q)
        return (p.to(dt) - q.to(dt)).square()

    def __repr__(self) -> str:
        return "Square()"


POTENTIALS: Registry[Callable[..., Potential]] = Registry("potential")


@POTENTIALS.register("neg_entropy")
def _neg_entropy() -> Potential:
    return NegEntropy()


@POTENTIALS.register("square")
def _square() -> Potential:
    return Square()


@POTENTIALS.register("prob_l2")
def _prob_l2() -> Potential:
    return Square()


@POTENTIALS.register("neural_mirror")
def _neural_mirror(
    mirror: NeuralMirrorMap | str | os.PathLike[str] | None = None,
) -> Potential:
    """``mirror``: a NeuralMirrorMap, a path to a saved map, or None (random(0.01, seed=42))."""
    return as_mirror_map(mirror)


def get_potential(name: str, **params: Any) -> Potential:
    """Build the potential registered as ``name`` (see :data:`POTENTIALS`)."""
    return POTENTIALS.build(name, **params)  # type: ignore[no-any-return]


def as_potential(potential: str | Potential) -> Potential:
    """A potential object from a registry name or an object with potential/derivative/bregman."""
    if isinstance(potential, str):
        return get_potential(potential)
    if isinstance(potential, Potential):
        return potential
    raise TypeError(
        "potential must be a name from POTENTIALS "
        f"({', '.join(POTENTIALS.names())}) or an object with potential(), derivative() and "
        f"bregman(); got {type(potential).__name__}"
    )
