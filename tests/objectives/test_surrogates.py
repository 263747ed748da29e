import math

import pytest
import torch

from gbmpo.objectives import SURROGATES, atr_bounds, get_surrogate
from gbmpo.registry import UnknownNameError

F64 = torch.float64


def make_batch(b=6, t=5, spread=0.5, seed=0, adv_per_token=False):
    """float64 logp (leaf with grad), old logp with ratios spread around 1, signed advantages,
    a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.05).requires_grad_()
    old = logp.detach() + spread * (torch.rand(b, t, generator=g, dtype=F64) * 2 - 1)
    shape = (b, t) if adv_per_token else (b,)
    adv = torch.randn(shape, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    return logp, old, adv, mask


def autograd(fn, logp):
    loss = fn(logp)
    (g,) = torch.autograd.grad(loss, logp)
    return g


def assert_same_surrogate(a, b, logp, old, adv, mask):
    """Surrogates ``a`` and ``b`` give the same per-token loss and gradient on the batch; returns
    both diagnostics dicts."""
    la, da = a(logp=logp, old_logp=old, advantages=adv, mask=mask)
    lb, db = b(logp=logp, old_logp=old, advantages=adv, mask=mask)
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(
        autograd(lambda x: a(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp),
        autograd(lambda x: b(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp),
    )
    return da, db


# ---------------------------------------------------------------------------- ATR bounds

# docs/methods.md, section "ATR-GRPO", table: delta -> (l_delta, u_delta), 3 decimals.
ATR_TABLE = [
    (0.005, 0.903, 1.103),
    (0.01, 0.865, 1.148),
    (0.0177, 0.824, 1.200),
    (0.02, 0.813, 1.214),
    (0.0231, 0.800, 1.231),
    (0.0331, 0.764, 1.280),
    (0.05, 0.716, 1.350),
    (0.1, 0.617, 1.516),
]


@pytest.mark.parametrize("delta,low,high", ATR_TABLE)
def test_atr_bounds_reproduce_methods_table(delta, low, high):
    lo, hi = atr_bounds(delta)
    if delta == 0.0177:
        # The parametrised table says 0.824, but l = 0.82346 (0.8235 - log 0.8235 = 1.01769 <
        # 1.0177 and the function is decreasing below 1), so it rounds to 0.823, as
        # docs/methods.md prints it. The upper bound matches.
        assert round(lo, 3) == 0.823
    else:
        assert round(lo, 3) == low
    assert round(hi, 3) == high
    # both are roots of KL3(w) = w - 1 - log w = delta, on either side of 1
    for w in (lo, hi):
        assert w - 1 - math.log(w) == pytest.approx(delta, rel=1e-9, abs=1e-14)
    assert 0 < lo < 1 < hi and hi - 1 > 1 - lo


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf])
def test_atr_bounds_rejects_bad_delta(bad):
    with pytest.raises(ValueError, match="delta"):
        atr_bounds(bad)


def test_atr_surrogate_is_clip_with_lambert_bounds():
    logp, old, adv, mask = make_batch(spread=0.4)
    lo, hi = atr_bounds(0.03)
    atr = get_surrogate("atr", delta=0.03)
    ref = get_surrogate("clip", eps_low=1 - lo, eps_high=hi - 1)
    da, _ = assert_same_surrogate(atr, ref, logp, old, adv, mask)
    assert float(da["clip_frac_low"]) + float(da["clip_frac_high"]) > 0
    with pytest.raises(TypeError, match="delta"):
        get_surrogate("atr")


# ---------------------------------------------------------------------------- token clip


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)])
def test_clip_gradient_matches_analytic(eps_low, eps_high):
    logp, old, adv, mask = make_batch(b=8, t=6, spread=0.6)
    surr = get_surrogate("clip", eps_low=eps_low, eps_high=eps_high)
    grad = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    w = torch.exp(logp.detach() - old)
    a = adv[:, None].expand_as(w)
    lo, hi = 1 - eps_low, 1 + eps_high
    inside = torch.where(a > 0, w <= hi, w >= lo)
    expected = torch.where(inside, -a * w, torch.zeros_like(w)) * mask
    torch.testing.assert_close(grad, expected)
    # both kinds of clipping actually happened in this batch, and some tokens were free
    assert ((w > hi) & (a > 0) & (mask > 0)).any() and ((w < lo) & (a < 0) & (mask > 0)).any()
    assert (inside & (mask > 0)).any()


def test_clip_values_and_token_level_advantages():
    logp, old, adv, mask = make_batch(adv_per_token=True, spread=0.6)
    loss, _ = get_surrogate("clip", eps_low=0.2, eps_high=0.28)(
        logp=logp, old_logp=old, advantages=adv, mask=mask
    )
    w = torch.exp(logp.detach() - old)
    expected = -torch.minimum(w * adv, w.clamp(0.8, 1.28) * adv) * mask
    torch.testing.assert_close(loss.detach(), expected)


def test_dual_clip_caps_negative_advantages():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=F64)).requires_grad_()
    # ratios 5, 2, 0.5, 5 ; advantages: -1 for the whole sequence
    old = torch.log(torch.tensor([[0.1, 0.25, 1.0, 0.1]], dtype=F64))
    adv = torch.tensor([-1.0], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    surr = get_surrogate("clip", eps_low=0.2, dual_clip_c=3.0)
    loss, diag = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    # w=5 > c: capped at -c*A = 3 ; w=2 in (1+eps, c): -min(2*-1, 1.2*-1) = 2 ; w=0.5 < lo: 0.8
    torch.testing.assert_close(loss.detach(), torch.tensor([[3.0, 2.0, 0.8, 0.0]], dtype=F64))
    grad = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]], dtype=F64))
    assert float(diag["clip_frac_dual"]) == pytest.approx(1 / 3)
    assert float(diag["clip_frac_low"]) == pytest.approx(1 / 3)
    assert float(diag["clip_frac_high"]) == 0.0
    assert float(diag["ratio_max"]) == pytest.approx(5.0)  # masked 4th token ignored


def test_ratio_cap_caps_the_unclipped_ratio_and_delta_is_its_deprecated_name():
    logp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    old = torch.log(torch.tensor([[0.2, 0.2]], dtype=F64))  # ratio 5
    mask = torch.ones(1, 2, dtype=F64)
    surr = get_surrogate("clip", eps_low=0.2, ratio_cap=4.0)
    for name in ("clip", "gspo"):
        with pytest.warns(DeprecationWarning, match="'delta' is renamed 'ratio_cap'"):
            old_name = get_surrogate(name, delta=4.0)
        assert old_name == get_surrogate(name, ratio_cap=4.0) and old_name.ratio_cap == 4.0
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="ratio_cap only"):
        get_surrogate("clip", delta=4.0, ratio_cap=3.0)
    loss_neg, _ = surr(
        logp=logp, old_logp=old, advantages=torch.tensor([-1.0], dtype=F64), mask=mask
    )
    torch.testing.assert_close(loss_neg.detach(), torch.full((1, 2), 4.0, dtype=F64))
    neg = torch.tensor([-1.0], dtype=F64)
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=neg, mask=mask)[0].sum(), logp)
    assert torch.all(g == 0)
    loss_pos, _ = surr(
        logp=logp, old_logp=old, advantages=torch.tensor([1.0], dtype=F64), mask=mask
    )
    torch.testing.assert_close(loss_pos.detach(), torch.full((1, 2), -1.2, dtype=F64))


def test_clip_diagnostics_fractions():
    logp = torch.zeros(2, 3, dtype=F64)
    # ratios row 0: 2, 1, 0.5 ; row 1: 2, 1, 0.5
    old = torch.log(torch.tensor([[0.5, 1.0, 2.0], [0.5, 1.0, 2.0]], dtype=F64))
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    _, d = get_surrogate("clip")(logp=logp, old_logp=old, advantages=adv, mask=mask)
    # high clip: row 0 token 0 (A>0, w=2); low clip: row 1 token 2 is masked out -> none
    assert float(d["clip_frac_high"]) == pytest.approx(1 / 5)
    assert float(d["clip_frac_low"]) == 0.0
    assert float(d["ratio_mean"]) == pytest.approx((2 + 1 + 0.5 + 2 + 1) / 5)
    assert float(d["ratio_min"]) == pytest.approx(0.5)
    for v in d.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_on_policy_clip_gradient_equals_reinforce():
    logp, _, adv, mask = make_batch()
    old = logp.detach()
    clip = get_surrogate("clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    g_clip = autograd(
        lambda x: clip(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp
    )
    g_pg = autograd(lambda x: (-adv[:, None] * x * mask).sum(), logp)
    torch.testing.assert_close(g_clip, g_pg)
    for variant in ("ufkl", "urkl"):  # C_KL(w=1) = 0 for the unnormalized KLs
        rf = get_surrogate("rpg_reinforce", variant=variant, beta=0.3)
        torch.testing.assert_close(
            autograd(
                lambda x, rf=rf: rf(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp
            ),
            g_pg,
        )
    # on-policy value: -A on every valid token
    loss, d = clip(logp=logp, old_logp=old, advantages=adv, mask=mask)
    torch.testing.assert_close(loss.detach(), -adv[:, None] * mask)
    assert float(d["ratio_mean"]) == 1.0


def test_masked_garbage_never_reaches_loss_or_gradient():
    logp, old, adv, mask = make_batch()
    garbage = torch.where(mask > 0, logp.detach(), torch.full_like(mask, -math.inf))
    x = garbage.clone().requires_grad_()
    old_g = torch.where(mask > 0, old, torch.full_like(mask, math.nan))
    for name, params in [
        ("clip", {"dual_clip_c": 3.0}),
        ("gspo", {}),
        ("atr", {"delta": 0.02}),
        ("rpg_clip", {"variant": "urkl", "beta": 0.1}),
        ("rpg_reinforce", {"variant": "rkl"}),
    ]:
        surr = get_surrogate(name, **params)
        loss, diag = surr(logp=x, old_logp=old_g, advantages=adv, mask=mask)
        assert torch.isfinite(loss).all(), name
        assert torch.all(loss[mask == 0] == 0), name
        (g,) = torch.autograd.grad(loss.sum(), x)
        assert torch.isfinite(g).all() and torch.all(g[mask == 0] == 0), name
        assert all(math.isfinite(float(v)) for v in diag.values()), name


# ---------------------------------------------------------------------------- GSPO


def test_gspo_gradient_is_sequence_level():
    logp, old, adv, mask = make_batch(b=8, t=6, spread=0.3, seed=3)
    surr = get_surrogate("gspo", eps_low=0.1, eps_high=0.1)
    lengths = mask.sum(-1)

    def grpo_sum(x):  # B * (grpo aggregation)
        loss, _ = surr(logp=x, old_logp=old, advantages=adv, mask=mask)
        return (loss.sum(-1) / lengths).sum()

    grad = autograd(grpo_sum, logp)
    s = torch.exp(((logp.detach() - old) * mask).sum(-1) / lengths)
    inside = torch.where(adv > 0, s <= 1.1, s >= 0.9)
    coeff = torch.where(inside, -adv * s / lengths, torch.zeros_like(s))
    torch.testing.assert_close(grad, coeff[:, None] * mask)
    assert inside.any() and (~inside).any()
    loss, _ = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    expected = -torch.minimum(s * adv, s.clamp(0.9, 1.1) * adv)
    torch.testing.assert_close(loss.detach(), expected[:, None] * mask)


def test_gspo_equals_token_clip_for_one_token_sequences():
    logp, old, adv, _ = make_batch(b=10, t=1, spread=0.6, seed=5)
    mask = torch.ones(10, 1, dtype=F64)
    gspo = get_surrogate("gspo", eps_low=0.2, eps_high=0.28, dual_clip_c=2.0)
    clip = get_surrogate("clip", eps_low=0.2, eps_high=0.28, dual_clip_c=2.0)
    dg, dc = assert_same_surrogate(gspo, clip, logp, old, adv, mask)
    assert {k: float(v) for k, v in dg.items()} == pytest.approx(
        {k: float(v) for k, v in dc.items()}
    )
    # one valid token per row inside a padded tensor behaves the same
    lp2, old2, adv2, _ = make_batch(b=6, t=4, spread=0.6, seed=6)
    one_hot = torch.zeros(6, 4, dtype=F64)
    one_hot[torch.arange(6), torch.tensor([0, 3, 1, 2, 0, 1])] = 1.0
    torch.testing.assert_close(
        gspo(logp=lp2, old_logp=old2, advantages=adv2, mask=one_hot)[0],
        clip(logp=lp2, old_logp=old2, advantages=adv2, mask=one_hot)[0],
    )


# ---------------------------------------------------------------------------- RPG


def table_r2_weight(variant, w, a, beta):
    """RPG Table 2 REINFORCE weights, written out here independently of the library."""
    return {
        "fkl": w * a + beta,
        "ufkl": w * a - beta * (w - 1),
        "rkl": w * (a - beta * torch.log(w) - beta),
        "urkl": w * (a - beta * torch.log(w)),
    }[variant]


def table_r1_loss(variant, logp, old, a, beta):
    """RPG Table 1 fully differentiable per-token losses (Z_old dropped)."""
    w = torch.exp(logp - old)
    logw = logp - old
    return {
        "ufkl": -w * a + beta * (w - logw - 1),
        "urkl": -w * a + beta * (w * logw - w),
        "fkl": -w * a - beta * logp,
        "rkl": w * (-a + beta * logw),
    }[variant]


@pytest.mark.parametrize("variant", ["fkl", "rkl", "ufkl", "urkl"])
def test_rpg_reinforce_active_gradient_is_table_r2_weight(variant):
    # spread 0.15: every ratio within [0.86, 1.17], inside (1 - 0.2, 1 + 0.28): no clipping
    logp, old, adv, mask = make_batch(b=8, t=6, spread=0.15, seed=11)
    beta = 0.7  # large so the KL part matters numerically
    surr = get_surrogate("rpg_reinforce", variant=variant, beta=beta)
    loss, d = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    assert float(d["clip_frac_low"]) == float(d["clip_frac_high"]) == 0.0
    grad = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    w = torch.exp(logp.detach() - old)
    weight = table_r2_weight(variant, w, adv[:, None], beta)
    torch.testing.assert_close(grad, -weight * mask)
    # value: SG(weight) * (-log pi)
    torch.testing.assert_close(loss.detach(), -weight * logp.detach() * mask)


@pytest.mark.parametrize("variant", ["fkl", "rkl", "ufkl", "urkl"])
def test_rpg_prop_4_1_reinforce_equals_fully_differentiable(variant):
    logp, old, adv, mask = make_batch(b=8, t=6, spread=0.15, seed=12)
    beta = 0.5
    surr = get_surrogate("rpg_reinforce", variant=variant, beta=beta, c=None)
    g_reinforce = autograd(
        lambda x: (surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0]).sum(), logp
    )
    g_r1 = autograd(
        lambda x: (table_r1_loss(variant, x, old, adv[:, None], beta) * mask).sum(), logp
    )
    torch.testing.assert_close(g_reinforce, g_r1)


@pytest.mark.parametrize("variant", ["rkl", "urkl"])
def test_rpg_clip_regularized_advantage_matches_table_r1(variant):
    logp, old, adv, mask = make_batch(b=8, t=6, spread=0.15, seed=13)
    beta = 0.5
    surr = get_surrogate("rpg_clip", variant=variant, beta=beta)
    loss, d = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    assert float(d["clip_frac_low"]) == float(d["clip_frac_high"]) == 0.0
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    g_r1 = autograd(
        lambda x: (table_r1_loss(variant, x, old, adv[:, None], beta) * mask).sum(), logp
    )
    torch.testing.assert_close(g, g_r1)


def test_rpg_clip_plain_is_dual_clip():
    logp, old, adv, mask = make_batch(b=8, t=6, spread=1.5, seed=14)
    a = get_surrogate("rpg_clip", eps_low=0.2, eps_high=0.28, c=3.0)
    b = get_surrogate("clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    la, da = a(logp=logp, old_logp=old, advantages=adv, mask=mask)
    lb, db = b(logp=logp, old_logp=old, advantages=adv, mask=mask)
    torch.testing.assert_close(la, lb)
    assert float(da["clip_frac_dual"]) > 0 and float(da["clip_frac_dual"]) == float(
        db["clip_frac_dual"]
    )
    with pytest.raises(ValueError, match="beta has no effect"):
        get_surrogate("rpg_clip", variant="ufkl", beta=1e-4)


def test_rpg_reinforce_branches():
    """One token per branch of Algorithm 2 (ufkl, beta=0.1, eps 0.2/0.28, c=3)."""
    beta, lo, hi, c = 0.1, 0.8, 1.28, 3.0
    p = torch.tensor([0.5] * 6, dtype=F64)
    ratios = torch.tensor([1.1, 1.5, 0.5, 1.1, 4.0, 0.5], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0], dtype=F64)
    logp = torch.log(p)[:, None].clone().requires_grad_()
    old = (torch.log(p) - torch.log(ratios))[:, None]
    mask = torch.ones(6, 1, dtype=F64)
    surr = get_surrogate(
        "rpg_reinforce", variant="ufkl", beta=beta, eps_low=0.2, eps_high=0.28, c=c
    )
    loss, d = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    ell = -math.log(0.5)
    w_bar = ratios.clamp(lo, hi)
    c_kl = beta * (1 - w_bar)
    expected_value = torch.stack(
        [
            (1.1 * adv[0] + c_kl[0]) * ell,  # A'>0, w<1+eps2: active
            (hi * adv[1] + c_kl[1]) * ell,  # A'>0, w>=1+eps2: constant at 1+eps2
            (lo * adv[2] + c_kl[2]) * ell,  # A'<0, w<=1-eps1: constant at 1-eps1
            (1.1 * adv[3] + c_kl[3]) * ell,  # A'<0, 1-eps1<w<c: active
            (c * adv[4] + c_kl[4]) * ell,  # A'<0, w>=c: dual-clip constant
            (0.5 * adv[5] + c_kl[5]) * ell,  # A'>0, small w: active (no lower clip)
        ]
    )
    torch.testing.assert_close(loss.detach()[:, 0], expected_value)
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)[
        :, 0
    ]
    active = torch.tensor([1.0, 0, 0, 1, 0, 1], dtype=F64)
    weight = ratios * adv + c_kl
    torch.testing.assert_close(g, -weight * active)
    assert float(d["clip_frac_high"]) == pytest.approx(1 / 6)
    assert float(d["clip_frac_low"]) == pytest.approx(1 / 6)
    assert float(d["clip_frac_dual"]) == pytest.approx(1 / 6)


def test_rpg_reinforce_branches_on_effective_advantage():
    """A' = A + C_KL / w decides the branch, not A: with fkl the +beta term flips a small
    negative advantage to A' > 0, so a low ratio stays active."""
    logp = torch.log(torch.tensor([[0.5]], dtype=F64)).requires_grad_()
    old = logp.detach() - math.log(0.5)  # w = 0.5 <= 1 - eps_low
    adv = torch.tensor([-0.01], dtype=F64)
    mask = torch.ones(1, 1, dtype=F64)
    surr = get_surrogate("rpg_reinforce", variant="fkl", beta=0.1)
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[-(0.5 * -0.01 + 0.1)]], dtype=F64))


