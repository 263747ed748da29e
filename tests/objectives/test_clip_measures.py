"""Clipping by a policy divergence (``divergence_clip``): intervals, root finder, gradients, alias.

Closed forms against the framework's rule {w : f(w) <= delta} (ATR-GRPO arXiv 2602.05494), the
bisection against closed forms and a dense grid, properties with hypothesis, the exact zero
gradient on the clipped side, and ``atr`` == ``divergence_clip(measure="k3")`` bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.special import lambertw

from gbmpo.objectives import get_surrogate
from gbmpo.objectives.clip_bisection import (
    BISECT_ITERS,
    DPPO_KL_W_MIN,
    MIRROR_TABLE_TOL,
    bisect_interval,
    dppo_kl_interval,
    mirror_interval,
)
from gbmpo.objectives.clip_measures import (
    CLIP_MEASURES,
    atr_bounds,
    dppo_tv_interval,
    dppo_valid_mask,
    k1_interval,
    k2_interval,
    k3_interval,
    measure_dppo_kl,
    measure_dppo_tv,
    measure_k1,
    measure_k2,
    measure_k3,
    measure_mirror,
    measure_prob_l2,
    measure_ratio,
    prob_l2_interval,
    ratio_interval,
)
from gbmpo.objectives.mirror import NeuralMirrorMap
from gbmpo.objectives.surrogates.base import masked_clip_loss, prepare_inputs

F64 = torch.float64
SCALAR = {
    "ratio": (ratio_interval, measure_ratio),
    "k1": (k1_interval, measure_k1),
    "k2": (k2_interval, measure_k2),
    "k3": (k3_interval, measure_k3),
}
MIRROR = NeuralMirrorMap.random(scale=0.5, seed=3)


def make_batch(b=6, t=7, spread=0.8, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.05).to(dtype).requires_grad_()
    old = logp.detach() + (spread * (torch.rand(b, t, generator=g, dtype=F64) * 2 - 1)).to(dtype)
    adv = torch.randn(b, generator=g, dtype=F64).to(dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    return logp, old, adv, mask


def grad_of(surr, logp, old, adv, mask):
    loss, diag = surr(logp=logp, old_logp=old, advantages=adv, mask=mask)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    return loss, g, diag


# --------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("dl,dh", [(0.2, 0.2), (0.1, 0.28), (0.5, 0.05)])
def test_closed_forms(dl, dh):
    assert ratio_interval(dl, dh) == (1 - dl, 1 + dh)
    assert k1_interval(dl, dh) == (math.exp(-dl), math.exp(dh))
    assert k2_interval(dl, dh) == (math.exp(-math.sqrt(2 * dl)), math.exp(math.sqrt(2 * dh)))
    # k3: Lambert W, z = -exp(-(1 + delta)), l = -W0(z_low), u = -W_{-1}(z_high)
    lo, hi = k3_interval(dl, dh)
    assert lo == -lambertw(-math.exp(-(1 + dl)), 0).real
    assert hi == -lambertw(-math.exp(-(1 + dh)), -1).real
    # every end is on the boundary f = delta of its side
    for name, (interval, f) in SCALAR.items():
        lo, hi = interval(dl, dh)
        flo = float(f(torch.tensor(lo, dtype=F64)))
        fhi = float(f(torch.tensor(hi, dtype=F64)))
        assert flo == pytest.approx(dl, rel=1e-12), name
        assert fhi == pytest.approx(dh, rel=1e-12), name


def test_ratio_interval_floors_at_zero():
    assert ratio_interval(1.5, 0.2) == (0.0, 1.2)


def test_prob_l2_interval_is_the_regularizer_bregman_bound():
    """(w p - p)^2 <= delta  <=>  |w - 1| <= sqrt(delta) / p: the prob_l2 regularizer's own
    value (p_theta - q)^2 at p_theta = w p is delta exactly at both ends."""
    from gbmpo.objectives.regularizers import prob_l2

    p = torch.tensor([0.05, 0.3, 0.5, 0.9], dtype=F64)
    lo, hi = prob_l2_interval(p, 0.01, 0.02)
    torch.testing.assert_close(lo, (1 - 0.1 / p).clamp_min(0))
    torch.testing.assert_close(hi, 1 + math.sqrt(0.02) / p)
    inside = lo > 0
    torch.testing.assert_close(
        prob_l2(torch.log(lo[inside] * p[inside]), torch.log(p[inside])),
        torch.full_like(p[inside], 0.01), rtol=1e-12, atol=0,
    )  # fmt: skip
    torch.testing.assert_close(
        prob_l2(torch.log(hi * p), torch.log(p)), torch.full_like(p, 0.02), rtol=1e-12, atol=0
    )
    assert float(lo[0]) == 0.0  # sqrt(0.01) / 0.05 = 2 > 1: no lower clip for that rare token


def test_atr_bounds_is_lambert_w():
    for d in (0.005, 0.02, 0.1):
        assert atr_bounds(d) == k3_interval(d, d)


# ---------------------------------------------------------------------------- root finder


@pytest.mark.parametrize("name", list(SCALAR))
def test_bisection_matches_closed_forms(name):
    interval, f = SCALAR[name]
    deltas = [(0.01, 0.01), (0.05, 0.2), (0.3, 0.1)]
    for dl, dh in deltas:
        lo, hi = interval(dl, dh)
        w_min = torch.tensor([1e-6], dtype=F64)
        w_max = torch.tensor([1e6], dtype=F64)
        blo, bhi = bisect_interval(f, dl, dh, w_min, w_max)
        assert float(blo) == pytest.approx(lo, rel=1e-13), (name, dl)
        assert float(bhi) == pytest.approx(hi, rel=1e-13), (name, dh)
        assert float(f(blo)) <= dl + 1e-15 and float(f(bhi)) <= dh + 1e-15


def test_bisection_matches_prob_l2_per_token():
    p = torch.tensor([1e-4, 0.01, 0.2, 0.5, 0.8], dtype=F64)
    lo, hi = prob_l2_interval(p, 0.003, 0.004)
    blo, bhi = bisect_interval(lambda w: measure_prob_l2(w, p), 0.003, 0.004, 1e-10 / p, 1 / p)
    reach = hi < 1 / p  # the closed-form end is attainable; elsewhere bisection says inf
    torch.testing.assert_close(blo, lo, rtol=1e-13, atol=0)
    torch.testing.assert_close(bhi[reach], hi[reach], rtol=1e-13, atol=0)
    assert torch.isinf(bhi[~reach]).all()


def test_mirror_interval_matches_dense_grid():
    """The bisection ends of D_h(w p, p) <= delta against a dense log grid of w: the grid's
    inside points all lie in [l, u] and the grid's extreme inside points are within one grid
    step of the ends."""
    p = torch.tensor([0.02, 0.3, 0.9], dtype=F64)
    delta = 0.01
    lo, hi = mirror_interval(p, MIRROR, delta, delta, method="bisect")
    step = 2e-4
    t = torch.linspace(-2, 2, 20_001, dtype=F64)  # log w, step 2e-4
    w = torch.exp(t)
    for i in range(len(p)):
        pi = p[i]
        ok = (w <= 1 / pi) & (measure_mirror(w, pi, MIRROR) <= delta)
        inside = w[ok]
        assert float(inside.min()) >= float(lo[i]) * (1 - 1e-12)
        if math.isfinite(float(hi[i])):
            assert float(inside.max()) <= float(hi[i]) * (1 + 1e-12)
            assert math.log(float(hi[i])) - math.log(float(inside.max())) <= step * 1.01
        else:
            assert float(measure_mirror(1 / pi, pi, MIRROR)) <= delta
        if float(lo[i]) > 0:
            assert math.log(float(inside.min())) - math.log(float(lo[i])) <= step * 1.01
        # f is at delta at every finite, non-zero end (the root)
        for end, finite in ((lo[i], float(lo[i]) > 0), (hi[i], math.isfinite(float(hi[i])))):
            if finite:
                assert float(measure_mirror(end, pi, MIRROR)) == pytest.approx(delta, rel=1e-9)


def test_bisection_tolerance_is_the_stated_one():
    """After n steps the log-bracket is width / 2^n: with few steps the error is visible and
    within the bound; with the default it is at float64 rounding."""
    w_min, w_max = torch.tensor([1e-10], dtype=F64), torch.tensor([1e10], dtype=F64)
    exact = k3_interval(0.02, 0.02)
    for n in (10, 20, 30):
        lo, hi = bisect_interval(measure_k3, 0.02, 0.02, w_min, w_max, iters=n)
        bound = math.log(1e10) / 2**n
        assert abs(math.log(float(lo)) - math.log(exact[0])) <= bound
        assert abs(math.log(float(hi)) - math.log(exact[1])) <= bound
        assert measure_k3(lo) <= 0.02 + 1e-15 and measure_k3(hi) <= 0.02 + 1e-15  # inside end
    lo, hi = bisect_interval(measure_k3, 0.02, 0.02, w_min, w_max)
    assert BISECT_ITERS == 60
    assert float(lo) == pytest.approx(exact[0], rel=4e-16)
    assert float(hi) == pytest.approx(exact[1], rel=4e-16)


def test_bisection_rejects_a_bad_bracket():
    with pytest.raises(ValueError, match="w_min <= 1 <= w_max"):
        bisect_interval(measure_k3, 0.1, 0.1, torch.tensor([1.5]), torch.tensor([2.0]))


# ----------------------------------------------------------------------------- properties

radius = st.floats(min_value=1e-4, max_value=0.5)
prob = st.floats(min_value=1e-3, max_value=0.999)


def _ends(measure: str, dl: float, dh: float, p: float) -> tuple[float, float]:
    if measure in SCALAR:
        return SCALAR[measure][0](dl, dh)
    pt = torch.tensor([p], dtype=F64)
    if measure == "prob_l2":
        lo, hi = prob_l2_interval(pt, dl, dh)
    elif measure == "dppo_tv":
        lo, hi = dppo_tv_interval(pt, dl, dh)
    elif measure == "dppo_kl":
        lo, hi = dppo_kl_interval(pt, dl, dh)
    else:
        lo, hi = mirror_interval(pt, MIRROR, dl, dh)
    return float(lo), float(hi)


@settings(max_examples=40, deadline=None)
@given(measure=st.sampled_from(CLIP_MEASURES), d1=radius, d2=radius, p=prob)
def test_interval_contains_one_and_grows_with_delta(measure, d1, d2, p):
    small, big = min(d1, d2), max(d1, d2)
    lo_s, hi_s = _ends(measure, small, small, p)
    lo_b, hi_b = _ends(measure, big, big, p)
    assert 0 <= lo_s < 1 < hi_s and 0 <= lo_b < 1 < hi_b
    assert lo_b <= lo_s and hi_b >= hi_s  # monotone in delta
    # asymmetric radii move only their own side
    lo_a, hi_a = _ends(measure, small, big, p)
    assert lo_a == lo_s and hi_a == hi_b


@settings(max_examples=30, deadline=None)
@given(p1=prob, p2=prob, d=radius)
def test_prob_l2_rarer_tokens_get_wider_intervals(p1, p2, d):
    lo1, hi1 = _ends("prob_l2", d, d, min(p1, p2))
    lo2, hi2 = _ends("prob_l2", d, d, max(p1, p2))
    assert lo1 <= lo2 and hi1 >= hi2


# ---------------------------------------------------------------------- the surrogate


def _measure_params(measure):
    delta = {"ratio": 0.2, "k1": 0.2, "k2": 0.02, "k3": 0.02, "prob_l2": 0.02,
             "neural_mirror": 0.01, "dppo_tv": 0.15, "dppo_kl": 0.05}[measure]  # fmt: skip
    params = {"measure": measure, "delta": delta}
    if measure == "neural_mirror":
        params["mirror"] = MIRROR
    return params


@pytest.mark.parametrize("measure", CLIP_MEASURES)
def test_gradient_is_exactly_zero_outside_on_the_clipped_side(measure):
    surr = get_surrogate("divergence_clip", **_measure_params(measure))
    logp, old, adv, mask = make_batch(b=8, t=9, spread=1.2)
    loss, g, diag = grad_of(surr, logp, old, adv, mask)
    lo, hi = surr.interval(torch.where(mask.bool(), old, 0.0))
    w = torch.exp(logp.detach() - old)
    a = adv[:, None].expand_as(w)
    m = mask.bool()
    up_clipped = m & (w > hi) & (a > 0)
    down_clipped = m & (w < lo) & (a < 0)
    active = m & ~up_clipped & ~down_clipped
    assert up_clipped.any() and down_clipped.any() and active.any(), measure
    assert (g[up_clipped] == 0).all() and (g[down_clipped] == 0).all()
    # elsewhere the PPO gradient -A w d log pi
    torch.testing.assert_close(g[active], -(a * w)[active], rtol=1e-12, atol=1e-12)
    assert (g[~m] == 0).all()
    # diagnostics count exactly those tokens
    n = m.sum()
    assert float(diag["clip_frac_high"]) == pytest.approx(float(up_clipped.sum() / n))
    assert float(diag["clip_frac_low"]) == pytest.approx(float(down_clipped.sum() / n))


@pytest.mark.parametrize("measure", ["ratio", "k1", "k2"])
def test_scalar_measures_equal_clip_with_their_bounds(measure):
    params = _measure_params(measure)
    surr = get_surrogate("divergence_clip", **params)
    lo, hi = surr.bounds
    ref = get_surrogate("clip", eps_low=1 - lo, eps_high=hi - 1)
    logp, old, adv, mask = make_batch(spread=0.6)
    la, ga, da = grad_of(surr, logp, old, adv, mask)
    lb, gb, db = grad_of(ref, logp, old, adv, mask)
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)
    if measure == "ratio":  # same float bounds: the very same numbers
        assert torch.equal(la, lb) and torch.equal(ga, gb)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_atr_alias_is_bit_identical(dtype, dual):
    """``atr(delta)`` and ``divergence_clip(measure="k3", delta)`` give the same bits, and both
    equal the pre-framework ATR computation: PPO's clip with the Lambert-W bounds on the
    clamped log-ratio (written out here)."""
    logp, old, adv, mask = make_batch(spread=0.9, dtype=dtype)
    atr = get_surrogate("atr", delta=0.03, dual_clip_c=dual)
    k3 = get_surrogate("divergence_clip", measure="k3", delta=0.03, dual_clip_c=dual)
    la, ga, da = grad_of(atr, logp, old, adv, mask)
    lb, gb, db = grad_of(k3, logp, old, adv, mask)
    assert torch.equal(la, lb) and torch.equal(ga, gb)
    assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)

    def before(x):
        _, log_ratio, a, m = prepare_inputs(x, old, adv, mask)
        z = -math.exp(-(1.0 + 0.03))
        lo, hi = -lambertw(z, 0).real, -lambertw(z, -1).real
        return masked_clip_loss(torch.exp(log_ratio), a, m, lo, hi, dual)

    lc, dc = before(logp)
    (gc,) = torch.autograd.grad(lc.sum(), logp)
    assert torch.equal(la, lc) and torch.equal(ga, gc)
    assert all(torch.equal(da[k], dc[k]) for k in da)


def test_per_token_bounds_differ_by_token():
    surr = get_surrogate("divergence_clip", measure="prob_l2", delta=0.01)
    old = torch.log(torch.tensor([[0.05, 0.5, 0.95]], dtype=F64))
    lo, hi = surr.interval(old)
    assert float(hi[0, 0]) > float(hi[0, 1]) > float(hi[0, 2])
    # a ratio of 1.5 is clipped for the likely token (p = 0.5, u = 1.2) but not the rare one
    logp = (old + math.log(1.5)).clone().requires_grad_()
    _, g, _ = grad_of(surr, logp[:, :2], old[:, :2], torch.ones(1, dtype=F64),
                      torch.ones(1, 2, dtype=F64))  # fmt: skip
    assert float(g[0, 0]) == pytest.approx(-1.5) and float(g[0, 1]) == 0.0


def test_neural_mirror_from_a_file(tmp_path):
    path = tmp_path / "mirror.json"
    MIRROR.save(path)
    a = get_surrogate("divergence_clip", measure="neural_mirror", delta=0.01, mirror=str(path))
    b = get_surrogate("divergence_clip", measure="neural_mirror", delta=0.01, mirror=MIRROR)
    old = torch.log(torch.tensor([[0.1, 0.4, 0.7]], dtype=F64))
    for x, y in zip(a.interval(old), b.interval(old), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("measure", CLIP_MEASURES)
def test_bf16_and_float32_inputs_are_finite(measure):
    surr = get_surrogate("divergence_clip", **_measure_params(measure))
    logp, old, adv, mask = make_batch(b=4, t=5, spread=2.0)
    x = logp.detach().to(torch.bfloat16).requires_grad_()
    loss, diag = surr(
        logp=x, old_logp=old.to(torch.bfloat16), advantages=adv.to(torch.bfloat16), mask=mask.bool()
    )
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert torch.isfinite(g).all() and all(torch.isfinite(v) for v in diag.values())


@pytest.mark.parametrize(
    "params,error,match",
    [
        ({"measure": "js", "delta": 0.1}, ValueError,
         "unknown measure 'js'; valid: dppo_kl, dppo_tv, k1, k2, k3, neural_mirror, prob_l2, "
         "ratio"),
        ({"measure": "k3"}, ValueError, "give delta"),
        ({"measure": "k3", "delta_low": 0.1}, ValueError, "give delta"),
        ({"measure": "k3", "delta": 0.0}, ValueError, "delta must be > 0"),
        ({"measure": "k1", "delta": math.nan}, ValueError, "delta must be finite"),
        ({"measure": "k1", "delta": True}, TypeError, "delta must be a number"),
        ({"measure": "k2", "delta": 0.1, "dual_clip_c": 1.0}, ValueError, "must be > 1"),
        ({"measure": "k3", "delta": 0.1, "mirror": "m.json"}, ValueError,
         "mirror is used only with measure='neural_mirror'"),
        ({"measure": "neural_mirror", "delta": 0.1, "mirror": "/nonexistent/m.json"},
         FileNotFoundError, "m.json"),
        ({"measure": "dppo_tv", "delta": 0.15, "dual_clip_c": 3.0}, ValueError,
         "truncates the importance weight instead of a dual clip"),
        ({"measure": "dppo_kl", "delta": 0.05, "is_cap": 1.0}, ValueError, "is_cap must be > 1"),
        ({"measure": "k3", "delta": 0.05, "is_cap": 20.0}, ValueError,
         "is_cap .* only with the measures dppo_kl, dppo_tv, not 'k3'"),
    ],
)  # fmt: skip
def test_bad_parameters(params, error, match):
    with pytest.raises(error, match=match):
        get_surrogate("divergence_clip", **params)


def test_asymmetric_radii_override_delta():
    s = get_surrogate("divergence_clip", measure="k1", delta=0.2, delta_high=0.3)
    assert s.bounds == (math.exp(-0.2), math.exp(0.3))
    s = get_surrogate("divergence_clip", measure="ratio", delta_low=0.2, delta_high=0.28)
    assert s.bounds == (0.8, 1.28)
    with pytest.raises(ValueError, match="per-token bounds"):
        get_surrogate("divergence_clip", measure="prob_l2", delta=0.1).bounds  # noqa: B018


def test_usable_through_the_trainer_config():
    from gbmpo.config import TrainConfig, validate

    cfg = TrainConfig()
    cfg.objective.surrogate.name = "divergence_clip"
    cfg.objective.surrogate.params = {"measure": "prob_l2", "delta": 0.01}
    validate(cfg)
    cfg.objective.surrogate.params = {"measure": "kl"}
    from gbmpo.train import ConfigError

    with pytest.raises(ConfigError, match="unknown measure 'kl'"):
        validate(cfg)


@pytest.mark.parametrize("measure", ["prob_l2", "neural_mirror"])
def test_masked_garbage_never_reaches_per_token_bounds(measure):
    surr = get_surrogate("divergence_clip", **_measure_params(measure))
    logp = torch.tensor([[-0.5, float("nan"), -math.inf]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.3, math.inf, float("nan")]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)
    loss, g, diag = grad_of(surr, logp, old, torch.ones(1, dtype=F64), mask)
    assert torch.isfinite(loss).all() and (loss[0, 1:] == 0).all()
    assert torch.isfinite(g).all() and (g[0, 1:] == 0).all() and g[0, 0] != 0
    assert all(torch.isfinite(v) for v in diag.values())


# ---------------------------------------------------------------------------------- DPPO


@settings(max_examples=30, deadline=None)
@given(p=prob, dl=radius, dh=radius)
@example(p=0.01100516717183335, dl=0.203125, dh=0.125)  # KL's lower end below 1e-10 / p
@example(p=0.9759025922295358, dl=0.5, dh=0.329489781638184)  # KL's upper end 3.5e-10 below 1/p
@example(p=0.3670359937152179, dl=0.0001, dh=0.5)  # KL's lower end where f is flat
def test_dppo_intervals_are_the_measure_level_sets(p, dl, dh):
    """TV closed form and KL bisection: f(l) = delta_low, f(u) = delta_high where finite and
    inside (0, 1/p], f <= delta inside. The bisection's ends are checked as brackets: the end
    is inside (f <= delta) and the level set is crossed within the bisection's stated error in
    log w (2^-iters log(w_max / w_min)); near 1/p the binary KL is so steep (slope ~1e8 per
    unit of w) that an end exact to that error can miss delta by 1e-9 relative in f."""
    pt = torch.tensor([p], dtype=F64)
    lo, hi = dppo_tv_interval(pt, dl, dh)
    if float(lo) > 0:
        assert float(measure_dppo_tv(lo, pt)) == pytest.approx(dl, rel=1e-9)
    if math.isfinite(float(hi)) and float(hi) < 1 / p:
        assert float(measure_dppo_tv(hi, pt)) == pytest.approx(dh, rel=1e-9)
    step = math.exp(2.0**-BISECT_ITERS * math.log((1 / p) / DPPO_KL_W_MIN))
    lo, hi = dppo_kl_interval(pt, dl, dh)
    for end, delta, outward in ((lo, dl, 1 / step), (hi, dh, step)):
        w = float(end)
        if w > 0 and math.isfinite(w) and w < 1 / p:
            inside = float(measure_dppo_kl(end, pt))
            beyond = float(measure_dppo_kl(torch.tensor([min(w * outward**2, 1 / p)], dtype=F64),
                                           pt))  # fmt: skip
            # 1e-9 relative: the binary KL's own float64 rounding (~1e-15 absolute) at radii
            # down to 1e-4 is ~1e-11 of the radius
            assert inside <= delta * (1 + 1e-9) and beyond >= delta * (1 - 1e-9), (w, inside)
    for interval, f in ((dppo_tv_interval, measure_dppo_tv), (dppo_kl_interval, measure_dppo_kl)):
        lo, hi = interval(pt, dl, dh)
        inside = torch.linspace(max(float(lo), 1e-9), min(float(hi), 1 / p), 101, dtype=F64)
        assert bool((f(inside, pt) <= max(dl, dh) * (1 + 1e-9)).all())


def test_dppo_tv_interval_closed_form():
    lo, hi = dppo_tv_interval(torch.tensor([0.5, 0.05], dtype=F64), 0.15, 0.2)
    torch.testing.assert_close(lo, torch.tensor([0.7, 0.0], dtype=F64))
    torch.testing.assert_close(hi, torch.tensor([1.4, 5.0], dtype=F64))


def test_dppo_mask_reads_the_probability_move_not_the_ratio():
    """DPPO's point: a rare token may multiply its probability (ratio 100, TV 1e-3) and keep its
    gradient, a likely one loses it for a small ratio move (0.99 -> 0.8: ratio 0.81, TV 0.19)."""
    old = torch.log(torch.tensor([[1e-5, 0.99]], dtype=F64))
    new = torch.log(torch.tensor([[1e-3, 0.8]], dtype=F64))
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    for measure, delta in (("dppo_tv", 0.15), ("dppo_kl", 0.05)):
        valid = dppo_valid_mask(measure, new, old, adv, delta, delta)
        assert valid.tolist() == [[True, False]], measure
    # the ratio clip does the opposite
    w = torch.exp(new - old)
    assert float(w[0, 0]) > 1.28 and float(w[0, 1]) > 0.8


@pytest.mark.parametrize("measure", ["dppo_tv", "dppo_kl"])
def test_dppo_truncated_weight_keeps_the_gradient_at_the_cap(measure):
    """With is_cap=C a kept token whose ratio exceeds C has gradient -A C (truncated IS), not 0
    (a dual clip would remove it); the value is -A SG(min(w, C)) log pi."""
    old = torch.log(torch.tensor([[0.001, 0.001, 0.3]], dtype=F64))
    logp = torch.log(torch.tensor([[0.006, 0.002, 0.32]], dtype=F64)).requires_grad_()
    adv = torch.tensor([-1.0], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    surr = get_surrogate("divergence_clip", measure=measure, delta=0.15 if measure == "dppo_tv"
                         else 0.05, is_cap=3.0)  # fmt: skip
    loss, g, diag = grad_of(surr, logp, old, adv, mask)
    w = torch.exp(logp.detach() - old)
    torch.testing.assert_close(
        g, torch.stack([torch.tensor(3.0, dtype=F64), w[0, 1], w[0, 2]])[None]
    )
    torch.testing.assert_close(loss, (torch.minimum(w, torch.tensor(3.0)) * logp.detach()))
    assert float(diag["clip_frac_dual"]) == pytest.approx(1 / 3)
    # no cap: the plain ratio
    free = get_surrogate("divergence_clip", measure=measure, delta=0.15 if measure == "dppo_tv"
                         else 0.05)  # fmt: skip
    _, g_free, _ = grad_of(free, logp, old, adv, mask)
    torch.testing.assert_close(g_free, w)


# ------------------------------------------------- neural_mirror: the table against bisection


@pytest.mark.parametrize(
    ("scale", "seed", "dl", "dh"),
    [(0.01, 42, 0.01, 0.01), (0.5, 3, 0.01, 0.02), (0.5, 3, 0.3, 0.5), (2.0, 1, 0.05, 0.05)],
)
def test_mirror_interval_table_matches_bisection(scale, seed, dl, dh):
    """The default (table) ends against the per-token bisection on tokens over the whole
    [1e-10, 1] range: the same 0 / inf decisions, lower ends within tol absolute (they lie in
    [0, 1]) and upper ends within tol in log w (tol = MIRROR_TABLE_TOL = 1e-8; 2x slack for
    points between the checked midpoints)."""
    mirror = NeuralMirrorMap.random(scale=scale, seed=seed)
    g = torch.Generator().manual_seed(seed)
    p = torch.cat([torch.exp(-23.0 * torch.rand(3000, generator=g, dtype=F64)),
                   torch.rand(1000, generator=g, dtype=F64)])  # fmt: skip
    lt, ht = mirror_interval(p, mirror, dl, dh)
    lb, hb = mirror_interval(p, mirror, dl, dh, method="bisect")
    assert torch.equal(lt == 0, lb == 0) and torch.equal(torch.isinf(ht), torch.isinf(hb))
    assert float((lt - lb).abs().max()) <= 2 * MIRROR_TABLE_TOL
    fin = torch.isfinite(hb)
    assert float((ht[fin].log() - hb[fin].log()).abs().max()) <= 2 * MIRROR_TABLE_TOL
    # and the measure at the table's finite ends is delta to the same order
    for end, radius in ((lt, dl), (ht, dh)):
        ok = torch.isfinite(end) & (end > 0)
        f = measure_mirror(end[ok], p[ok], mirror)
        assert float(((f - radius) / radius).abs().max()) < 1e-6


def test_mirror_interval_tolerance_and_method_are_checked():
    p = torch.tensor([0.3], dtype=F64)
    with pytest.raises(ValueError, match="valid: table, bisect"):
        mirror_interval(p, MIRROR, 0.01, 0.01, method="newton")
    with pytest.raises(ValueError, match="tol"):
        mirror_interval(p, MIRROR, 0.01, 0.01, tol=-1.0)
    coarse = mirror_interval(p, MIRROR, 0.01, 0.01, tol=1e-4)
    exact = mirror_interval(p, MIRROR, 0.01, 0.01, method="bisect")
    for a, b in zip(coarse, exact, strict=True):
        assert abs(math.log(float(a)) - math.log(float(b))) <= 2e-4


def test_mirror_interval_table_next_to_the_lower_threshold():
    """Just above p* (where the lower end leaves 0 and the root leaves the floor like the inverse
    of y log y) the log-graded table holds the same tolerance against bisection."""
    from gbmpo.objectives.clip_bisection import _mirror_end_table

    mirror = NeuralMirrorMap.random(scale=0.5, seed=3)
    table = _mirror_end_table(mirror, "low", 0.01, MIRROR_TABLE_TOL)
    assert table.graded_length > 0 and table.bad_cells == 0
    gaps = table.graded_length * torch.logspace(-14, 0, 200, dtype=F64)
    p = torch.exp(math.log(table.p_star) + gaps)
    p = torch.cat([p, torch.tensor([table.p_star * (1 - 1e-12), table.p_star], dtype=F64)])
    lt, _ = mirror_interval(p, mirror, 0.01, 0.02)
    lb, _ = mirror_interval(p, mirror, 0.01, 0.02, method="bisect")
    assert torch.equal(lt == 0, lb == 0) and float(lt[-2:].abs().max()) == 0.0
    assert float((lt - lb).abs().max()) <= 2 * MIRROR_TABLE_TOL


def test_measures_are_a_registry_that_a_plugin_can_extend():
    """The measures are ``CLIP_MEASURE_REGISTRY`` entries, like every other named piece: the
    built-in ones match the documented tuples, an unknown name lists the valid ones, and a
    registered measure is usable by ``divergence_clip`` without touching the surrogate."""
    from gbmpo.objectives.clip_measures import (
        CLIP_MEASURE_REGISTRY,
        CLIP_MEASURES,
        DPPO_MEASURES,
        PER_TOKEN_MEASURES,
        ClipMeasure,
        ratio_interval,
    )
    from gbmpo.registry import UnknownNameError

    assert set(CLIP_MEASURE_REGISTRY.names()) == set(CLIP_MEASURES)
    assert {n for n in CLIP_MEASURES if CLIP_MEASURE_REGISTRY.get(n).per_token} == set(
        PER_TOKEN_MEASURES)  # fmt: skip
    assert {n for n in CLIP_MEASURES if CLIP_MEASURE_REGISTRY.get(n).dppo} == set(DPPO_MEASURES)
    with pytest.raises(UnknownNameError, match="unknown clip measure 'js'; valid names: dppo_kl"):
        CLIP_MEASURE_REGISTRY.get("js")
    with pytest.raises(ValueError, match="exactly one of bounds, interval"):
        ClipMeasure("both")

    def half_ratio(lo: float, hi: float) -> tuple[float, float]:  # the ratio clip at delta / 2
        return ratio_interval(lo / 2, hi / 2)

    measure = ClipMeasure("half_ratio_test", bounds=half_ratio)
    CLIP_MEASURE_REGISTRY.register("half_ratio_test", measure)
    try:
        s = get_surrogate("divergence_clip", measure="half_ratio_test", delta=0.4)
        ref = get_surrogate("divergence_clip", measure="ratio", delta=0.2)
        assert s.bounds == ref.bounds == (0.8, 1.2)
        g = torch.Generator().manual_seed(0)
        logp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
        old = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
        kw = {"old_logp": old, "advantages": torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64),
              "mask": torch.ones(3, 5, dtype=torch.float64)}  # fmt: skip
        a, _ = s(logp=logp, **kw)
        b, _ = ref(logp=logp, **kw)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        CLIP_MEASURE_REGISTRY._items.pop("half_ratio_test")
