"""The tabulated evaluation of a neural mirror map (``NeuralMirrorMap.tabulated``, the
``neural_mirror`` regularizer's ``evaluation: table``): D_h and its gradients against the exact
float64 map to a relative error of 1e-6 everywhere, p = q included, the Hermite pieces, autograd
consistency, the refusal of a table that misses the bound, and that the table is the
regularizer's default (the exact map where a table misses its bound)."""

from __future__ import annotations

import math

import pytest
import torch

from gbmpo.objectives import get_regularizer
from gbmpo.objectives.mirror import PROB_FLOOR, NeuralMirrorMap, TabulatedMirrorMap, as_mirror_map
from gbmpo.objectives.mirror_table import TABLE_RTOL, quintic_hermite_coeffs

F64 = torch.float64
MAPS = [(0.01, 42), (0.5, 3), (2.0, 1)]
#: log p - log q of the test pairs: next to p = q, around the near/far switch (Delta / 2 ~
#: 0.0059 for 2048 cells), and far apart
OFFSETS = [0.0, 1e-13, 1e-10, 1e-7, 1e-4, 3e-3, 5.8e-3, 5.9e-3, 6e-3, 1.2e-2, 0.05, 0.2, 1.0, 4.0,
           12.0]  # fmt: skip


def _pairs(n: int = 4000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 pairs (p, q) in [1e-10, 1]: q log-uniform, p = q e^{+-offset} rounded, for every
    offset in OFFSETS (both signs), and random log-normal ones."""
    g = torch.Generator().manual_seed(seed)
    lq = math.log(PROB_FLOOR) * torch.rand(n, generator=g, dtype=F64)
    offs = torch.tensor(OFFSETS, dtype=F64)
    offs = torch.cat([offs, -offs])
    lp = (lq[:, None] + offs[None, :]).reshape(-1)
    lq2 = lq[:, None].expand(-1, offs.numel()).reshape(-1)
    lr = math.log(PROB_FLOOR) * torch.rand(n, generator=g, dtype=F64)
    lp = torch.cat([lp, lr])
    lq2 = torch.cat([lq2, (lr + 0.5 * torch.randn(n, generator=g, dtype=F64))])
    keep = (lp >= math.log(PROB_FLOOR)) & (lp <= 0) & (lq2 >= math.log(PROB_FLOOR)) & (lq2 <= 0)
    return lp[keep].exp(), lq2[keep].exp()


def _rel(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> float:
    return float(((a - b).abs()[where] / b.abs()[where]).max())


def test_quintic_hermite_reproduces_a_quintic():
    c = torch.tensor([0.3, -1.2, 0.7, 2.0, -0.5, 0.25], dtype=F64)
    f = lambda s: sum(c[k] * s**k for k in range(6))  # noqa: E731
    d = lambda s: sum(k * c[k] * s ** (k - 1) for k in range(1, 6))  # noqa: E731
    e = lambda s: sum(k * (k - 1) * c[k] * s ** (k - 2) for k in range(2, 6))  # noqa: E731
    one, zero = torch.tensor(1.0, dtype=F64), torch.tensor(0.0, dtype=F64)
    got = quintic_hermite_coeffs(f(zero), f(one), d(zero), d(one), e(zero), e(one))
    torch.testing.assert_close(got, c, rtol=0, atol=1e-14)


@pytest.mark.parametrize(("scale", "seed"), MAPS)
def test_table_value_within_1e6_relative_everywhere(scale, seed):
    """|D_table - D_h| <= 1e-6 D_h for every pair, p next to q included (exact float64 map,
    factorised form, as the reference), D = 0 at p = q, D >= 0; the bound measured at build
    holds."""
    exact = NeuralMirrorMap.random(scale=scale, seed=seed)
    tab = exact.tabulated()
    assert isinstance(tab, TabulatedMirrorMap) and not isinstance(exact, TabulatedMirrorMap)
    assert tab.table_error["bregman_rel"] <= TABLE_RTOL
    assert tab.table_error["grad_rel"] <= TABLE_RTOL
    p, q = _pairs()
    d_exact, d_tab = exact.bregman(p, q), tab.bregman(p, q)
    assert bool((d_tab >= 0).all())
    assert bool((d_tab[p == q] == 0).all()) and bool((p == q).any())
    pos = d_exact > 0
    assert _rel(d_tab, d_exact, pos) <= TABLE_RTOL
    assert bool((d_tab[~pos] == 0).all())


@pytest.mark.parametrize(("scale", "seed"), MAPS)
def test_table_gradients_within_1e6_relative(scale, seed):
    """d D / d p and d D / d q of the tabulated map (analytic backward) against the exact map's
    (h'(p) - h'(q), -h''(q)(p - q)), relative 1e-6 where |log p - log q| >= 1e-6 (below it the
    exact float64 gradient itself loses digits: its unit differences see p and q rounded), and
    absolutely tiny next to p = q."""
    exact = NeuralMirrorMap.random(scale=scale, seed=seed)
    tab = exact.tabulated()
    p, q = _pairs(1500, seed=1)
    grads = []
    for m in (exact, tab):
        pp, qq = p.clone().requires_grad_(True), q.clone().requires_grad_(True)
        m.bregman(pp, qq).sum().backward()
        grads.append((pp.grad, qq.grad))
    (gp_e, gq_e), (gp_t, gq_t) = grads
    apart = (torch.log(p) - torch.log(q)).abs() >= 1e-6
    assert _rel(gp_t, gp_e, apart & (gp_e != 0)) <= TABLE_RTOL
    assert _rel(gq_t, gq_e, apart & (gq_e != 0)) <= TABLE_RTOL
    close = ~apart
    scale_p = float(p[close].max() * exact.second_derivative(p[close]).max())
    assert float((gp_t - gp_e)[close].abs().max()) <= 1e-6 * scale_p


@pytest.mark.parametrize(("scale", "seed"), MAPS[:2])
def test_log_entry_point_matches_and_differentiates(scale, seed):
    """``bregman_log`` (the regularizer's entry point) agrees with the exact map on
    log-probabilities, value and d/dlogp, d/dlogq, floored below log 1e-10 (gradient 0)."""
    exact = NeuralMirrorMap.random(scale=scale, seed=seed)
    tab = exact.tabulated()
    g = torch.Generator().manual_seed(3)
    lp = -torch.empty(3000, dtype=F64).exponential_(0.3, generator=g)
    lq = (lp + 0.3 * torch.randn(3000, generator=g, dtype=F64)).clamp_max(0.0)
    lp[:5] = -30.0  # below the floor
    out = []
    for m in (exact, tab):
        a, b = lp.clone().requires_grad_(True), lq.clone().requires_grad_(True)
        v = m.bregman_log(a, b)
        v.sum().backward()
        out.append((v.detach(), a.grad, b.grad))
    (v_e, ga_e, gb_e), (v_t, ga_t, gb_t) = out
    assert _rel(v_t, v_e, v_e > 0) <= TABLE_RTOL
    assert _rel(ga_t, ga_e, ga_e != 0) <= TABLE_RTOL
    assert _rel(gb_t, gb_e, gb_e != 0) <= TABLE_RTOL
    assert bool((ga_t[:5] == 0).all()) and bool((ga_e[:5] == 0).all())


def test_table_gradcheck():
    tab = NeuralMirrorMap.random(scale=0.5, seed=3).tabulated()
    p = torch.tensor([2e-3, 3e-2, 0.2, 0.4, 0.97, 0.5], dtype=F64, requires_grad=True)
    q = torch.tensor([1e-3, 4e-2, 0.3, 0.35, 0.9, 0.5 * (1 + 1e-3)], dtype=F64,
                     requires_grad=True)  # fmt: skip
    assert torch.autograd.gradcheck(lambda a, b: tab.bregman(a, b), (p, q), eps=1e-7,
                                    atol=1e-7, rtol=1e-5)  # fmt: skip
    lp, lq = p.detach().log().requires_grad_(True), q.detach().log().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: tab.bregman_log(a, b), (lp, lq), eps=1e-7,
                                    atol=1e-7, rtol=1e-5)  # fmt: skip


def test_regularizer_evaluation_key():
    """``evaluation: table`` (the default) builds the tabulated map (float32 in, float32 out,
    close to the exact float64 map); ``exact`` keeps the map; anything else is refused by
    name. The fused value-and-gradient path (float mask) agrees with autograd through
    ``bregman_log``."""
    exact = NeuralMirrorMap.random(scale=0.01, seed=42)
    g = torch.Generator().manual_seed(5)
    logp = -torch.empty(64, 256).exponential_(2.0, generator=g)
    ref = logp + 0.2 * torch.randn(64, 256, generator=g)  # some ref "probabilities" above 1
    mask = torch.ones(64, 256)
    mask[3, 100:] = 0.0
    reg_t = get_regularizer("neural_mirror", mirror=exact, evaluation="table")
    assert isinstance(reg_t.params["mirror"], TabulatedMirrorMap)
    assert get_regularizer("neural_mirror", mirror=exact).params["mirror"] is exact.tabulated()
    assert isinstance(get_regularizer("neural_mirror").params["mirror"], TabulatedMirrorMap)
    reg_e = get_regularizer("neural_mirror", mirror=exact, evaluation="exact")
    assert type(reg_e.params["mirror"]) is NeuralMirrorMap
    out = []
    for reg, dtype in ((reg_e, F64), (reg_t, torch.float32)):
        lp = logp.to(dtype).clone().requires_grad_(True)
        v = reg(logp=lp, anchor_logp=ref.to(dtype), mask=mask)
        assert v.dtype == dtype
        v.sum().backward()
        out.append((v.detach().double(), lp.grad.double()))
        # autograd through the map's bregman_log gives the same value and gradient
        lp2 = logp.to(dtype).clone().requires_grad_(True)
        m = reg.params["mirror"]
        v2 = m.bregman_log(lp2, ref.to(dtype)) * mask.to(dtype)
        v2.sum().backward()
        torch.testing.assert_close(v2.detach(), v.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(lp2.grad, lp.grad, rtol=1e-6, atol=0)
    (v64, g64), (vt, gt) = out
    assert bool((vt[3, 100:] == 0).all()) and bool((gt[3, 100:] == 0).all())
    torch.testing.assert_close(vt, v64, rtol=2e-6, atol=1e-7 * float(v64.abs().max()))
    torch.testing.assert_close(gt, g64, rtol=2e-6, atol=1e-7 * float(g64.abs().max()))
    with pytest.raises(ValueError, match="evaluation must be 'exact' or 'table'"):
        get_regularizer("neural_mirror", evaluation="fast")


def test_default_falls_back_to_the_exact_map_where_the_table_misses(monkeypatch):
    """A map whose table misses the bound: the default evaluation warns and keeps the exact
    map; ``evaluation: table`` raises."""
    m = NeuralMirrorMap.random(scale=0.5, seed=3)
    monkeypatch.setattr(NeuralMirrorMap.tabulated, "__defaults__", (64,))
    with pytest.warns(UserWarning, match="misses its error bound"):
        reg = get_regularizer("neural_mirror", mirror=m)
    assert reg.params["mirror"] is m
    with pytest.raises(ValueError, match="misses its error bound"):
        get_regularizer("neural_mirror", mirror=m, evaluation="table")


def test_beyond_the_grid_is_exact_and_nan_propagates():
    exact = NeuralMirrorMap.random(scale=0.5, seed=3)
    tab = exact.tabulated()
    y = torch.tensor([3.0, 10.0], dtype=F64)
    torch.testing.assert_close(tab.derivative(y), exact.derivative(y), rtol=0, atol=0)
    torch.testing.assert_close(tab.potential(y), exact.potential(y), rtol=0, atol=0)
    q = torch.tensor([0.3, 0.4], dtype=F64)
    torch.testing.assert_close(tab.bregman(torch.tensor([3.0, 0.5], dtype=F64), q),
                               exact.bregman(torch.tensor([3.0, 0.5], dtype=F64), q))  # fmt: skip
    # mixed: only the elements beyond the grid take the exact map, gradients flow to both
    pm = torch.tensor([5.0, 0.5, 0.2], dtype=F64, requires_grad=True)
    qm = torch.tensor([0.3, 0.4, 4.0], dtype=F64)
    pe = pm.detach().clone().requires_grad_(True)
    vt, ve = tab.bregman(pm, qm), exact.bregman(pe, qm)
    torch.testing.assert_close(vt, ve, rtol=1e-6, atol=0)
    vt.sum().backward()
    ve.sum().backward()
    torch.testing.assert_close(pm.grad, pe.grad, rtol=1e-6, atol=0)
    lt = tab.bregman_log(pm.detach().log(), qm.log())
    torch.testing.assert_close(lt, ve.detach(), rtol=1e-6, atol=0)
    v = tab.bregman(torch.tensor([float("nan"), 0.5], dtype=F64), q)
    assert math.isnan(float(v[0])) and math.isfinite(float(v[1]))


def test_potential_and_derivatives_match_the_exact_map():
    exact = NeuralMirrorMap.random(scale=0.5, seed=3)
    tab = exact.tabulated()
    y = torch.logspace(-10, 0, 500, dtype=F64)
    torch.testing.assert_close(tab.potential(y), exact.potential(y), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(tab.derivative(y), exact.derivative(y), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(tab.second_derivative(y), exact.second_derivative(y), rtol=1e-6,
                               atol=0)  # fmt: skip


def test_a_table_that_misses_the_bound_is_refused():
    with pytest.raises(ValueError, match="misses its error bound"):
        NeuralMirrorMap.random(scale=0.5, seed=3).tabulated(cells=64)
    with pytest.raises(ValueError, match="cells"):
        NeuralMirrorMap.random().tabulated(cells=4)


def test_the_default_map_is_one_object_and_tables_are_cached():
    assert type(as_mirror_map(None)) is NeuralMirrorMap
    # one default map per process: its tables (here and the clip measure's) are built once
    assert as_mirror_map(None) is as_mirror_map(None)
    m = NeuralMirrorMap.random()
    assert m.tabulated() is m.tabulated()


def test_constructors_name_the_way_to_build_a_table():
    with pytest.raises(TypeError, match=r"\.tabulated\(\)"):
        TabulatedMirrorMap.random()
    tab = NeuralMirrorMap.random().tabulated(cells=1024)
    assert tab.tabulated(cells=1024) is tab and tab.tabulated(cells=2048).cells == 2048


def _value_and_grad(m: NeuralMirrorMap, lp: torch.Tensor, lq: torch.Tensor):
    """D_h(log p, log q) and its derivative in log p, by autograd."""
    a = lp.clone().requires_grad_(True)
    value = m.bregman_log(a, lq)
    (grad,) = torch.autograd.grad(value.sum(), a)
    return value.detach(), grad


@pytest.mark.parametrize("pattern", ["trailing", "scattered", "none", "few"])
def test_p_equal_q_elements_are_skipped_exactly(pattern):
    """``bregman_log`` and its gradients on float32 log-probs where
    many elements have p = q (padding set to 0, a policy at its reference): those read D = 0
    and zero derivatives, the others exactly what they read without them (the p = q elements
    are skipped, not approximated), near p = q included, whatever the pattern; and within
    1e-6 of the exact map."""
    exact = NeuralMirrorMap.random(scale=0.01, seed=42)
    tab = exact.tabulated()
    g = torch.Generator().manual_seed(11)
    b, t = 16, 512
    lp = -torch.empty(b, t).exponential_(2.0, generator=g)
    off = torch.cat([3e-3 * torch.randn(b, t // 4, generator=g),  # near p = q
                     0.2 * torch.randn(b, t - t // 4, generator=g)], dim=1)  # fmt: skip
    lq = (lp + off[:, torch.randperm(t, generator=g)]).clamp_max(0.0)
    if pattern == "trailing":
        same = torch.arange(t)[None, :] >= torch.randint(t // 4, t, (b, 1), generator=g)
    elif pattern == "scattered":
        same = torch.rand(b, t, generator=g) < 0.4
    elif pattern == "few":  # below 1/16: evaluated with the others, not skipped
        same = torch.rand(b, t, generator=g) < 0.03
    else:
        same = torch.zeros(b, t, dtype=torch.bool)
    lq = torch.where(same, lp, lq)
    lp[same & (torch.rand(b, t, generator=g) < 0.5)] = 0.0  # padding: both 0
    lq = torch.where(same, lp, lq)
    moving = ~same
    value, grad = _value_and_grad(tab, lp, lq)
    alone_v, alone_g = _value_and_grad(tab, lp[moving], lq[moving])
    assert value.dtype == grad.dtype == torch.float32
    assert bool((value[same] == 0).all()) and bool((grad[same] == 0).all())
    assert torch.equal(value[moving], alone_v) and torch.equal(grad[moving], alone_g)
    r = lq.clone().requires_grad_(True)
    tab.bregman_log(lp, r).sum().backward()
    assert bool((r.grad[same] == 0).all())
    # mixed input dtypes: computed as float64, the same as float64 inputs (the gradient rounded
    # to the float32 log-probs' dtype)
    mixed, both = _value_and_grad(tab, lp, lq.double()), _value_and_grad(
        tab, lp.double(), lq.double()
    )
    assert mixed[0].dtype == torch.float64
    assert torch.equal(mixed[0], both[0]) and torch.equal(mixed[1], both[1].float())
    ve, ge = _value_and_grad(exact, lp.double(), lq.double())
    assert _rel(value.double(), ve, ve > 0) <= TABLE_RTOL + 1e-7  # + float32 rounding
    assert _rel(grad.double(), ge, (ge != 0) & ((lp - lq).abs() >= 1e-6)) <= TABLE_RTOL + 1e-7