# ---------------------------------------------------------------------------- registry, dtypes


def test_registry_names_unknown_name_and_params():
    assert set(SURROGATES.names()) == {
        "clip", "gspo", "atr", "divergence_clip", "rpg_clip", "rpg_reinforce", "cispo", "sapo",
        "gmpo", "vespo", "gpg", "dro",
    }  # fmt: skip
    with pytest.raises(
        UnknownNameError,
        match="atr, cispo, clip, divergence_clip, dro, gmpo, gpg, gspo, rpg_clip, rpg_reinforce, "
        "sapo, vespo",
    ):
        get_surrogate("ppo")
    with pytest.raises(TypeError, match="'epsilon'.*valid parameters: eps_low, eps_high"):
        get_surrogate("clip", epsilon=0.2)
    with pytest.raises(TypeError, match="'delta'"):
        get_surrogate("rpg_reinforce", variant="fkl", delta=0.1)


@pytest.mark.parametrize(
    "name,params,match",
    [
        ("clip", {"dual_clip_c": 1.0}, "must be > 1"),
        ("clip", {"eps_low": -0.1}, "eps_low"),
        ("clip", {"eps_low": 1.5}, "eps_low"),
        ("clip", {"eps_high": -0.1}, "eps_high"),
        ("clip", {"ratio_cap": 1.1}, "ratio_cap"),
        ("gspo", {"dual_clip_c": 0.5}, "must be > 1"),
        ("atr", {"delta": -0.01}, "delta"),
        ("rpg_clip", {"variant": "js"}, "unknown variant"),
        ("rpg_reinforce", {"variant": "kl"}, "valid: fkl, rkl, ufkl, urkl"),
        ("rpg_reinforce", {"variant": "fkl", "beta": -1.0}, "beta"),
        ("rpg_reinforce", {"variant": "fkl", "c": 0.9}, "must be > 1"),
        ("cispo", {"eps_low": 1.5}, "eps_low"),
        ("cispo", {"eps_high": -1.0}, "eps_high"),
        ("sapo", {"tau_pos": 0.0}, "tau_pos must be > 0"),
        ("sapo", {"tau_neg": math.nan}, "tau_neg must be finite"),
        ("gmpo", {"eps_low": 0.0}, "eps_low must be > 0"),
        ("vespo", {"lambda_neg": -1.0}, "lambda_neg must be >= 0"),
    ],
)
def test_bad_parameters_raise(name, params, match):
    with pytest.raises(ValueError, match=match):
        get_surrogate(name, **params)


