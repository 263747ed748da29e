"""Numerical safety of the objectives (docs/methods.md, section "Numerical safety"): extreme
log-ratios, -inf logits, empty masks, bf16 inputs. Every regularizer, surrogate, full-vocabulary
divergence and aggregation mode must give a finite value and a finite (never NaN) gradient, and the
safety measures must not change a single bit in the normal range."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.objectives import aggregate, get_surrogate
from gbmpo.objectives.full_vocab import (
    LOGIT_FLOOR,
    full_vocab_bregman,
    full_vocab_bregman_from_hidden,
)
from gbmpo.objectives.loss import LossTerm, compute_policy_loss
from gbmpo.objectives.mirror import NeuralMirrorMap
from gbmpo.objectives.regularizers import REGULARIZERS, exp_bound, get_regularizer

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
DTYPES = [F32, BF16, F64]
INF = float("inf")
EXP_FAMILY = ("kl_k3", "kl_k3_is", "rpg_rkl", "rpg_ufkl", "rpg_urkl")
CLAMPABLE = (*EXP_FAMILY, "rpg_fkl")
ALL_REGS = sorted(REGULARIZERS.names())
MIRROR = NeuralMirrorMap.random(scale=0.5, seed=3)


def _reg(name: str, clamp: float | None = None):
    if name == "neural_mirror":
        return get_regularizer(name, mirror=MIRROR)
    if name in CLAMPABLE:
        return get_regularizer(name, clamp=clamp)
    return get_regularizer(name)


def _value_and_grad(name, clamp, logp, ref, old, mask=None):
    lp = logp.clone().requires_grad_()
    v = _reg(name, clamp)(logp=lp, old_logp=old, anchor_logp=ref, mask=mask)
    if not v.requires_grad:  # "none"
        return v, torch.zeros_like(lp)
    (g,) = torch.autograd.grad(v.sum(), lp)
    return v.detach(), g


# --- the failures first reported: extreme log-ratios, -inf logits ------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clamp", [None, 10.0])
@pytest.mark.parametrize("name", EXP_FAMILY)
def test_issue_extreme_log_ratio_is_finite(name: str, clamp: float | None, dtype) -> None:
    # |log ratio| up to 1000 in both directions; every input is a valid log-prob (<= 0).
    # Before the fix: clamp=10 gave NaN gradients (inf * 0 in backward) from |log ratio| > 88.7
    # in float32, and no clamp gave inf values.
    logp = torch.tensor([[-1000.0, 0.0, -100.0, 0.0, -0.5, -89.0]], dtype=dtype)
    ref = torch.tensor([[0.0, -1000.0, 0.0, -100.0, -0.7, 0.0]], dtype=dtype)
    old = torch.tensor([[0.0, -1000.0, -1000.0, 0.0, -0.6, -89.0]], dtype=dtype)
    v, g = _value_and_grad(name, clamp, logp, ref, old)
    assert torch.isfinite(v).all(), v
    assert torch.isfinite(g).all(), g
    if clamp is not None and name != "kl_k3_is":  # kl_k3_is clamps k3, then weights it
        assert v.abs().max() <= clamp


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_region_has_zero_gradient_like_verl(dtype) -> None:
    # verl's low_var_kl: clip log rho to [-20, 20], exp, clamp the value to [-10, 10].
    t = torch.tensor([-1000.0, -30.0, -11.5, -3.0, 0.0, 2.0, 2.5, 30.0, 1000.0], dtype=F64)
    logp = torch.where(t > 0, -t, 0.0).to(dtype)  # log rho = ref - logp = t, both <= 0
    ref = torch.where(t > 0, 0.0, t).to(dtype)
    v, g = _value_and_grad("kl_k3", 10.0, logp[None], ref[None], None)
    kl = (ref.double() - logp.double()).clamp(-20, 20)
    verl = (kl.exp() - kl - 1).clamp(-10, 10)
    torch.testing.assert_close(v[0].double(), verl, rtol=1e-6, atol=1e-6)
    clamped = (torch.expm1(ref.double() - logp.double()) - (ref.double() - logp.double())) > 10
    assert (g[0][clamped] == 0).all() and (g[0][~clamped & (t != 0)] != 0).all()


@pytest.mark.parametrize("name", EXP_FAMILY)
def test_exact_in_the_normal_range(name: str) -> None:
    """Bit-for-bit the plain formulas (those before the fix) for |log ratio| <= 20, in float32
    and float64, values and gradients."""
    g = torch.Generator().manual_seed(0)
    for dt in (F32, F64):
        logp = -20.0 * torch.rand(4, 64, generator=g, dtype=F64)
        ref = -20.0 * torch.rand(4, 64, generator=g, dtype=F64)
        old = (logp + torch.randn(4, 64, generator=g, dtype=F64)).clamp_max(0.0)
        logp, ref, old = logp.to(dt), ref.to(dt), old.to(dt)
        lp = logp.clone().requires_grad_()
        t_rho, t_w = ref - lp, lp - ref
        plain = {
            "kl_k3": torch.expm1(t_rho) - t_rho,
            "kl_k3_is": torch.exp(lp - old) * (torch.expm1(t_rho) - t_rho),
            "rpg_rkl": torch.exp(t_w) * t_w,
            "rpg_ufkl": torch.expm1(t_w) - t_w,
            "rpg_urkl": torch.exp(t_w) * (t_w - 1.0) + 1.0,
        }[name]
        (g_plain,) = torch.autograd.grad(plain.sum(), lp)
        v, gr = _value_and_grad(name, None, logp, ref, old)
        assert torch.equal(v, plain.detach()), name
        assert torch.equal(gr, g_plain), name


def test_exp_bound_documented_values() -> None:
    assert exp_bound(F32) == pytest.approx(0.25 * math.log(torch.finfo(F32).max))
    assert exp_bound(BF16) == exp_bound(F32)
    assert exp_bound(F64) == pytest.approx(0.25 * math.log(torch.finfo(F64).max))
    assert 22 < exp_bound(F32) < 23 and 177 < exp_bound(F64) < 178


@pytest.mark.parametrize("dtype", [F32, F64])
def test_beyond_the_bound_the_value_continues_on_its_tangent(dtype) -> None:
    e = exp_bound(dtype)
    t = torch.tensor([e + 1.0, e + 500.0], dtype=dtype)
    logp = torch.zeros_like(t) - t  # log rho = t
    v, g = _value_and_grad("kl_k3", None, logp[None], torch.zeros_like(t)[None], None)
    k_e = math.expm1(e) - e
    expected = k_e + math.expm1(e) * (t.double() - e)
    torch.testing.assert_close(v[0].double(), expected, rtol=1e-5, atol=0)
    # d/dlogp = -(d k3/d log rho) = -(e^E - 1): constant beyond the bound
    torch.testing.assert_close(g[0].double(), torch.full((2,), -math.expm1(e), dtype=F64),
                               rtol=1e-5, atol=0)


# --- property tests over every regularizer ------------------------------------------------------

LOGPROB = st.floats(-1000.0, 0.0, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(LOGPROB, LOGPROB, LOGPROB), min_size=1, max_size=12),
    name=st.sampled_from(ALL_REGS),
    clamp=st.sampled_from([None, 10.0, 2.0]),
    dtype=st.sampled_from(DTYPES),
    mask_bits=st.integers(0, 2**12 - 1),
)
def test_every_regularizer_finite_over_extreme_log_ratios(rows, name, clamp, dtype, mask_bits):
    logp = torch.tensor([[r[0] for r in rows]], dtype=dtype)
    ref = torch.tensor([[r[1] for r in rows]], dtype=dtype)
    old = torch.tensor([[r[2] for r in rows]], dtype=dtype)
    mask = torch.tensor([[(mask_bits >> i) & 1 for i in range(len(rows))]], dtype=torch.bool)
    for m in (None, mask):
        v, g = _value_and_grad(name, clamp, logp, ref, old, m)
        assert v.dtype == (F64 if dtype == F64 else F32)
        assert torch.isfinite(v).all(), (name, v)
        assert torch.isfinite(g).all(), (name, g)
        if m is not None:
            assert (v[~m] == 0).all() and (g[~m] == 0).all()


@pytest.mark.parametrize("name", ALL_REGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_masked_rows_with_garbage_give_zero(name: str, dtype) -> None:
    logp = torch.tensor([[float("nan"), -INF, INF, -1000.0]], dtype=dtype)
    ref = torch.tensor([[-INF, float("nan"), 0.0, 0.0]], dtype=dtype)
    mask = torch.zeros(1, 4, dtype=torch.bool)
    v, g = _value_and_grad(name, 10.0, logp, ref, ref.clone(), mask)
    assert (v == 0).all() and (g == 0).all()


# --- surrogates, the full loss and aggregation --------------------------------------------------

SURROGATES = [
    ("clip", {}),
    ("clip", {"dual_clip_c": 3.0, "ratio_cap": 4.0}),
    ("gspo", {}),
    ("atr", {"delta": 0.02}),
    ("divergence_clip", {"measure": "k2", "delta": 0.02, "dual_clip_c": 3.0}),
    ("divergence_clip", {"measure": "prob_l2", "delta_low": 0.01, "delta_high": 0.04}),
    ("divergence_clip", {"measure": "neural_mirror", "delta": 1e-4}),
    ("rpg_clip", {"variant": "urkl", "beta": 0.1}),
    ("rpg_clip", {"variant": "rkl", "beta": 0.1}),
    ("rpg_reinforce", {"variant": "fkl"}),
    ("rpg_reinforce", {"variant": "rkl"}),
    ("rpg_reinforce", {"variant": "ufkl"}),
    ("rpg_reinforce", {"variant": "urkl"}),
    ("cispo", {}),
    ("sapo", {}),
    ("gmpo", {}),
    ("vespo", {}),
    ("divergence_clip", {"measure": "dppo_tv", "delta": 0.15, "is_cap": 20.0}),
    ("divergence_clip", {"measure": "dppo_kl", "delta": 0.05}),
]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(LOGPROB, LOGPROB), min_size=2, max_size=10),
    adv=st.floats(-5.0, 5.0),
    which=st.integers(0, len(SURROGATES) - 1),
    dtype=st.sampled_from(DTYPES),
    masked=st.booleans(),
    agg=st.sampled_from(["grpo", "bnpo", "dr_grpo", "seq_mean_token_sum"]),
    reg=st.sampled_from(["kl_k3", "rpg_urkl", "kl_k3_is", "prob_l2"]),
)
def test_surrogates_and_loss_finite_over_extreme_log_ratios(rows, adv, which, dtype, masked, agg,
                                                            reg):
    name, params = SURROGATES[which]
    logp = torch.tensor([[r[0] for r in rows]] * 2, dtype=dtype)
    old = torch.tensor([[r[1] for r in rows]] * 2, dtype=dtype)
    mask = torch.ones_like(logp, dtype=torch.float32)
    if masked:
        mask[1] = 0  # one all-masked row
    lp = logp.clone().requires_grad_()
    advantages = torch.tensor([adv, -adv])
    surr = get_surrogate(name, **params)
    loss_tok, diag = surr(logp=lp, old_logp=old, advantages=advantages, mask=mask)
    assert torch.isfinite(loss_tok).all() and all(torch.isfinite(d) for d in diag.values())
    loss, _ = compute_policy_loss(
        logp=lp,
        old_logp=old,
        advantages=advantages,
        mask=mask,
        surrogate=surr,
        terms=[LossTerm(reg, reg, 0.1, old.flip(-1))],
        aggregation=agg,
    )
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    if masked:
        assert (g[1] == 0).all()


@pytest.mark.parametrize("mode", ["grpo", "bnpo", "dr_grpo", "seq_mean_token_sum"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_aggregation_of_an_empty_mask_is_zero(mode: str, dtype) -> None:
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=dtype, requires_grad=True)
    mask = torch.zeros(2, 2)
    out = aggregate(x, mask, mode)
    (g,) = torch.autograd.grad(out, x)
    assert out.item() == 0.0 and (g == 0).all()


@pytest.mark.parametrize("name", ["clip", "gspo", "rpg_reinforce"])
def test_surrogate_on_an_empty_mask_is_zero(name: str) -> None:
    params = {"variant": "urkl"} if name == "rpg_reinforce" else {}
    lp = torch.tensor([[-INF, 0.0], [-1000.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[0.0, -INF], [float("nan"), -1.0]])
    loss, diag = get_surrogate(name, **params)(
        logp=lp, old_logp=old, advantages=torch.tensor([1.0, -1.0]), mask=torch.zeros(2, 2)
    )
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert (loss == 0).all() and (g == 0).all()
    assert all(torch.isfinite(d) for d in diag.values())


# --- full-vocabulary divergences with -inf logits -----------------------------------------------


# float64 / float32 math; bf16 logits are computed in float32 but their gradient is stored in bf16
_TOL = {F64: 1e-12, F32: 1e-6, BF16: 1e-2}


def _kl_naive(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """KL(softmax x || softmax y) by plain autograd ops over the finite entries only."""
    lp, lq = x.log_softmax(-1), y.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _fv_value_and_grad(x, y, pot="neg_entropy", chunk=None, mask=None, grad=True):
    xg = x.clone().requires_grad_(grad)
    d = full_vocab_bregman(xg, y, pot, chunk_size=chunk, mask=mask)
    if not grad:
        return d, None
    (g,) = torch.autograd.grad(d.sum(), xg)
    return d.detach(), g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("grad", [True, False])
def test_kl_with_minus_inf_at_the_same_entries_is_the_kl_of_the_rest(dtype, chunk, grad) -> None:
    # Issue: NaN when both rows hold -inf at the same entry (0 log 0 must be 0).
    x = torch.tensor([[0.0, 1.0, -INF, 0.3, -INF], [2.0, -INF, -1.0, 0.0, 0.5]], dtype=dtype)
    y = torch.tensor([[0.5, 1.0, -INF, -0.2, -INF], [1.0, -INF, 0.0, 0.0, -0.5]], dtype=dtype)
    d, g = _fv_value_and_grad(x, y, chunk=chunk, grad=grad)
    assert torch.isfinite(d).all()
    keep = [[0, 1, 3], [0, 2, 3, 4]]
    for r in range(2):
        xr = x[r, keep[r]].double().requires_grad_()
        ref = _kl_naive(xr, y[r, keep[r]].double())
        tol = _TOL[dtype]
        assert d[r].item() == pytest.approx(ref.item(), rel=tol, abs=tol)
        if grad:
            assert g is not None and torch.isfinite(g).all()
            (gr,) = torch.autograd.grad(ref, xr)
            torch.testing.assert_close(g[r, keep[r]].double(), gr, rtol=tol, atol=tol)
            dropped = [i for i in range(5) if i not in keep[r]]
            assert (g[r, dropped] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_policy_zero_where_reference_positive_is_exact(dtype) -> None:
    # p_v = 0 < q_v: the term p_v log(p_v / q_v) is 0 (no floor involved): KL is finite & exact.
    x = torch.tensor([[0.0, 1.0, -INF, -INF]], dtype=dtype)
    y = torch.tensor([[0.5, 1.0, 0.0, -3.0]], dtype=dtype)
    d, g = _fv_value_and_grad(x, y)
    lq = y.double().log_softmax(-1)
    xr = x[0, :2].double().requires_grad_()
    lp = xr.log_softmax(-1)
    ref = (lp.exp() * (lp - lq[0, :2])).sum()
    tol = _TOL[dtype]
    assert d.item() == pytest.approx(ref.item(), rel=tol)
    (gr,) = torch.autograd.grad(ref, xr)
    torch.testing.assert_close(g[0, :2].double(), gr, rtol=tol, atol=tol)
    assert (g[0, 2:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [None, 1])
def test_kl_reference_zero_where_policy_positive_is_finite_floor(dtype, chunk) -> None:
    # q_v = 0 < p_v: the exact KL is +inf. Documented behaviour: the reference logits are floored
    # at (row max - LOGIT_FLOOR), so the value is finite (~ LOGIT_FLOOR * p(S)) and the gradient
    # is finite and lowers the policy mass p(S) on the entries the reference forbids.
    x = torch.tensor([[0.0, 1.0, 0.5, -2.0]], dtype=dtype)
    y = torch.tensor([[0.5, 1.0, -INF, -INF]], dtype=dtype)
    d, g = _fv_value_and_grad(x, y, chunk=chunk)
    assert torch.isfinite(d).all() and torch.isfinite(g).all()
    y_floor = y.double().clamp_min(1.0 - LOGIT_FLOOR)
    assert d.item() == pytest.approx(_kl_naive(x.double(), y_floor).item(), rel=1e-6)
    p = x.double().softmax(-1)
    assert d.item() > 0.9 * LOGIT_FLOOR * p[0, 2:].sum().item()
    x2 = x.double() - 1e-6 * g.double()
    assert x2.softmax(-1)[0, 2:].sum() < p[0, 2:].sum()
    # the no-grad path (bregman_rows) agrees
    with torch.no_grad():
        d0 = full_vocab_bregman(x, y, chunk_size=chunk)
    torch.testing.assert_close(d0, d, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pot", ["neg_entropy", "square", "mirror"])
def test_masked_rows_with_garbage_logits_give_zero_and_zero_gradient(dtype, pot) -> None:
    potential = MIRROR if pot == "mirror" else pot
    x = torch.tensor([[[0.0, 1.0, 2.0], [-INF, -INF, -INF], [float("nan"), 0.0, INF]]],
                     dtype=dtype)
    y = torch.tensor([[[1.0, 0.0, 2.0], [-INF, -INF, -INF], [0.0, float("nan"), 0.0]]],
                     dtype=dtype)
    mask = torch.tensor([[True, False, False]])
    for chunk in (None, 1, 2):
        d, g = _fv_value_and_grad(x, y, potential, chunk=chunk, mask=mask)
        assert torch.isfinite(d).all() and (d[0, 1:] == 0).all()
        assert torch.isfinite(g.float()).all() and (g[0, 1:] == 0).all()
        with torch.no_grad():
            d0 = full_vocab_bregman(x, y, potential, chunk_size=chunk, mask=mask)
        torch.testing.assert_close(d0, d, rtol=1e-6, atol=0)
    all_masked = torch.zeros(1, 3, dtype=torch.bool)
    d, g = _fv_value_and_grad(x, y, potential, mask=all_masked)
    assert (d == 0).all() and (g == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_hidden_with_minus_inf_reference_logits(dtype) -> None:
    g0 = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 4, generator=g0, dtype=F64).to(dtype)
    w = torch.randn(6, 4, generator=g0, dtype=F64).to(dtype)
    ref = torch.randn(2, 3, 6, generator=g0, dtype=F64).to(dtype)
    ref[..., 0] = -INF  # the reference forbids token 0 everywhere
    ref[0, 1] = -INF  # an invalid row, masked out
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[0, 1] = False
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    d = full_vocab_bregman_from_hidden(hh, ww, ref_logits=ref, chunk_size=2, mask=mask)
    gh, gw = torch.autograd.grad(d.sum(), (hh, ww))
    assert torch.isfinite(d).all() and torch.isfinite(gh.float()).all()
    assert torch.isfinite(gw.float()).all() and d[0, 1] == 0
    d_logits = full_vocab_bregman(F.linear(h, w), ref, mask=mask)
    torch.testing.assert_close(d, d_logits, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    scale=st.floats(0.0, 1000.0),
    p_inf=st.floats(0.0, 0.9),
    q_inf=st.floats(0.0, 0.9),
    dtype=st.sampled_from(DTYPES),
    pot=st.sampled_from(["neg_entropy", "square", "mirror"]),
    chunk=st.sampled_from([None, 1, 3]),
)
def test_full_vocab_finite_with_random_minus_inf_logits(seed, scale, p_inf, q_inf, dtype, pot,
                                                       chunk):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(2, 3, 11, generator=g, dtype=F64)
    y = scale * torch.randn(2, 3, 11, generator=g, dtype=F64)
    x[torch.rand(x.shape, generator=g, dtype=F64) < p_inf] = -INF
    y[torch.rand(y.shape, generator=g, dtype=F64) < q_inf] = -INF
    x[..., 0] = x[..., 0].clamp_min(0.0)  # every row keeps one finite logit
    y[..., 0] = y[..., 0].clamp_min(0.0)
    x, y = x.to(dtype), y.to(dtype)
    potential = MIRROR if pot == "mirror" else pot
    d, grad = _fv_value_and_grad(x, y, potential, chunk=chunk)
    assert torch.isfinite(d).all() and (d >= -1e-5).all()
    assert torch.isfinite(grad.float()).all()
    assert (grad[x == -INF] == 0).all()
