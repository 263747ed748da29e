"""NeuralMirrorMap: layout, convexity by construction, special cases, numerics, file format."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from gbmpo.objectives.mirror import (
    ACTIVATIONS,
    N_UNITS,
    UNITS_PER_ACTIVATION,
    VECTOR_SIZE,
    NeuralMirrorMap,
    as_mirror_map,
)
from gbmpo.objectives.mirror_kernels import _exp_phi, _gkl_over_sq, generalized_kl

mpmath = pytest.importorskip("mpmath")

F64 = torch.float64
PROBS = st.floats(1e-10, 1.0, allow_nan=False)
NONNEG_VEC = arrays(np.float64, VECTOR_SIZE, elements=st.floats(0.0, 3.0))
ANY_THETA = arrays(np.float64, VECTOR_SIZE, elements=st.floats(-5.0, 5.0))


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def _map(scale: float, seed: int) -> NeuralMirrorMap:
    return NeuralMirrorMap.random(scale=scale, seed=seed)


# --- independent reference: the authors' formula (primitives S(u)/w), in 50-digit mpmath ----------


def _mp_sigma(act: str, u):
    up = max(u, mpmath.mpf(0))
    return {
        "cube": lambda: u**3,
        "square": lambda: u**2,
        "sqrt": lambda: mpmath.sqrt(up),
        "cbrt": lambda: mpmath.cbrt(up),
        "log": lambda: mpmath.log(up + mpmath.mpf("1e-3")),
        "exp": lambda: mpmath.exp(u),
    }[act]()


def _mp_prim(act: str, u):
    up = max(u, mpmath.mpf(0))
    ue = up + mpmath.mpf("1e-3")
    return {
        "cube": lambda: u**4 / 4,
        "square": lambda: u**3 / 3,
        "sqrt": lambda: mpmath.mpf(2) / 3 * up**1.5,
        "cbrt": lambda: mpmath.mpf(3) / 4 * up ** (mpmath.mpf(4) / 3),
        "log": lambda: ue * mpmath.log(ue) - ue,
        "exp": lambda: mpmath.exp(u),
    }[act]()


def _mp_bregman(vec: torch.Tensor, p: float, q: float) -> float:
    with mpmath.workdps(50):
        x = [mpmath.mpf(float(t)) for t in vec.tolist()]
        v, w, b, a, c = x[:126], x[126:252], x[252:378], x[378], x[379]
        P, Q = mpmath.mpf(p), mpmath.mpf(q)
        total = a / 2 * (P - Q) ** 2 + c * (P * mpmath.log(P / Q) - P + Q)
        for j in range(N_UNITS):
            if v[j] == 0 or w[j] == 0:
                continue  # a unit with w = 0 is linear in y: no Bregman contribution
            act = ACTIVATIONS[j // UNITS_PER_ACTIVATION]
            up, uq = w[j] * P + b[j], w[j] * Q + b[j]
            hp_hq = (_mp_prim(act, up) - _mp_prim(act, uq)) / w[j]
            total += v[j] * (hp_hq - _mp_sigma(act, uq) * (P - Q))
        return float(total)


# --- layout ---------------------------------------------------------------------------------------


def test_layout_round_trip_and_blocks() -> None:
    vec = torch.rand(VECTOR_SIZE, dtype=F64, generator=torch.Generator().manual_seed(0))
    m = NeuralMirrorMap.from_vector(vec)
    assert torch.equal(m.to_vector(), vec)
    assert torch.equal(m.v, vec[:126]) and torch.equal(m.w, vec[126:252])
    assert torch.equal(m.b, vec[252:378])
    assert (m.a, m.c) == (float(vec[378]), float(vec[379]))
    assert VECTOR_SIZE == 380 and len(ACTIVATIONS) * UNITS_PER_ACTIVATION == N_UNITS == 126


def _sigma_np(act: str, u: np.ndarray) -> np.ndarray:
    return {
        "cube": u**3,
        "square": u**2,
        "sqrt": np.sqrt(u),
        "cbrt": np.cbrt(u),
        "log": np.log(u + 1e-3),
        "exp": np.exp(u),
    }[act]


@pytest.mark.parametrize("unit", [0, 20, 21, 42, 63, 84, 105, 125])
def test_unit_order_is_cube_square_sqrt_cbrt_log_exp(unit: int) -> None:
    vec = torch.zeros(VECTOR_SIZE, dtype=F64)
    vec[unit], vec[126 + unit], vec[252 + unit] = 1.5, 0.7, 0.2
    m = NeuralMirrorMap.from_vector(vec)
    y = np.linspace(0.01, 1.0, 7)
    expected = 1.5 * _sigma_np(ACTIVATIONS[unit // 21], 0.7 * y + 0.2)
    np.testing.assert_allclose(m.derivative(torch.tensor(y)).numpy(), expected, rtol=1e-13)


@pytest.mark.parametrize(
    ("pos", "block", "idx"),
    [(5, "v", 5), (126 + 100, "w", 100), (252, "b", 0), (377, "b", 125), (378, "a", 0),
     (379, "c", 0)],
)
def test_negative_entries_rejected_naming_block_and_index(pos: int, block: str, idx: int) -> None:
    vec = torch.full((VECTOR_SIZE,), 0.01, dtype=F64)
    vec[pos] = -1e-6
    with pytest.raises(ValueError, match=rf"block '{block}', index {idx}\)") as ei:
        NeuralMirrorMap.from_vector(vec)
    assert "from_unconstrained" in str(ei.value)


def test_bad_vectors_rejected() -> None:
    with pytest.raises(ValueError, match="shape"):
        NeuralMirrorMap.from_vector(torch.zeros(379))
    with pytest.raises(ValueError, match="shape"):
        NeuralMirrorMap.from_vector(torch.zeros(2, 190))
    vec = torch.zeros(VECTOR_SIZE)
    vec[130] = float("nan")
    with pytest.raises(ValueError, match=r"w\[4\] is not finite"):
        NeuralMirrorMap.from_vector(vec)
    with pytest.raises(ValueError, match="block 'v'"):
        NeuralMirrorMap(v=[-1.0] + [0.0] * 125)
    with pytest.raises(ValueError, match="non-finite"):
        NeuralMirrorMap.from_unconstrained(torch.full((VECTOR_SIZE,), float("inf")))


# --- random init ----------------------------------------------------------------------------------


def test_random_is_local_and_reproducible() -> None:
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    m1 = NeuralMirrorMap.random(scale=0.01, seed=42)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    m2 = NeuralMirrorMap.random(scale=0.01, seed=42)
    m3 = NeuralMirrorMap.random(scale=0.01, seed=43)
    v1 = m1.to_vector()
    assert torch.equal(v1, m2.to_vector()) and not torch.equal(v1, m3.to_vector())
    assert (v1 >= 0).all() and (v1 < 0.01).all() and v1.std() > 0.002
    zero = NeuralMirrorMap.random(scale=0.0).to_vector()
    assert torch.equal(zero, torch.zeros(VECTOR_SIZE, dtype=F64))
    with pytest.raises(ValueError, match="scale"):
        NeuralMirrorMap.random(scale=-0.1)
    assert torch.equal(as_mirror_map(None).to_vector(), v1)
    with pytest.raises(TypeError, match="mirror must be"):
        as_mirror_map(3)  # type: ignore[arg-type]


# --- special cases and exact values ---------------------------------------------------------------

GRID = torch.tensor([1e-10, 1e-7, 1e-3, 0.05, 0.3, 0.5, 0.9, 0.999, 1.0], dtype=F64)
P_GRID, Q_GRID = torch.meshgrid(GRID, GRID, indexing="ij")


def test_special_case_prob_l2_exact() -> None:
    m = NeuralMirrorMap(a=2.0)
    assert torch.equal(m.bregman(P_GRID, Q_GRID), (P_GRID - Q_GRID) ** 2)


def test_special_case_generalized_kl() -> None:
    m = NeuralMirrorMap(c=1.0)
    got = m.bregman(P_GRID, Q_GRID)
    for i in range(len(GRID)):
        for j in range(len(GRID)):
            p, q = float(GRID[i]), float(GRID[j])
            with mpmath.workdps(40):
                P, Q = mpmath.mpf(p), mpmath.mpf(q)
                ref = float(P * mpmath.log(P / Q) - P + Q)
            assert got[i, j].item() == pytest.approx(ref, rel=1e-12, abs=1e-300)
    assert torch.equal(got.diagonal(), torch.zeros(len(GRID), dtype=F64))


@pytest.mark.parametrize(("scale", "seed"), [(0.01, 42), (1.0, 1), (3.0, 2)])
def test_bregman_matches_authors_formula_in_high_precision(scale: float, seed: int) -> None:
    m = _map(scale, seed)
    vec = m.to_vector()
    pairs = [(0.9, 0.5), (0.99, 0.9), (1e-10, 1.0), (1.0, 1e-10), (0.3, 0.30001), (0.2, 0.7)]
    got = m.bregman(_t(*[p for p, _ in pairs]), _t(*[q for _, q in pairs]))
    for k, (p, q) in enumerate(pairs):
        assert got[k].item() == pytest.approx(_mp_bregman(vec, p, q), rel=1e-11, abs=1e-300)


def _mp_bregman_integral(vec: torch.Tensor, p: float, q: float) -> float:
    """D_h(p, q) = int_q^p (h'(s) - h'(q)) ds by mpmath quadrature of the inverse link h' alone
    (no primitives, no closed forms: independent of both the library and _mp_bregman)."""
    with mpmath.workdps(40):
        x = [mpmath.mpf(float(t)) for t in vec.tolist()]
        v, w, b, a, c = x[:126], x[126:252], x[252:378], x[378], x[379]

        def h_prime(y):
            total = a * y + c * mpmath.log(y)
            for j in range(N_UNITS):
                total += v[j] * _mp_sigma(ACTIVATIONS[j // UNITS_PER_ACTIVATION], w[j] * y + b[j])
            return total

        P, Q = mpmath.mpf(p), mpmath.mpf(q)
        hq = h_prime(Q)
        return float(mpmath.quad(lambda s: h_prime(s) - hq, [Q, P]))


def test_scale_sanity_numbers_at_the_documented_seed() -> None:
    # docs/methods.md, section "Neural mirror map": NM-GRPO's init, every parameter U[0, 0.01) at
    # seed 42. The estimate in docs/methods.md (D_h(0.9, 0.5) ~ 7.9e-3, D_h(0.99, 0.9) ~ 3.3e-4)
    # came from a different draw; ours gives 5.96e-3 and 2.55e-4, far below ProbL2 (0.16) and the
    # generalized KL (0.129). Checked to 1e-12 against mpmath quadrature of
    # int_q^p (h'(s) - h'(q)) ds.
    m = _map(0.01, 42)
    d = m.bregman(_t(0.9, 0.99), _t(0.5, 0.9))
    vec = m.to_vector()
    for k, (p, q) in enumerate([(0.9, 0.5), (0.99, 0.9)]):
        assert d[k].item() == pytest.approx(_mp_bregman_integral(vec, p, q), rel=1e-12, abs=0)
    assert round(d[0].item(), 5) == 5.96e-3 and round(d[1].item(), 6) == 2.55e-4
    d32 = m.bregman(_t(0.9, 0.99).float(), _t(0.5, 0.9).float())
    torch.testing.assert_close(d32.double(), d, rtol=1e-5, atol=0)


def test_w_to_zero_limit_is_continuous() -> None:
    y = torch.tensor([1e-10, 0.2, 0.7, 1.0], dtype=F64)
    base = torch.full((VECTOR_SIZE,), 0.0, dtype=F64)
    base[:126] = 0.5
    base[252:378] = 0.3
    m0 = NeuralMirrorMap.from_vector(base)  # w = 0: every unit is sigma(b) * y
    for w in (1e-300, 1e-13, 1e-9):
        vec = base.clone()
        vec[126:252] = w
        mw = NeuralMirrorMap.from_vector(vec)
        torch.testing.assert_close(mw.potential(y), m0.potential(y), rtol=1e-8, atol=0)
        torch.testing.assert_close(mw.derivative(y), m0.derivative(y), rtol=1e-8, atol=0)
        assert (mw.bregman(y, y.flip(0)) >= 0).all()
        assert mw.bregman(y, y.flip(0)).max() <= 100 * w
    sig_b = {"cube": 0.3**3, "square": 0.3**2, "sqrt": 0.3**0.5, "cbrt": 0.3 ** (1 / 3),
             "log": math.log(0.3 + 1e-3), "exp": math.exp(0.3)}
    expected = 0.5 * 21 * sum(sig_b.values()) * y
    torch.testing.assert_close(m0.potential(y), expected, rtol=1e-13, atol=0)
    assert torch.equal(m0.bregman(y, y.flip(0)), torch.zeros(4, dtype=F64))


# --- consistency of h, h', h'', D_h ---------------------------------------------------------------


@pytest.mark.parametrize(("scale", "seed"), [(0.01, 42), (1.0, 3), (2.5, 4)])
def test_derivatives_match_autograd(scale: float, seed: int) -> None:
    m = _map(scale, seed)
    y = torch.linspace(1e-4, 1.0, 41, dtype=F64, requires_grad=True)
    (dh,) = torch.autograd.grad(m.potential(y).sum(), y)
    torch.testing.assert_close(dh, m.derivative(y).detach(), rtol=1e-9, atol=1e-12)
    (d2h,) = torch.autograd.grad(m.derivative(y).sum(), y)
    torch.testing.assert_close(d2h, m.second_derivative(y).detach(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("scale", "seed"), [(0.01, 42), (1.0, 5)])
def test_bregman_equals_definition_and_its_gradients(scale: float, seed: int) -> None:
    m = _map(scale, seed)
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(200, dtype=F64, generator=g).clamp_min(1e-6)
    q = torch.rand(200, dtype=F64, generator=g).clamp_min(1e-6)
    h_p, h_q, dh_q = m.potential(p), m.potential(q), m.derivative(q)
    definition = h_p - h_q - dh_q * (p - q)
    scale_terms = h_p.abs() + h_q.abs() + (dh_q * (p - q)).abs()
    assert ((m.bregman(p, q) - definition).abs() <= 1e-12 * scale_terms + 1e-300).all()
    pp, qq = p.clone().requires_grad_(), q.clone().requires_grad_()
    gp, gq = torch.autograd.grad(m.bregman(pp, qq).sum(), (pp, qq))
    torch.testing.assert_close(gp, m.derivative(p) - m.derivative(q), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gq, -m.second_derivative(q) * (p - q), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("scale", "seed"), [(0.01, 42), (1.0, 5), (3.0, 2)])
def test_analytic_gradients_match_autograd_of_the_definition(scale: float, seed: int) -> None:
    """The custom backward (h'(p) - h'(q) in p, -h''(q)(p - q) in q) against plain autograd of
    h(p) - h(q) - h'(q)(p - q) built from the potential and inverse link (float64), and the
    regularizer's d/dlogp = (h'(p) - h'(q)) p against autograd through exp."""
    m = _map(scale, seed)
    g = torch.Generator().manual_seed(seed)
    p0 = torch.rand(300, dtype=F64, generator=g).clamp_min(1e-6)
    q0 = torch.rand(300, dtype=F64, generator=g).clamp_min(1e-6)
    p, q = p0.clone().requires_grad_(), q0.clone().requires_grad_()
    gp, gq = torch.autograd.grad(m.bregman(p, q).sum(), (p, q))
    pa, qa = p0.clone().requires_grad_(), q0.clone().requires_grad_()
    definition = m.potential(pa) - m.potential(qa) - m.derivative(qa) * (pa - qa)
    gpa, gqa = torch.autograd.grad(definition.sum(), (pa, qa))
    # autograd's terms are O(|h'|); allow rounding relative to that scale
    scale_p = m.derivative(p0).abs() + m.derivative(q0).abs()
    assert ((gp - gpa).abs() <= 1e-12 * scale_p + 1e-15).all()
    scale_q = (m.second_derivative(q0) * (p0 - q0)).abs() + m.derivative(q0).abs()
    assert ((gq - gqa).abs() <= 1e-12 * scale_q + 1e-15).all()
    # through the selected-token regularizer
    from gbmpo.objectives.regularizers import get_regularizer

    logp = p0.log().clone().requires_grad_()
    (gl,) = torch.autograd.grad(
        get_regularizer("neural_mirror", mirror=m, evaluation="exact")(
            logp=logp, anchor_logp=q0.log()
        ).sum(),
        logp,
    )
    la = p0.log().clone().requires_grad_()
    pe, qe = la.exp(), q0.log().exp()
    (gla,) = torch.autograd.grad(
        (m.potential(pe) - m.potential(qe) - m.derivative(qe) * (pe - qe)).sum(), la)
    assert ((gl - gla).abs() <= 1e-12 * scale_p * p0 + 1e-15).all()