def test_shape_errors():
    logp, old, adv, mask = make_batch()
    surr = get_surrogate("clip")
    with pytest.raises(ValueError, match="advantages"):
        surr(logp=logp, old_logp=old, advantages=adv[:3], mask=mask)
    with pytest.raises(ValueError, match="old_logp shape"):
        surr(logp=logp, old_logp=old[:, :2], advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="mask"):
        surr(logp=logp, old_logp=old, advantages=adv, mask=mask * 2)


@pytest.mark.parametrize(
    "name,params",
    [
        ("clip", {"dual_clip_c": 3.0}),
        ("gspo", {}),
        ("atr", {"delta": 0.02}),
        ("rpg_clip", {"variant": "rkl", "beta": 0.01}),
        ("rpg_reinforce", {"variant": "urkl"}),
        ("cispo", {}),
        ("sapo", {}),
        ("gmpo", {}),
        ("vespo", {}),
        ("divergence_clip", {"measure": "dppo_tv", "delta": 0.15, "is_cap": 20.0}),
        ("divergence_clip", {"measure": "dppo_kl", "delta": 0.05}),
    ],
)
def test_bf16_inputs_give_finite_float32(name, params):
    logp, old, adv, mask = make_batch(b=4, t=7, spread=2.0)
    x = logp.detach().to(torch.bfloat16).requires_grad_()
    loss, diag = get_surrogate(name, **params)(
        logp=x, old_logp=old.to(torch.bfloat16), advantages=adv.to(torch.bfloat16), mask=mask.bool()
    )
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in diag.values())


