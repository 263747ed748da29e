"""Parity of gbmpo's baseline surrogates and DPPO measures with verl 0.9's own policy losses.

verl's registered functions (``cispo``, ``sapo``, ``geo_mean``, ``dppo_tv``, ``dppo_kl``) are
called through ``core_algos.get_policy_loss_fn`` with an ``FSDPActorConfig``; gbmpo's
:func:`gbmpo.objectives.compute_policy_loss` (its own aggregation) must give the same loss and
gradient with respect to the log-probs, in float64, to 1e-7, and the gbmpo verl plugin
(``gbmpo_<name>``) the same through verl's interface. The tolerance is set by verl's 1e-8 added
to its token counts (``seq-mean-token-mean``, ``geo_mean``): gbmpo divides by the count itself,
a relative difference of 1e-8 / n per sequence (measured: up to 3e-8); elsewhere the two agree to
float64 rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("verl")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

import gbmpo.integrations.verl as gv  # noqa: E402
from gbmpo.objectives import compute_policy_loss, get_surrogate  # noqa: E402
from parity_record import record  # noqa: E402

F64 = torch.float64
TOL = 1e-7
#: verl loss_agg_mode -> gbmpo aggregation (no empty rows in these batches)
AGG = {
    "token-mean": "bnpo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "seq_mean_token_sum",
}


def _batch(seed: int, b: int = 8, t: int = 10, spread: float = 0.5) -> dict[str, Tensor]:
    """float64 log-probs with both likely and rare tokens (DPPO's masks depend on p), some big
    ratio moves (truncation, clips) and advantages of both signs, one of them 0."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, t + 1, (b,), generator=g)
    lens[0] = t
    mask = torch.arange(t)[None, :] < lens[:, None]
    old = torch.log(torch.rand(b, t, generator=g, dtype=F64).clamp_min(1e-4))
    delta = torch.randn(b, t, generator=g, dtype=F64) * spread
    big = torch.rand(b, t, generator=g) < 0.1
    delta = torch.where(big, torch.full_like(delta, 2.5), delta)
    logp = (old + delta).clamp(max=-1e-6)
    adv = torch.randn(b, generator=g, dtype=F64)
    adv[2] = 0.0
    return {"logp": logp, "old": old, "adv": adv[:, None].expand(b, t).contiguous(),
            "mask": mask}  # fmt: skip


def _config(mode: str, loss_mode: str = "vanilla", **kw: Any) -> FSDPActorConfig:
    policy_loss = None
    if loss_mode.startswith(gv.PREFIX):
        policy_loss = gv.GBMPOPolicyLossConfig(
            loss_mode=loss_mode, gbmpo_surrogate=kw.pop("gbmpo_surrogate", {})
        )
    extra = {} if policy_loss is None else {"policy_loss": policy_loss}
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           loss_agg_mode=mode, **extra, **kw)  # fmt: skip


def _verl(
    x: dict[str, Tensor], loss_mode: str, mode: str, **cfg: Any
) -> tuple[Tensor, Tensor, dict]:
    lp = x["logp"].clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(
        old_log_prob=x["old"], log_prob=lp, advantages=x["adv"], response_mask=x["mask"].to(F64),
        loss_agg_mode=mode, config=_config(mode, loss_mode, **cfg), rollout_is_weights=None,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, metrics


def _ours(x: dict[str, Tensor], surrogate: Any, aggregation: str) -> tuple[Tensor, Tensor, dict]:
    lp = x["logp"].clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        logp=lp,
        old_logp=x["old"],
        advantages=x["adv"],
        mask=x["mask"],
        surrogate=surrogate,
        terms=(),
        aggregation=aggregation,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, metrics


def _same(a: tuple[Tensor, Tensor, Any], b: tuple[Tensor, Tensor, Any]) -> None:
    assert a[1].abs().max() > 1e-3, "degenerate case: verl's gradient is ~0"
    dl, dg = float((a[0] - b[0]).abs()), float((a[1] - b[1]).abs().max())
    assert dl <= TOL and dg <= TOL, (dl, dg)
    record(dl, dg)


@pytest.mark.parametrize("mode", list(AGG))
@pytest.mark.parametrize("low,high", [(0.2, 0.28), (1.0, 4.0)])
def test_cispo_equals_verl(mode: str, low: float, high: float) -> None:
    x = _batch(seed=1)
    ref = _verl(x, "cispo", mode, clip_ratio_low=low, clip_ratio_high=high)
    if low < 1.0:
        assert ref[2]["actor/pg_clipfrac"] > 0.05  # the clip binds
    _same(ref, _ours(x, get_surrogate("cispo", eps_low=low, eps_high=high), AGG[mode]))


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (2.0, 4.0)])
def test_sapo_equals_verl(tau_pos: float, tau_neg: float) -> None:
    """verl's SAPO always aggregates seq-mean-token-mean (gbmpo ``grpo``)."""
    x = _batch(seed=2)
    ref = _verl(x, "sapo", "token-mean", tau_pos=tau_pos, tau_neg=tau_neg)
    _same(ref, _ours(x, get_surrogate("sapo", tau_pos=tau_pos, tau_neg=tau_neg), "grpo"))


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.1, 0.4)])
def test_gmpo_equals_verl_geo_mean(low: float, high: float) -> None:
    """verl's geo_mean is a plain mean over sequences of -A_i s_i (gbmpo ``grpo``)."""
    x = _batch(seed=3, spread=0.3)
    ref = _verl(x, "geo_mean", "token-mean", clip_ratio=low, clip_ratio_low=low,
                clip_ratio_high=high)  # fmt: skip
    assert ref[2]["actor/pg_clipfrac"] > 0.05 and ref[2]["actor/pg_clipfrac_lower"] > 0.0
    ours = _ours(x, get_surrogate("gmpo", eps_low=low, eps_high=high), "grpo")
    _same(ref, ours)
    assert ours[2]["clip_frac_high"] == pytest.approx(ref[2]["actor/pg_clipfrac"], abs=1e-6)
    assert ours[2]["clip_frac_low"] == pytest.approx(ref[2]["actor/pg_clipfrac_lower"], abs=1e-6)


