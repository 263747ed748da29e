"""Every ES proposal is a convex mirror map: D_h(p, q) >= 0 (docs/methods.md, "Choices" item 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.meta.es import ESConfig, es_step, init_state
from gbmpo.objectives.mirror import VECTOR_SIZE, NeuralMirrorMap


def _pq(seed: int, n: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # probabilities over the whole range, including tiny ones and near-equal pairs
    p = torch.rand(n, generator=g, dtype=torch.float64) ** 4
    q = torch.where(
        torch.rand(n, generator=g, dtype=torch.float64) < 0.2,
        p * (1 + 1e-6 * torch.randn(n, generator=g, dtype=torch.float64)),
        torch.rand(n, generator=g, dtype=torch.float64),
    ).clamp(0, 1)
    return p, q


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sigma=st.sampled_from([0.01, 0.3, 2.0]))
def test_every_proposal_has_a_nonnegative_bregman_divergence(seed: int, sigma: float) -> None:
    cfg = ESConfig(population=6, sigma0=sigma, step_size=0.5, seed=seed)
    theta0 = NeuralMirrorMap.random(scale=0.01, seed=seed % 1000).to_unconstrained().numpy()
    state = init_state(theta0, cfg)
    p, q = _pq(seed)
    checked = 0
    negative_entries = 0

    def evaluate(thetas: list[np.ndarray]) -> list[float]:
        nonlocal checked, negative_entries
        out = []
        for theta in thetas:
            assert theta.shape == (VECTOR_SIZE,)
            negative_entries += int((theta < 0).sum())
            mirror = NeuralMirrorMap.from_unconstrained(theta)
            d = mirror.bregman(p, q)
            assert torch.isfinite(d).all()
            assert (d >= 0).all(), float(d.min())
            checked += 1
            out.append(float(-d.mean()))
        return out

    for _ in range(3):  # accepted steps move theta; proposals stay convex
        state = es_step(state, evaluate, cfg)
    assert checked >= 3 * (cfg.population - cfg.num_elites)
    # the search really leaves the feasible set in theta: the projection is doing the work
    assert negative_entries > 0
    # the exported map (current theta) is convex too
    d = NeuralMirrorMap.from_unconstrained(state.theta).bregman(p, q)
    assert (d >= 0).all()


def test_raw_perturbations_are_not_valid_mirror_maps() -> None:
    """What the authors' ES does (perturb the parameters themselves) is rejected by the map."""
    theta0 = NeuralMirrorMap.random(scale=0.01, seed=42).to_unconstrained().numpy()
    perturbed = theta0 + 0.01 * np.random.default_rng(0).standard_normal(VECTOR_SIZE)
    with pytest.raises(ValueError, match="negative"):
        NeuralMirrorMap.from_vector(perturbed)
    NeuralMirrorMap.from_unconstrained(perturbed)  # the projection accepts it