# ------------------------------------------------------------------ baseline surrogates


def _masked_w(logp, old, mask):
    return torch.exp(logp.detach() - old) * mask


@pytest.mark.parametrize("low,high", [(1.0, 4.0), (0.2, 0.28)])
def test_cispo_gradient_is_clipped_weight_on_every_token(low, high):
    """d loss / d log pi = -clip(w, 1 - eps_low, 1 + eps_high) A on every valid token (no token
    loses its gradient), value -SG(clip(w)) A log pi."""
    logp, old, adv, mask = make_batch(b=8, t=6, spread=2.2)
    surr = get_surrogate("cispo", eps_low=low, eps_high=high)
    loss, diag = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    w = torch.exp(logp.detach() - old)
    cw = w.clamp(1 - low, 1 + high)
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    torch.testing.assert_close(g, -(cw * adv[:, None]) * mask)
    torch.testing.assert_close(loss, -(cw * adv[:, None]) * logp.detach() * mask)
    m = mask.bool()
    assert float(diag["clip_frac_high"]) == pytest.approx(float((w > 1 + high)[m].float().mean()))
    assert float(diag["clip_frac_high"]) > 0


def test_sapo_gate_gradient_and_on_policy_limit():
    """d loss / d log pi = -4 sigma (1 - sigma) w A with tau by the advantage's sign; at w = 1 it
    is the plain policy gradient -A (the gate's slope is 1 there)."""
    logp, old, adv, mask = make_batch(b=8, t=6, spread=1.0)
    surr = get_surrogate("sapo", tau_pos=1.5, tau_neg=3.0)
    w = torch.exp(logp.detach() - old)
    tau = torch.where(adv[:, None] > 0, 1.5, 3.0).to(F64)
    sig = torch.sigmoid(tau * (w - 1))
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    torch.testing.assert_close(g, -(4 * sig * (1 - sig) * w * adv[:, None]) * mask)
    g1 = autograd(
        lambda x: surr(logp=x, old_logp=x.detach(), advantages=adv, mask=mask)[0].sum(), logp
    )
    torch.testing.assert_close(g1, -adv[:, None].expand_as(mask) * mask)
    loss, _ = surr(logp=logp, old_logp=logp.detach(), advantages=adv, mask=mask)
    torch.testing.assert_close(loss, -(4 / tau) * 0.5 * adv[:, None] * mask)