@pytest.mark.parametrize(("scale", "seed"), [(0.01, 42), (1.0, 3)])
def test_bregman_backward_passes_finite_difference_gradcheck(scale: float, seed: int) -> None:
    m = _map(scale, seed)
    g = torch.Generator().manual_seed(seed)
    p = (0.05 + 0.9 * torch.rand(8, dtype=F64, generator=g)).requires_grad_()
    q = (0.05 + 0.9 * torch.rand(8, dtype=F64, generator=g)).requires_grad_()
    assert torch.autograd.gradcheck(m.bregman, (p, q))


# --- convexity: properties over arbitrary parameters ----------------------------------------------


def _check_convex_map(m: NeuralMirrorMap, p: float, q: float) -> None:
    pt, qt = _t(p), _t(q)
    d = m.bregman(pt, qt).item()
    strong = 0.5 * m.a * (p - q) ** 2  # D_h >= (a/2)(p-q)^2 since every other term is >= 0
    assert d >= 0.0 and d >= strong * (1 - 1e-12)
    if strong > 0:  # strictly convex (a > 0) and p != q -> D > 0 (unless it underflows)
        assert d > 0.0
    assert m.bregman(pt, pt).item() == 0.0 and m.bregman(qt, qt).item() == 0.0
    y = torch.logspace(-10, 0, 60, dtype=F64)
    dh = m.derivative(y)
    assert (torch.diff(dh) >= -1e-12 * dh.abs().max()).all()  # h' non-decreasing
    assert (m.second_derivative(y) >= 0).all()
    d32 = m.bregman(pt.float(), qt.float())
    assert d32.dtype == torch.float32 and (d32 >= 0).all() and torch.isfinite(d32).all()


