import math

import pytest
import torch

from gbmpo.objectives import (
    LossTerm,
    aggregate,
    compute_policy_loss,
    get_regularizer,
    get_surrogate,
)
from gbmpo.registry import UnknownNameError

F64 = torch.float64


def batch(b=6, t=5, spread=0.15, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=F64) * 2 - 0.05).requires_grad_()
    old = logp.detach() + spread * (torch.rand(b, t, generator=g, dtype=F64) * 2 - 1)
    ref = logp.detach() + 0.5 * (torch.rand(b, t, generator=g, dtype=F64) * 2 - 1)
    adv = torch.randn(b, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    return logp, old, ref, adv, mask


def _token_weights(kind):
    """None, [B, T] or per-sequence [B, 1] surrogate weights for the analytic-gradient test."""
    g = torch.Generator().manual_seed(7)
    w = 0.5 + torch.rand(6, 5, generator=g, dtype=F64)
    return {"none": None, "token": w, "sequence": w[:, :1]}[kind]


@pytest.mark.parametrize("weights", ["none", "token", "sequence"])
def test_prob_l2_loss_gradient_matches_analytic(weights):
    """Inside the clip region d/dlogp [w (-r A) + lam (p - q)^2] = -w A r + lam 2 (p - q) p
    (w = 1 without token weights)."""
    logp, old, ref, adv, mask = batch()
    coef = 0.3
    tw = _token_weights(weights)
    w_tok = torch.ones(6, 5, dtype=F64) if tw is None else tw.expand(6, 5)
    loss, metrics = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate=get_surrogate("clip", eps_low=0.2, eps_high=0.28),
        terms=[LossTerm("prob_l2", get_regularizer("prob_l2"), coef, ref)],
        aggregation="dr_grpo",
        max_len=8,
        token_weights=tw,
    )
    (g,) = torch.autograd.grad(loss, logp)
    r = torch.exp(logp.detach() - old)  # spread 0.15: every ratio inside (0.8, 1.28)
    p, q = logp.detach().exp(), ref.exp()
    per_token_grad = -w_tok * adv[:, None] * r + coef * 2 * (p - q) * p
    torch.testing.assert_close(g, per_token_grad * mask / (6 * 8))
    # metrics
    assert metrics["reg_value"] == pytest.approx(float(((p - q) ** 2 * mask).sum() / mask.sum()))
    pg, _ = get_surrogate("clip", eps_low=0.2, eps_high=0.28)(
        logp=logp, old_logp=old, advantages=adv, mask=mask
    )
    weighted = (w_tok * pg).detach()
    assert metrics["pg_loss"] == pytest.approx(float(aggregate(weighted, mask, "dr_grpo", 8)))
    reg_term = coef * ((p - q) ** 2)
    assert metrics["reg_loss"] == pytest.approx(float(aggregate(reg_term, mask, "dr_grpo", 8)))
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + metrics["reg_loss"])
    assert metrics["loss"] == pytest.approx(float(loss.detach()))
    assert {"clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max"} <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())


def test_names_are_resolved_through_the_registries():
    logp, old, ref, adv, mask = batch()
    by_name, m1 = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate="clip",
        terms=[LossTerm("kl_k3", "kl_k3", 0.1, ref)],
        aggregation="bnpo",
    )
    by_obj, m2 = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate=get_surrogate("clip"),
        terms=[LossTerm("kl_k3", get_regularizer("kl_k3"), 0.1, ref)],
        aggregation="bnpo",
    )
    torch.testing.assert_close(by_name, by_obj)
    assert m1 == m2
    with pytest.raises(UnknownNameError, match="valid names: atr, cispo, clip"):
        compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            surrogate="ppo",
            terms=(),
        )
    with pytest.raises(UnknownNameError, match="valid names"):
        compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            surrogate="clip",
            terms=[LossTerm("kl_k9", "kl_k9", 0.0, ref)],
        )
    with pytest.raises(UnknownNameError, match="valid names: bnpo"):
        compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            surrogate="clip",
            terms=(),
            aggregation="mean",
        )