def test_gmpo_is_geometric_mean_with_log_space_clip():
    """Per-token loss -A_i s_i with s_i = exp(mean of the sign-clipped log-ratios); each unclipped
    token's gradient -A_i s_i / |o_i|, clipped tokens 0."""
    logp, old, adv, mask = make_batch(b=8, t=6, spread=0.8)
    eps = 0.3
    surr = get_surrogate("gmpo", eps_low=eps, eps_high=eps)
    lr = logp.detach() - old
    a = adv[:, None]
    clipped = torch.where(a > 0, lr.clamp(max=eps), lr.clamp(min=-eps))
    n = mask.sum(-1, keepdim=True)
    s = torch.exp((clipped * mask).sum(-1, keepdim=True) / n)
    loss, diag = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    torch.testing.assert_close(loss, -(a * s) * mask)
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    free = ((a > 0) & (lr < eps)) | ((a < 0) & (lr > -eps))
    # the summed per-token loss holds |o_i| copies of -A_i s_i, each with gradient
    # -A_i s_i / |o_i| on a free token: -A_i s_i in total
    torch.testing.assert_close(g, torch.where(free, -(a * s), torch.zeros_like(lr)) * mask)
    assert bool((~free & mask.bool()).any()) and bool((free & mask.bool()).any())
    assert float(diag["clip_frac_high"]) + float(diag["clip_frac_low"]) > 0