@settings(max_examples=30, deadline=None)
@given(vec=NONNEG_VEC, p=PROBS, q=PROBS)
def test_any_nonnegative_parameters_give_a_divergence(vec: np.ndarray, p: float, q: float) -> None:
    _check_convex_map(NeuralMirrorMap.from_vector(torch.from_numpy(vec)), p, q)


@settings(max_examples=30, deadline=None)
@given(theta=ANY_THETA, p=PROBS, q=PROBS)
def test_any_unconstrained_theta_gives_a_divergence(theta: np.ndarray, p: float, q: float) -> None:
    m = NeuralMirrorMap.from_unconstrained(torch.from_numpy(theta))
    assert torch.equal(m.to_vector(), torch.from_numpy(theta).clamp_min(0))
    _check_convex_map(m, p, q)


def test_unconstrained_round_trip_and_special_cases_reachable() -> None:
    m = _map(0.01, 42)
    assert torch.equal(NeuralMirrorMap.from_unconstrained(m.to_unconstrained()).to_vector(),
                       m.to_vector())
    theta = torch.full((VECTOR_SIZE,), -1.0, dtype=F64)
    theta[378] = 2.0  # v = w = b = 0, a = 2, c = 0 -> ProbL2 exactly
    assert torch.equal(NeuralMirrorMap.from_unconstrained(theta).bregman(P_GRID, Q_GRID),
                       (P_GRID - Q_GRID) ** 2)