@pytest.mark.parametrize("mode", list(AGG))
@pytest.mark.parametrize(
    "measure,delta_low,delta_high,cap",
    [("dppo_tv", 0.15, 0.15, 3.0), ("dppo_tv", 0.05, 0.1, None), ("dppo_kl", 0.05, 0.05, 3.0),
     ("dppo_kl", 0.02, 0.08, None)],
)  # fmt: skip
def test_dppo_equals_verl(mode: str, measure: str, delta_low: float, delta_high: float,
                          cap: float | None) -> None:  # fmt: skip
    """DPPO-Binary-TV / -KL: mask and truncated weight. ``cap=None`` is verl's clip_ratio_c at
    1e4 (the authors' recipe: truncation off)."""
    x = _batch(seed=4)
    ref = _verl(
        x,
        measure,
        mode,
        clip_ratio=delta_low,
        clip_ratio_low=delta_low,
        clip_ratio_high=delta_high,
        clip_ratio_c=1e4 if cap is None else cap,
    )
    surrogate = get_surrogate("divergence_clip", measure=measure, delta_low=delta_low,
                              delta_high=delta_high, is_cap=cap)  # fmt: skip
    ours = _ours(x, surrogate, AGG[mode])
    _same(ref, ours)
    dropped = ours[2]["clip_frac_low"] + ours[2]["clip_frac_high"]
    assert dropped > 0.02  # the mask binds
    # verl counts every masked token (the A = 0 row may add masked tokens gbmpo does not count)
    assert ref[2]["actor/pg_clipfrac"] >= dropped - 1e-6
    if cap is not None:
        assert ours[2]["clip_frac_dual"] == pytest.approx(ref[2]["actor/pg_clipfrac_lower"],
                                                          abs=1e-6)  # fmt: skip
        assert ours[2]["clip_frac_dual"] > 0.0  # the truncation binds


def test_dppo_mask_is_the_clip_interval() -> None:
    """Away from the bounds the DPPO mask drops exactly the tokens outside the measure's
    interval on the side the advantage pushes (the set PPO's clip with those bounds drops)."""
    x = _batch(seed=5)
    for measure, delta in (("dppo_tv", 0.15), ("dppo_kl", 0.05)):
        surr = get_surrogate("divergence_clip", measure=measure, delta=delta)
        lo, hi = surr.interval(x["old"])
        _, g, _ = _ours(x, surr, "seq_mean_token_sum")
        w = torch.exp(x["logp"] - x["old"])
        a, m = x["adv"], x["mask"]
        out = m & (((w > hi) & (a > 0)) | ((w < lo) & (a < 0)))
        assert out.any()
        assert (g[out] == 0).all() and (g[m & ~out & (a != 0)] != 0).all()


@pytest.mark.parametrize(
    "loss_mode,params,verl_name,verl_cfg,agg",
    [
        ("gbmpo_cispo", {"eps_low": 0.2, "eps_high": 0.28}, "cispo",
         {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, "token-mean"),
        ("gbmpo_sapo", {}, "sapo", {}, "seq-mean-token-mean"),
        ("gbmpo_gmpo", {"eps_low": 0.2, "eps_high": 0.2}, "geo_mean", {}, "seq-mean-token-mean"),
        ("gbmpo_divergence_clip", {"measure": "dppo_tv", "delta": 0.15, "dual_clip_c": None,
                                   "is_cap": 3.0}, "dppo_tv",
         {"clip_ratio": 0.15, "clip_ratio_low": 0.15, "clip_ratio_high": 0.15}, "token-mean"),
        ("gbmpo_divergence_clip", {"measure": "dppo_kl", "delta": 0.05, "dual_clip_c": None},
         "dppo_kl", {"clip_ratio": 0.05, "clip_ratio_low": 0.05, "clip_ratio_high": 0.05,
                     "clip_ratio_c": 1e4}, "token-mean"),
    ],
)  # fmt: skip
def test_plugin_names_equal_verl_builtins(loss_mode, params, verl_name, verl_cfg, agg) -> None:
    """Through verl's interface: ``gbmpo_<name>`` with the parameters in
    ``policy_loss.gbmpo_surrogate`` equals verl's built-in loss of the same method."""
    assert loss_mode in gv.policy_loss_names()
    x = _batch(seed=6, spread=0.3)
    ref = _verl(x, verl_name, agg, **verl_cfg)
    ours = _verl(x, loss_mode, agg, gbmpo_surrogate=params)
    _same(ref, ours)