def test_vespo_weight_is_one_on_policy_and_decays_off_policy():
    """phi(1) = 1 (plain policy gradient on-policy); gradient -phi(W) A with W the product of
    the token ratios; phi < 1 when W moves away from 1 (k = 2, lambda = 3: phi(2) = 4 e^-3)."""
    logp, old, adv, mask = make_batch(b=6, t=5, spread=0.5)
    surr = get_surrogate("vespo")
    g1 = autograd(
        lambda x: surr(logp=x, old_logp=x.detach(), advantages=adv, mask=mask)[0].sum(), logp
    )
    torch.testing.assert_close(g1, -adv[:, None].expand_as(mask) * mask)
    log_w = ((logp.detach() - old) * mask).sum(-1, keepdim=True)
    nonneg = adv[:, None] >= 0
    k = torch.where(nonneg, 2.0, 3.0).to(F64)
    lam = torch.where(nonneg, 3.0, 2.0).to(F64)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    g = autograd(lambda x: surr(logp=x, old_logp=old, advantages=adv, mask=mask)[0].sum(), logp)
    torch.testing.assert_close(g, -(phi * adv[:, None]) * mask)
    one = torch.zeros(1, 1, dtype=F64)
    two = torch.full((1, 1), math.log(2.0), dtype=F64)
    from gbmpo.objectives.surrogates import vespo_weight

    a = torch.ones(1, 1, dtype=F64)
    assert float(vespo_weight(one, a, 2, 3, 3, 2)) == pytest.approx(1.0)
    assert float(vespo_weight(two, a, 2, 3, 3, 2)) == pytest.approx(4 * math.exp(-3))


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo", "vespo"])
def test_baselines_selectable_in_the_trainer_config(name):
    from gbmpo.config import TrainConfig, validate

    cfg = TrainConfig()
    cfg.objective.surrogate.name = name
    cfg.objective.surrogate.params = {}
    validate(cfg)


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo", "vespo"])
def test_baselines_mask_garbage(name):
    logp = torch.tensor([[-0.5, float("nan"), -math.inf]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.3, math.inf, float("nan")]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)
    loss, diag = get_surrogate(name)(
        logp=logp, old_logp=old, advantages=torch.ones(1, dtype=F64), mask=mask
    )
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.isfinite(loss).all() and (loss[0, 1:] == 0).all()
    assert torch.isfinite(g).all() and (g[0, 1:] == 0).all() and g[0, 0] != 0
    assert all(torch.isfinite(v) for v in diag.values())