def test_negative_parameters_would_break_convexity() -> None:
    # Why b >= 0 is required: v, w > 0 on a square unit with b < 0 has h'' < 0 for small y.
    vec = torch.zeros(VECTOR_SIZE, dtype=F64)
    vec[21], vec[126 + 21], vec[252 + 21] = 1.0, 1.0, -0.5
    with pytest.raises(ValueError, match="block 'b'"):
        NeuralMirrorMap.from_vector(vec)
    p, q = 0.1, 0.3  # the same formula with b = -0.5: u^3/3 Bregman in u-space, divided by w
    up, uq = p - 0.5, q - 0.5
    d = (up**3 / 3 - uq**3 / 3) - uq**2 * (up - uq)
    assert d < 0


# --- numerics -------------------------------------------------------------------------------------


@pytest.mark.parametrize("x", [0.0, 1e-12, -1e-8, 0.0999, -0.0999, 0.1001, -0.1001, 0.5, 3.0,
                               -0.9, -0.999999])
def test_series_and_closed_kernels_match_high_precision(x: float) -> None:
    with mpmath.workdps(50):
        X = mpmath.mpf(x)
        kappa = mpmath.mpf(1) / 2 if x == 0 else ((1 + X) * mpmath.log1p(X) - X) / X**2
        phi = mpmath.mpf(1) / 2 if x == 0 else (mpmath.expm1(X) - X) / X**2
    y = torch.tensor(0.7, dtype=F64)
    got_k = _gkl_over_sq(y * (1 + x), y).item() * 0.7
    assert got_k == pytest.approx(float(kappa), rel=1e-12)
    assert _exp_phi(torch.tensor(x, dtype=F64)).item() == pytest.approx(float(phi), rel=1e-13)


