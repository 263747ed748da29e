import math

import pytest
import torch

from gbmpo.objectives import aggregate, compute_policy_loss, get_regularizer, get_surrogate
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


def test_prob_l2_loss_gradient_matches_analytic():
    logp, old, ref, adv, mask = batch()
    coef = 0.3
    loss, metrics = compute_policy_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        surrogate=get_surrogate("clip", eps_low=0.2, eps_high=0.28),
        regularizer=get_regularizer("prob_l2"),
        coef=coef,
        aggregation="dr_grpo",
        max_len=8,
    )
    (g,) = torch.autograd.grad(loss, logp)
    w = torch.exp(logp.detach() - old)  # spread 0.15: every ratio inside (0.8, 1.28)
    p, q = logp.detach().exp(), ref.exp()
    per_token_grad = -adv[:, None] * w + coef * 2 * (p - q) * p
    torch.testing.assert_close(g, per_token_grad * mask / (6 * 8))
    # metrics
    assert metrics["reg_value"] == pytest.approx(float(((p - q) ** 2 * mask).sum() / mask.sum()))
    pg, _ = get_surrogate("clip", eps_low=0.2, eps_high=0.28)(logp, old, adv, mask)
    assert metrics["pg_loss"] == pytest.approx(float(aggregate(pg.detach(), mask, "dr_grpo", 8)))
    assert metrics["loss"] == pytest.approx(float(loss.detach()))
    assert {"clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max"} <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())


def test_names_are_resolved_through_the_registries():
    logp, old, ref, adv, mask = batch()
    by_name, m1 = compute_policy_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        surrogate="clip",
        regularizer="kl_k3",
        coef=0.1,
        aggregation="bnpo",
    )
    by_obj, m2 = compute_policy_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        surrogate=get_surrogate("clip"),
        regularizer=get_regularizer("kl_k3"),
        coef=0.1,
        aggregation="bnpo",
    )
    torch.testing.assert_close(by_name, by_obj)
    assert m1 == m2
    with pytest.raises(UnknownNameError, match="valid names: atr, clip"):
        compute_policy_loss(logp, old, ref, adv, mask, surrogate="ppo", regularizer=None)
    with pytest.raises(UnknownNameError, match="valid names"):
        compute_policy_loss(logp, old, ref, adv, mask, surrogate="clip", regularizer="kl_k9")
    with pytest.raises(UnknownNameError, match="valid names: bnpo"):
        compute_policy_loss(
            logp, old, ref, adv, mask, surrogate="clip", regularizer=None, aggregation="mean"
        )


def test_reference_requirements():
    logp, old, _, adv, mask = batch()
    with pytest.raises(ValueError, match="ref_logp"):
        compute_policy_loss(
            logp, old, None, adv, mask, surrogate="clip", regularizer="prob_l2", coef=0.1
        )
    # needs_ref False: no reference needed
    loss, metrics = compute_policy_loss(
        logp, old, None, adv, mask, surrogate="clip", regularizer="none", coef=0.1
    )
    assert metrics["reg_value"] == 0.0 and torch.isfinite(loss)
    loss2, _ = compute_policy_loss(logp, old, None, adv, mask, surrogate="clip", regularizer=None)
    torch.testing.assert_close(loss, loss2)
    with pytest.raises(ValueError, match="regularizer is None"):
        compute_policy_loss(
            logp, old, None, adv, mask, surrogate="clip", regularizer=None, coef=0.1
        )
    with pytest.raises(ValueError, match="coef"):
        compute_policy_loss(
            logp, old, None, adv, mask, surrogate="clip", regularizer="none", coef=math.nan
        )


def test_coef_zero_reports_but_does_not_add_the_regularizer():
    logp, old, ref, adv, mask = batch()
    with_reg, m = compute_policy_loss(
        logp, old, ref, adv, mask, surrogate="clip", regularizer="prob_l2", coef=0.0
    )
    without, _ = compute_policy_loss(logp, old, ref, adv, mask, surrogate="clip", regularizer=None)
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
        logp,
        old,
        None,
        adv,
        mask,
        surrogate=get_surrogate("rpg_clip", c=3.0),
        regularizer=get_regularizer(f"rpg_{variant}", anchor="old"),
        coef=beta,
        **kw,
    )
    rf, m = compute_policy_loss(
        logp,
        old,
        None,
        adv,
        mask,
        surrogate=get_surrogate("rpg_reinforce", variant=variant, beta=beta),
        regularizer=None,
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

        def __call__(self, logp, ref_logp, old_logp, mask):
            assert ref_logp is None and old_logp is not None
            return -logp.to(torch.float64)

    loss, metrics = compute_policy_loss(
        logp,
        None,
        None,
        adv,
        mask,
        surrogate="clip",
        regularizer=Entropyish(),
        coef=0.5,
        aggregation="grpo",
    )
    (g,) = torch.autograd.grad(loss, logp)
    lengths = mask.sum(-1, keepdim=True)
    torch.testing.assert_close(g, (-adv[:, None] - 0.5) * mask / lengths / 6)
    assert metrics["ratio_mean"] == 1.0


def test_micro_batches_through_compute_policy_loss():
    logp, old, ref, adv, mask = batch(b=8, t=6, spread=0.5, seed=4)
    kw = {"surrogate": "clip", "regularizer": "kl_k3", "coef": 0.2, "max_len": 6}
    for mode in ("grpo", "bnpo", "dr_grpo", "seq_mean_token_sum"):
        full, _ = compute_policy_loss(logp, old, ref, adv, mask, aggregation=mode, **kw)
        (g_full,) = torch.autograd.grad(full, logp)
        parts = [
            compute_policy_loss(
                logp[r],
                old[r],
                ref[r],
                adv[r],
                mask[r],
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
            x,
            old.to(torch.bfloat16),
            ref.to(torch.bfloat16),
            adv.to(torch.bfloat16),
            mask.bool(),
            surrogate="gspo",
            regularizer=reg,
            coef=0.1,
            aggregation="grpo",
        )
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        assert all(math.isfinite(v) for v in metrics.values())
        (g,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(g).all()