# ------------------------------------------------------------------- gpg, dro (verl's losses)


def test_gpg_and_dro_values_and_analytic_gradients_float64():
    g = torch.Generator().manual_seed(11)
    logp = torch.rand(3, 5, generator=g, dtype=F64).clamp_min(1e-3).log()
    old = (logp + 0.2 * torch.randn(3, 5, generator=g, dtype=F64)).clamp_max(0.0)
    adv = torch.randn(3, generator=g, dtype=F64)
    mask = torch.ones(3, 5, dtype=F64)
    mask[1, 3:] = 0
    a = adv[:, None].expand(3, 5) * mask
    lp = logp.clone().requires_grad_()
    loss, _ = get_surrogate("gpg")(logp=lp, old_logp=old, advantages=adv, mask=mask)
    torch.testing.assert_close(loss.detach(), -a * logp * mask)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, -a)
    beta = 0.3
    lp = logp.clone().requires_grad_()
    loss, _ = get_surrogate("dro", beta=beta)(logp=lp, old_logp=old, advantages=adv, mask=mask)
    d = (logp - old) * mask
    torch.testing.assert_close(loss.detach(), -(logp * a - 0.5 * beta * d**2) * mask)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, (-a + beta * d) * mask)
    with pytest.raises(ValueError, match="beta must be > 0"):
        get_surrogate("dro", beta=0.0)