def test_reference_requirements():
    logp, old, _, adv, mask = batch()
    with pytest.raises(ValueError, match="needs anchor log-probs"):
        compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            surrogate="clip",
            terms=[LossTerm("prob_l2", "prob_l2", 0.1, None)],
        )
    # needs_ref False: no reference needed
    loss, metrics = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate="clip",
        terms=[LossTerm("none", "none", 0.1, None)],
    )
    assert metrics["reg_value"] == 0.0 and torch.isfinite(loss)
    loss2, _ = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate="clip",
        terms=(),
    )
    torch.testing.assert_close(loss, loss2)
    for bad in (LossTerm("none", "none", 0.1, None), [("prob_l2", 0.1)]):
        with pytest.raises(TypeError, match="sequence of LossTerm"):
            compute_policy_loss(
                logp=logp, old_logp=old, advantages=adv, mask=mask, surrogate="clip", terms=bad
            )
    with pytest.raises(ValueError, match="coef"):
        compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            surrogate="clip",
            terms=[LossTerm("none", "none", math.nan, None)],
        )


def test_reg_loss_survives_a_surrogate_far_larger_in_float32():
    """In float32, ``loss - pg_loss`` rounds a regularizer term below one ulp of the surrogate to
    0 (here ~2e-12 against ~1.4); ``reg_loss`` is aggregated on its own and keeps it."""
    logp, old, _, adv, mask = (x.detach().float() for x in batch())
    adv = adv.abs() + 1.0
    ref = logp + 1e-4  # a tiny ProbL2 divergence
    loss, m = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate="clip",
        terms=[LossTerm("prob_l2", "prob_l2", 1e-3, ref)],
        aggregation="bnpo",
    )
    p, q = logp.exp(), ref.exp()
    expected = float(aggregate(1e-3 * (p - q) ** 2, mask, "bnpo"))
    assert 0 < expected < 1e-7 * abs(m["pg_loss"])
    assert m["reg_loss"] == pytest.approx(expected, rel=1e-5)


def test_coef_zero_reports_but_does_not_add_the_regularizer():
    logp, old, ref, adv, mask = batch()
    with_reg, m = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate="clip",
        terms=[LossTerm("prob_l2", "prob_l2", 0.0, ref)],
    )
    without, _ = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate="clip",
        terms=(),
    )
    torch.testing.assert_close(with_reg, without)
    assert m["reg_value"] > 0


@pytest.mark.parametrize("variant", ["ufkl", "urkl", "fkl", "rkl"])
def test_rpg_fully_differentiable_equals_rpg_reinforce(variant):
    """RPG Prop. 4.1 through the full loss: dual-clip surrogate + beta * RPG KL term anchored
    at pi_old (Table 1, the authors' code form) vs RPG-REINFORCE (Table 2), inside the trust
    region."""
    logp, old, _, adv, mask = batch(b=8, t=6, seed=3)
    beta = 0.4
    kw = {"aggregation": "bnpo"}
    fd, _ = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate=get_surrogate("rpg_clip", c=3.0),
        terms=[LossTerm(f"rpg_{variant}", get_regularizer(f"rpg_{variant}"), beta, old)],
        **kw,
    )
    rf, m = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate=get_surrogate("rpg_reinforce", variant=variant, beta=beta),
        terms=(),
        **kw,
    )
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    (g_fd,) = torch.autograd.grad(fd, logp)
    (g_rf,) = torch.autograd.grad(rf, logp)
    torch.testing.assert_close(g_fd, g_rf)


def test_local_callable_regularizer_and_on_policy_default():
    logp, _, _, adv, mask = batch()

    class Entropyish:
        needs_ref = False

        def __call__(self, logp, anchor_logp, old_logp, mask):
            assert anchor_logp is None and old_logp is not None
            return -logp.to(torch.float64)

    loss, metrics = compute_policy_loss(
        logp=logp,
        old_logp=None,
        advantages=adv,
        mask=mask,
        surrogate="clip",
        terms=[LossTerm("entropyish", Entropyish(), 0.5, None)],
        aggregation="grpo",
    )
    (g,) = torch.autograd.grad(loss, logp)
    lengths = mask.sum(-1, keepdim=True)
    torch.testing.assert_close(g, (-adv[:, None] - 0.5) * mask / lengths / 6)
    assert metrics["ratio_mean"] == 1.0


