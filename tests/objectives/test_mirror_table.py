"""The explicit tabulated evaluation of a neural mirror map (``NeuralMirrorMap.tabulated``):
values and gradients against the exact float64 map within the error measured at build, the
Hermite pieces, autograd consistency, and that the exact map stays the default."""

from __future__ import annotations

import math

import pytest
import torch

from gbmpo.objectives import get_regularizer
from gbmpo.objectives.mirror import PROB_FLOOR, NeuralMirrorMap, as_mirror_map
from gbmpo.objectives.mirror_table import TabulatedMirrorMap, quintic_hermite_coeffs

F64 = torch.float64
MAPS = [(0.01, 42), (0.5, 3), (2.0, 1)]


def _pairs(n: int = 20_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """p over the whole [1e-10, 1] range (log-uniform) and q = p e^{noise}, capped at 1."""
    g = torch.Generator().manual_seed(seed)
    lp = -23.0 * torch.rand(n, generator=g, dtype=F64)
    lq = (lp + 0.5 * torch.randn(n, generator=g, dtype=F64)).clamp(math.log(PROB_FLOOR), 0.0)
    return lp.exp(), lq.exp()


def test_quintic_hermite_reproduces_a_quintic():
    c = torch.tensor([0.3, -1.2, 0.7, 2.0, -0.5, 0.25], dtype=F64)
    f = lambda s: sum(c[k] * s**k for k in range(6))  # noqa: E731
    d = lambda s: sum(k * c[k] * s ** (k - 1) for k in range(1, 6))  # noqa: E731
    e = lambda s: sum(k * (k - 1) * c[k] * s ** (k - 2) for k in range(2, 6))  # noqa: E731
    one, zero = torch.tensor(1.0, dtype=F64), torch.tensor(0.0, dtype=F64)
    got = quintic_hermite_coeffs(f(zero), f(one), d(zero), d(one), e(zero), e(one))
    torch.testing.assert_close(got, c, rtol=0, atol=1e-14)


@pytest.mark.parametrize(("scale", "seed"), MAPS)
def test_table_matches_the_exact_map_within_its_measured_error(scale, seed):
    exact = NeuralMirrorMap.random(scale=scale, seed=seed)
    tab = exact.tabulated()
    assert isinstance(tab, TabulatedMirrorMap) and not isinstance(exact, TabulatedMirrorMap)
    err = tab.table_error
    p, q = _pairs()
    d_exact, d_tab = exact.bregman(p, q), tab.bregman(p, q)
    # |D - D_h| <= 2 err_h + err_h' |p - q| + float64 rounding of the difference
    scale_h = exact.potential(p).abs() + exact.potential(q).abs()
    bound = 2 * err["h"] + err["dh"] * (p - q).abs() + 1e-15 * (scale_h + 1e-300)
    assert bool(((d_tab - d_exact).abs() <= bound).all())
    assert bool((d_tab >= 0).all())
    # the measured errors are small against the map's own scale
    assert err["h"] <= 1e-10 * float(scale_h.max())
    g_exact = exact.derivative(p) - exact.derivative(q)
    g_tab = tab.derivative(p) - tab.derivative(q)
    assert bool(((g_tab - g_exact).abs() <= 2 * err["dh"] + 1e-15 * g_exact.abs().max()).all())


@pytest.mark.parametrize(("scale", "seed"), MAPS)
def test_table_gradients_are_the_tabulated_derivatives(scale, seed):
    """Backward of the tabulated D: d/dp = H'(p) - H'(q), d/dq = -H''(q)(p - q), equal to the
    exact map's gradients within the measured error."""
    exact = NeuralMirrorMap.random(scale=scale, seed=seed)
    tab = exact.tabulated()
    p, q = _pairs(2000, seed=1)
    grads = []
    for m in (exact, tab):
        pp, qq = p.clone().requires_grad_(True), q.clone().requires_grad_(True)
        m.bregman(pp, qq).sum().backward()
        grads.append((pp.grad, qq.grad))
    (gp_e, gq_e), (gp_t, gq_t) = grads
    torch.testing.assert_close(gp_t, tab.derivative(p) - tab.derivative(q), rtol=0, atol=0)
    assert float((gp_t - gp_e).abs().max()) <= 2 * tab.table_error["dh"] + 1e-15 * float(
        gp_e.abs().max()
    )
    rel_q = (gq_t - gq_e).abs() / (gq_e.abs() + 1e-300)
    big = gq_e.abs() > 1e-12 * float(gq_e.abs().max())
    assert float(rel_q[big].max()) < 1e-6


def test_table_gradcheck():
    tab = NeuralMirrorMap.random(scale=0.5, seed=3).tabulated()
    p = torch.tensor([2e-3, 3e-2, 0.2, 0.4, 0.97], dtype=F64, requires_grad=True)
    q = torch.tensor([1e-3, 4e-2, 0.3, 0.35, 0.9], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tab.bregman(a, b), (p, q), eps=1e-7,
                                    atol=1e-7, rtol=1e-5)  # fmt: skip


def test_float32_inputs_and_the_regularizer():
    """float32 in, float32 out; the neural_mirror regularizer takes a tabulated map (explicit
    choice). On the benchmark's kind of batch its value and d/dlogp are at least as close to the
    exact float64 map as the exact map evaluated in float32 is (the float32 exact form's own
    rounding is the larger error here)."""
    exact = NeuralMirrorMap.random(scale=0.01, seed=42)
    tab = exact.tabulated()
    g = torch.Generator().manual_seed(5)
    logp = -torch.empty(64, 256).exponential_(2.0, generator=g)
    ref = logp + 0.2 * torch.randn(64, 256, generator=g)  # some ref "probabilities" above 1
    mask = torch.ones(64, 256)
    out = []
    for m, dtype in ((exact, F64), (exact, torch.float32), (tab, torch.float32)):
        reg = get_regularizer("neural_mirror", mirror=m)
        lp = logp.to(dtype).clone().requires_grad_(True)
        v = reg(logp=lp, ref_logp=ref.to(dtype), mask=mask)
        assert v.dtype == dtype
        v.sum().backward()
        out.append((v.detach().double(), lp.grad.double()))
    (v64, g64), (v32, g32), (vt, gt) = out
    for k, (ref64, f32, tab32) in enumerate(((v64, v32, vt), (g64, g32, gt))):
        err32 = float((f32 - ref64).abs().max())
        err_tab = float((tab32 - ref64).abs().max())
        assert err_tab <= err32 * 1.01 + 1e-30, (k, err_tab, err32)
        torch.testing.assert_close(tab32, ref64, rtol=1e-5, atol=1e-7 * float(ref64.abs().max()))


def test_beyond_the_grid_is_exact_and_nan_propagates():
    exact = NeuralMirrorMap.random(scale=0.5, seed=3)
    tab = exact.tabulated()
    y = torch.tensor([3.0, 10.0, 0.5], dtype=F64)
    torch.testing.assert_close(tab.derivative(y)[:2], exact.derivative(y)[:2], rtol=0, atol=0)
    torch.testing.assert_close(tab.potential(y)[:2], exact.potential(y)[:2], rtol=0, atol=0)
    v = tab.bregman(torch.tensor([float("nan"), 0.5], dtype=F64), torch.tensor([0.3, 0.4]))
    assert math.isnan(float(v[0])) and math.isfinite(float(v[1]))


def test_the_exact_map_stays_the_default():
    assert type(as_mirror_map(None)) is NeuralMirrorMap
    reg = get_regularizer("neural_mirror")
    assert type(reg.params["mirror"]) is NeuralMirrorMap
    with pytest.raises(ValueError, match="cells"):
        NeuralMirrorMap.random().tabulated(cells=4)


def test_constructors_name_the_way_to_build_a_table():
    with pytest.raises(TypeError, match=r"\.tabulated\(\)"):
        TabulatedMirrorMap.random()
    tab = NeuralMirrorMap.random().tabulated(cells=64)
    assert tab.tabulated(cells=64) is tab and tab.tabulated(cells=128).cells == 128