# ------------------------------------------------------------------- gradcheck, registry-wide

#: every registered surrogate (and every kind of ``divergence_clip`` measure) with the way its
#: gradient is checked by finite differences in float64: ``plain``, the per-token loss is a
#: differentiable function of log pi; ``frozen``, a REINFORCE form whose weight is a
#: stop-gradient function of the ratio (its value moves with the ratio, its gradient does not),
#: checked with the ratio held fixed (old_logp moved with logp), so that the finite difference
#: sees the log pi factor only
GRADCHECK: list[tuple[str, dict, str]] = [
    ("clip", {"eps_high": 0.28, "dual_clip_c": 3.0}, "plain"),
    ("clip", {"ratio_cap": 1.5}, "plain"),
    ("gspo", {"eps_low": 0.1, "eps_high": 0.1}, "plain"),
    ("atr", {"delta": 0.03}, "plain"),
    ("divergence_clip", {"measure": "k2", "delta": 0.05}, "plain"),
    ("divergence_clip", {"measure": "prob_l2", "delta": 0.05}, "plain"),
    ("divergence_clip", {"measure": "dppo_kl", "delta": 0.05, "is_cap": 2.0}, "frozen"),
    ("rpg_clip", {}, "plain"),
    ("rpg_reinforce", {"variant": "urkl", "beta": 0.1}, "frozen"),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.28}, "frozen"),
    ("sapo", {}, "plain"),
    ("gmpo", {}, "plain"),
    ("vespo", {}, "frozen"),
    ("gpg", {}, "plain"),
    ("dro", {"beta": 0.5}, "plain"),
]


def test_every_registered_surrogate_is_gradchecked():
    assert {name for name, _, _ in GRADCHECK} == set(SURROGATES.names())


@pytest.mark.parametrize(("name", "params", "mode"), GRADCHECK,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(GRADCHECK)])  # fmt: skip
def test_gradient_is_float64_autograd_by_finite_differences(name, params, mode):
    """``torch.autograd.gradcheck`` of every surrogate's per-token loss in float64, ratios on
    both sides of the clips (``frozen``: within 0.1 of 1, where RPG-REINFORCE is on its active
    branches), advantages of both signs, a ragged mask."""
    logp, old, adv, mask = make_batch(b=4, t=4, spread=0.1 if mode == "frozen" else 0.5, seed=3)
    x0 = logp.detach()
    surr = get_surrogate(name, **params)

    def loss(x):
        anchor = old + (x - x0) if mode == "frozen" else old
        return surr(logp=x, old_logp=anchor, advantages=adv, mask=mask)[0]

    # eps 1e-6: away from the clips' kinks (none within 1e-6 of a ratio bound here) the central
    # difference is exact to ~1e-9, far inside gradcheck's atol 1e-5
    assert torch.autograd.gradcheck(loss, (x0.clone().requires_grad_(),), eps=1e-6)