def test_micro_batches_through_compute_policy_loss():
    logp, old, ref, adv, mask = batch(b=8, t=6, spread=0.5, seed=4)
    kw = {"surrogate": "clip", "max_len": 6}
    for mode in ("grpo", "bnpo", "dr_grpo", "seq_mean_token_sum"):
        full, _ = compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            terms=[LossTerm("kl_k3", "kl_k3", 0.2, ref)],
            aggregation=mode,
            **kw,
        )
        (g_full,) = torch.autograd.grad(full, logp)
        parts = [
            compute_policy_loss(
                logp=logp[r],
                old_logp=old[r],
                advantages=adv[r],
                mask=mask[r],
                terms=[LossTerm("kl_k3", "kl_k3", 0.2, ref[r])],
                aggregation=mode,
                num_sequences=8,
                num_tokens=float(mask.sum()),
                **kw,
            )[0]
            for r in torch.arange(8).chunk(4)
        ]
        total = torch.stack(parts).sum()
        torch.testing.assert_close(total, full)
        (g_micro,) = torch.autograd.grad(total, logp)
        torch.testing.assert_close(g_micro, g_full)


def test_bf16_inputs_give_finite_float32_loss():
    logp, old, ref, adv, mask = batch(spread=2.0)
    x = logp.detach().to(torch.bfloat16).requires_grad_()
    for reg in ("prob_l2", "kl_k3", "neural_mirror"):
        loss, metrics = compute_policy_loss(
            logp=x,
            old_logp=old.to(torch.bfloat16),
            advantages=adv.to(torch.bfloat16),
            mask=mask.bool(),
            surrogate="gspo",
            terms=[LossTerm(reg, reg, 0.1, ref.to(torch.bfloat16))],
            aggregation="grpo",
        )
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        assert all(math.isfinite(v) for v in metrics.values())
        (g,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(g).all()


# --- token_weights: multiply the surrogate only (TRL's IS ratio / masks) ----------------------


def _weights(b=6, t=5, seed=7):
    g = torch.Generator().manual_seed(seed)
    return 0.5 + torch.rand(b, t, generator=g, dtype=F64)


@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "seq_mean_token_sum"])
def test_token_weights_of_ones_equal_none(aggregation):
    logp, old, ref, adv, mask = batch(spread=0.6)  # some tokens clipped
    kw = {"surrogate": "clip", "terms": [LossTerm("kl_k3", "kl_k3", 0.1, ref)],
          "aggregation": aggregation}
    base, m0 = compute_policy_loss(logp=logp, old_logp=old, advantages=adv, mask=mask, **kw)
    (g0,) = torch.autograd.grad(base, logp)
    for ones in (torch.ones_like(mask), torch.ones(6, 1, dtype=torch.bool)):
        loss, m1 = compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            token_weights=ones,
            **kw,
        )
        (g1,) = torch.autograd.grad(loss, logp)
        assert torch.equal(loss, base) and torch.equal(g1, g0)
        assert m1 == m0


