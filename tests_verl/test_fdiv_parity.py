"""Parity with verl 0.9.1's own functions for the straight-through KL estimators
(``kl_k1_st`` / ``kl_k3_st`` = verl's ``k1+`` / ``k3+``), the ``gpg`` and ``dro`` policy losses,
and the f-divergence regularizers through the plugin's KL hook (``gbmpo_fkl``, ...): value and
gradient, on CPU, through verl's real code."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("verl")

from test_parity import GBMPO_AGG, MODES, TOL, _tensors  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402

import gbmpo.integrations.verl as gv  # noqa: E402
from gbmpo.objectives import compute_policy_loss, get_regularizer, get_surrogate  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_kl_params() -> Any:
    yield
    gv.configure_kl({})


def _grad(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(v.sum(), x)
    return g


@pytest.mark.parametrize(
    "gbmpo_name,params,verl_name",
    [("kl_k1_st", {}, "k1+"), ("kl_k3_st", {"clamp": 10.0}, "k3+")],
)
def test_straight_through_kl_equals_verl(gbmpo_name: str, params: dict[str, Any],
                                         verl_name: str) -> None:
    """Value of k1 / k3 (verl's k3 is clipped to [-10, 10]), gradient of k2 = l - r."""
    x = _tensors(seed=21)
    x["ref"] = x["ref"].clone()
    x["ref"][0, :3] = x["logp"][0, :3] + torch.tensor([15.0, -15.0, 25.0])  # clip binds
    a = x["logp"].clone().requires_grad_(True)
    b = x["logp"].clone().requires_grad_(True)
    v_ref = core_algos.kl_penalty(a, x["ref"], verl_name)
    v_gb = get_regularizer(gbmpo_name, **params)(logp=b, anchor_logp=x["ref"])
    g_ref, g_gb = _grad(v_ref, a), _grad(v_gb, b)
    assert float((v_gb - v_ref).detach().abs().max()) <= TOL
    assert float((g_gb - g_ref).abs().max()) <= TOL
    torch.testing.assert_close(g_gb, x["logp"] - x["ref"])  # k2's gradient
    # and through the plugin's KL hook (gbmpo_<name>, with the clamp as a gbmpo_kl parameter)
    gv.configure_kl(params)
    c = x["logp"].clone().requires_grad_(True)
    v_hook = core_algos.kl_penalty(c, x["ref"], gv.PREFIX + gbmpo_name)
    assert float((v_hook - v_ref).detach().abs().max()) <= TOL
    assert float((_grad(v_hook, c) - g_ref).abs().max()) <= TOL


def _cfg(mode: str, policy_loss: PolicyLossConfig) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        loss_agg_mode=mode, use_kl_loss=False, policy_loss=policy_loss,
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_mode,beta", [("gpg", None), ("dro", 0.3)])
def test_gpg_and_dro_equal_verls_policy_losses(mode: str, loss_mode: str,
                                               beta: float | None) -> None:
    """gbmpo's compute_policy_loss with the gpg / dro surrogate (its own aggregation) equals
    verl's compute_policy_loss_gpg / _dro with agg_loss, loss and gradient; and the plugin's
    gbmpo_gpg / gbmpo_dro through verl's get_policy_loss_fn do too."""
    x = _tensors(seed=31 + MODES.index(mode))
    pl = PolicyLossConfig(loss_mode=loss_mode, dro_beta=beta)
    lp_v = x["logp"].clone().requires_grad_(True)
    l_ref, _ = core_algos.get_policy_loss_fn(loss_mode)(
        old_log_prob=x["old"], log_prob=lp_v, advantages=x["adv"], response_mask=x["mask"],
        loss_agg_mode=mode, config=_cfg(mode, pl),
    )  # fmt: skip
    (g_ref,) = torch.autograd.grad(l_ref, lp_v)

    agg, kw = GBMPO_AGG[mode]
    if agg == "dr_grpo":
        kw = {"max_len": x["mask"].shape[1]}
    params = {} if beta is None else {"beta": beta}
    lp_g = x["logp"].clone().requires_grad_(True)
    l_gb, _ = compute_policy_loss(
        logp=lp_g,
        old_logp=x["old"],
        advantages=x["adv"],
        mask=x["mask"],
        surrogate=get_surrogate(loss_mode, **params),
        terms=(),
        aggregation=agg,
        **kw,
    )  # fmt: skip
    (g_gb,) = torch.autograd.grad(l_gb, lp_g)
    assert float((l_gb - l_ref).detach().abs()) <= TOL, mode
    assert float((g_gb - g_ref).abs().max()) <= TOL, mode
    assert float(g_ref.abs().max()) > 1e-3

    plugin = gv.GBMPOPolicyLossConfig(loss_mode=gv.PREFIX + loss_mode, gbmpo_surrogate=params)
    lp_p = x["logp"].clone().requires_grad_(True)
    l_p, metrics = core_algos.get_policy_loss_fn(gv.PREFIX + loss_mode)(
        old_log_prob=x["old"], log_prob=lp_p, advantages=x["adv"], response_mask=x["mask"],
        loss_agg_mode=mode, config=_cfg(mode, plugin), rollout_is_weights=None,
    )  # fmt: skip
    (g_p,) = torch.autograd.grad(l_p, lp_p)
    assert float((l_p - l_ref).detach().abs()) <= TOL, mode
    assert float((g_p - g_ref).abs().max()) <= TOL, mode


@pytest.mark.parametrize(
    "name,params",
    [("fkl", {}), ("js", {}), ("chi2", {}), ("hellinger", {}), ("tv", {}),
     ("alpha", {"alpha": 0.3}), ("kl_chi2", {"weight": 0.5})],
)
def test_f_divergences_through_verls_kl_hook(name: str, params: dict[str, Any]) -> None:
    """verl's kl_penalty with kl_loss_type gbmpo_<name> (parameters through gbmpo_kl) computes
    the gbmpo regularizer: value and gradient (on-policy form: verl passes no rollout
    log-probs to its KL loss here)."""
    x = _tensors(seed=41)
    gv.configure_kl(params)
    a = x["logp"].clone().requires_grad_(True)
    v = core_algos.kl_penalty(a, x["ref"], gv.PREFIX + name)
    b = x["logp"].clone().requires_grad_(True)
    want = get_regularizer(name, **params)(logp=b, anchor_logp=x["ref"])
    torch.testing.assert_close(v.detach(), want.detach())
    torch.testing.assert_close(_grad(v, a), _grad(want, b))
    assert torch.isfinite(v).all() and float(v.detach().abs().max()) > 0