@settings(max_examples=40, deadline=None)
@given(p=PROBS, q=PROBS)
def test_generalized_kl_nonnegative_and_finite_gradients(p: float, q: float) -> None:
    for dt in (torch.float64, torch.float32):
        pt = torch.tensor(p, dtype=dt, requires_grad=True)
        qt = torch.tensor(q, dtype=dt)
        d = generalized_kl(pt.clamp_min(1e-10), qt.clamp_min(1e-10))
        assert d.item() >= 0 and math.isfinite(d.item())
        (g,) = torch.autograd.grad(d, pt)
        assert math.isfinite(g.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_finite_float32(dtype: torch.dtype) -> None:
    m = _map(1.0, 9)
    logp = torch.linspace(math.log(1e-10), 0.0, 50).to(dtype)
    p = logp.float().exp().to(dtype)
    q = p.flip(0)
    d = m.bregman(p, q)
    assert d.dtype == torch.float32 and torch.isfinite(d).all() and (d >= 0).all()
    assert m.potential(p).dtype == torch.float32 and torch.isfinite(m.derivative(p)).all()
    lp = logp.float().clone().requires_grad_()
    (g,) = torch.autograd.grad(m.bregman(lp.exp(), q).sum(), lp)
    assert torch.isfinite(g).all()


def test_float32_agrees_with_float64() -> None:
    # Same float32 inputs, float32 vs float64 arithmetic: the factorised form keeps the relative
    # error near float32 rounding (the textbook h(p) - h(q) - h'(q)(p - q) does not, and goes < 0).
    for scale, seed in [(0.01, 42), (1.0, 11), (3.0, 2)]:
        m = _map(scale, seed)
        p = torch.rand(1000, generator=torch.Generator().manual_seed(1)).clamp_min(1e-10)
        q = torch.rand(1000, generator=torch.Generator().manual_seed(2)).clamp_min(1e-10)
        d64 = m.bregman(p.double(), q.double())
        d32 = m.bregman(p, q)
        assert d64.dtype == F64 and d32.dtype == torch.float32
        torch.testing.assert_close(d32.double(), d64, rtol=5e-6, atol=0)


def test_broadcasting_shapes() -> None:
    m = _map(0.5, 1)
    p = torch.rand(4, 7, dtype=F64)
    q = torch.rand(7, dtype=F64)
    out = m.bregman(p, q)
    assert out.shape == (4, 7)
    torch.testing.assert_close(out[2], m.bregman(p[2], q))
    assert m.potential(p).shape == m.derivative(p).shape == m.second_derivative(p).shape == (4, 7)


# --- file format ----------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path) -> None:
    m = _map(0.37, 5)
    path = m.save(tmp_path / "map.json")
    doc = json.loads(path.read_text())
    assert doc["format"] == "gbmpo.neural_mirror_map" and len(doc["vector"]) == VECTOR_SIZE
    assert torch.equal(NeuralMirrorMap.load(path).to_vector(), m.to_vector())
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(m.to_vector().tolist()))
    assert torch.equal(NeuralMirrorMap.load(bare).to_vector(), m.to_vector())
    assert torch.equal(as_mirror_map(str(path)).to_vector(), m.to_vector())


def test_load_rejects_bad_files(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.json"):
        NeuralMirrorMap.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something", "vector": [0.0] * 380}))
    with pytest.raises(ValueError, match="format"):
        NeuralMirrorMap.load(bad)
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps([0.0] * 379 + [-1.0]))
    with pytest.raises(ValueError, match=r"neg.json: .*block 'c'"):
        NeuralMirrorMap.load(neg)
    junk = tmp_path / "junk.json"
    junk.write_text("not json")
    with pytest.raises(ValueError, match="not a JSON"):
        NeuralMirrorMap.load(junk)