def test_token_weights_by_hand_float64():
    """L = sum_{i,t} m (w * -min(r A, clip(r) A) + lam * k3) / Z, weights on the surrogate only."""
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.9, -0.5, -2.2], [-0.3, -1.0, 0.0]], dtype=F64)  # r[0, 0] clipped
    ref = torch.tensor([[-0.4, -1.3, -1.5], [-0.2, -0.9, 0.0]], dtype=F64)
    adv = torch.tensor([1.5, -0.8], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    w = torch.tensor([[0.5, 2.0, 1.25], [0.0, 3.0, math.nan]], dtype=F64)  # NaN on padding
    lam, z = 0.3, 4.0
    loss, metrics = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        surrogate=get_surrogate("clip", eps_low=0.2, eps_high=0.28),
        terms=[LossTerm("kl_k3", "kl_k3", lam, ref)],
        aggregation="bnpo",
        num_tokens=z,
        token_weights=w,
    )
    lp = logp.detach()
    expected_pg, expected_reg = 0.0, 0.0
    for i in range(2):
        for t in range(3):
            if mask[i, t] == 0:
                continue
            r = math.exp(float(lp[i, t] - old[i, t]))
            a = float(adv[i])
            surr = -min(r * a, min(max(r, 0.8), 1.28) * a)
            d = float(ref[i, t] - lp[i, t])
            expected_pg += float(w[i, t]) * surr
            expected_reg += math.exp(d) - d - 1.0
    assert float(loss.detach()) == pytest.approx((expected_pg + lam * expected_reg) / z, rel=1e-13)
    assert metrics["pg_loss"] == pytest.approx(expected_pg / z, rel=1e-13)
    assert metrics["clip_frac_high"] > 0  # the clipped branch is covered
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g).all() and float(g[1, 2]) == 0.0


def test_token_weights_do_not_multiply_the_regularizer():
    logp, old, ref, _, mask = batch()
    zero_adv = torch.zeros(6, dtype=F64)  # surrogate 0: only the regularizer is left
    kw = {"surrogate": "clip", "terms": [LossTerm("kl_k3", "kl_k3", 0.2, ref)],
          "aggregation": "bnpo"}
    plain, _ = compute_policy_loss(logp=logp, old_logp=old, advantages=zero_adv, mask=mask, **kw)
    weighted, m = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=zero_adv,
        mask=mask,
        token_weights=3.0 * _weights(),
        **kw,
    )
    torch.testing.assert_close(weighted, plain)
    assert m["pg_loss"] == 0.0


def test_per_sequence_token_weights_broadcast():
    logp, old, ref, adv, mask = batch(spread=0.6)
    kw = {"surrogate": "clip", "terms": [LossTerm("kl_k3", "kl_k3", 0.1, ref)],
          "aggregation": "grpo"}
    col = _weights()[:, :1]
    a, ma = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        token_weights=col,
        **kw,
    )
    b, mb = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        token_weights=col.expand(6, 5),
        **kw,
    )
    assert torch.equal(a, b) and ma == mb


def test_token_weights_errors_name_the_parameter():
    logp, old, ref, adv, mask = batch()
    kw = {"surrogate": "clip"}
    for bad in (torch.ones(6), torch.ones(6, 4), torch.ones(5, 5), torch.ones(1, 6, 5)):
        with pytest.raises(ValueError, match="token_weights must be"):
            compute_policy_loss(
                logp=logp,
                old_logp=old,
                advantages=adv,
                mask=mask,
                token_weights=bad,
                **kw,
            )
    with pytest.raises(TypeError, match="token_weights"):
        compute_policy_loss(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            token_weights=[[1.0] * 5] * 6,
            **kw,
        )


def test_num_tokens_below_local_count_through_compute_policy_loss():
    """bnpo with Z below this batch's token count: loss and gradient are the token sum / Z,
    i.e. the default (local token mean) times local / Z."""
    logp, old, ref, adv, mask = batch()
    kw = {"surrogate": "clip", "terms": [LossTerm("kl_k3", "kl_k3", 0.1, ref)],
          "aggregation": "bnpo"}
    local = float(mask.sum())
    z = local / 3.0
    mean, m0 = compute_policy_loss(logp=logp, old_logp=old, advantages=adv, mask=mask, **kw)
    (g_mean,) = torch.autograd.grad(mean, logp)
    loss, m1 = compute_policy_loss(
        logp=logp,
        old_logp=old,
        advantages=adv,
        mask=mask,
        num_tokens=z,
        **kw,
    )
    (g,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, mean * (local / z))
    torch.testing.assert_close(g, g_mean * (local / z))
    assert m1["pg_loss"] == pytest.approx(m0["pg_loss"] * local / z, rel=1e-12)
    for bad in (0.0, -2.0, math.nan):
        with pytest.raises(ValueError, match="num_tokens"):
            compute_policy_loss(
                logp=logp,
                old_logp=old,
                advantages=adv,
                mask=mask,
                num_tokens=bad,
                **kw,
            )
