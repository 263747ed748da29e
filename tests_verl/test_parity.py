"""Parity of gbmpo's objectives with verl's own computation, on CPU, through verl's real code.

The reference is always verl: its actor loss ``verl.workers.utils.losses.ppo_loss`` with its
built-in ``vanilla`` policy loss and ``low_var_kl`` KL loss, its ``agg_loss``, its ``kl_penalty``.
gbmpo's ``gbmpo_clip`` + ``gbmpo_kl_k3`` (the plugin, through the same ``ppo_loss``) and gbmpo's
own :func:`gbmpo.objectives.compute_policy_loss` (independent of verl's aggregation) must match it
in loss and gradient to 1e-6 for every ``loss_agg_mode``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("verl")

import verl.utils.tensordict_utils as tu  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import gbmpo.integrations.verl as gv  # noqa: E402
from gbmpo.objectives import (  # noqa: E402
    LossTerm,
    NeuralMirrorMap,
    compute_policy_loss,
    get_regularizer,
    get_surrogate,
)
from gbmpo.objectives.surrogates import atr_bounds  # noqa: E402
from parity_record import record  # noqa: E402

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm"]  # fmt: skip
#: verl loss_agg_mode -> (gbmpo aggregation, extra kwargs) where the two coincide (no empty rows)
GBMPO_AGG: dict[str, tuple[str, dict[str, Any]]] = {
    "token-mean": ("bnpo", {}),
    "token-sum": ("bnpo", {"num_tokens": 1.0}),
    "seq-mean-token-sum": ("seq_mean_token_sum", {}),
    "seq-mean-token-mean": ("grpo", {}),
    "seq-mean-token-sum-norm": ("dr_grpo", {}),  # max_len = T below (verl's default horizon)
}
# float32 values of the same math summed in another order (verl's kernels, the vector width the
# processor gives torch): 1e-6 is ~8 float32 roundings (eps 1.19e-7) of a value of size 1, and a
# value above 1 (token-sum losses reach ~10) gets the same relative bound (_bound)
TOL = 1e-6


def _bound(ref: object) -> float:
    """TOL relative to ``ref``'s size when that is above 1, else TOL."""
    return TOL * max(1.0, abs(float(ref)))  # type: ignore[arg-type]

COEF = 0.05


@pytest.fixture(autouse=True)
def _reset_kl_params() -> Any:
    yield
    gv.configure_kl({})


# --------------------------------------------------------------------------------------------
# Random batches in verl's actor-input layout
# --------------------------------------------------------------------------------------------


def _tensors(seed: int, b: int = 6, t: int = 9, empty_row: bool = False) -> dict[str, Tensor]:
    """Random old / new / ref log-probs, advantages and a right-padded mask. The log-ratios
    reach both clip bounds and the dual clip (some ratios > 3 with negative advantages)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    lens[0] = t
    if empty_row:
        lens[-1] = 0
    mask = torch.arange(t)[None, :] < lens[:, None]
    old = -torch.rand(b, t, generator=g) * 3.0 - 0.05
    delta = torch.randn(b, t, generator=g) * 0.35
    big = torch.rand(b, t, generator=g) < 0.12
    delta = torch.where(big, torch.full_like(delta, 1.4), delta)
    logp = old + delta
    ref = logp + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, t, generator=g)
    adv = torch.where(big, -adv.abs(), adv)
    isw = torch.rand(b, t, generator=g) * 1.5 + 0.25
    return {"logp": logp, "old": old, "ref": ref, "adv": adv, "mask": mask, "isw": isw}


def _batch(x: dict[str, Tensor], *, dp_size: int = 1, with_isw: bool = False) -> TensorDict:
    """verl's ppo_loss input: prompts of length 2, responses right-padded, global batch info
    (``dp_size > 1``: as if every rank held this batch)."""
    b, t = x["mask"].shape
    p = 2
    att = torch.cat([torch.ones(b, p, dtype=torch.long), x["mask"].long()], 1)
    fields = {
        "prompts": torch.ones(b, p, dtype=torch.long),
        "responses": torch.ones(b, t, dtype=torch.long),
        "attention_mask": att,
        "response_mask": x["mask"].float(),
        "old_log_probs": x["old"],
        "advantages": x["adv"],
        "ref_log_prob": x["ref"],
    }
    if with_isw:
        fields["rollout_is_weights"] = x["isw"]
    td = TensorDict(fields, batch_size=[b])
    if dp_size == 1:
        tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    else:
        n_tok = int(x["mask"].sum()) * dp_size
        n_seq = int((x["mask"].sum(-1) > 0).sum()) * dp_size
        tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=n_tok, global_batch_size=n_seq)
    return td


def _packed(logp: Tensor, mask: Tensor) -> Tensor:
    """The flat (no-padding) model output that verl's no_padding_2_padding slices back into
    ``logp`` (one prompt position before each response, one after); differentiable."""
    parts = []
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        parts += [logp.new_zeros(1), logp[i, :n], logp.new_zeros(1)]
    return torch.cat(parts)


def _actor_config(mode: str, loss_mode: str, kl_type: str, **pl: Any) -> FSDPActorConfig:
    if pl or loss_mode.startswith(gv.PREFIX):
        policy_loss: PolicyLossConfig = gv.GBMPOPolicyLossConfig(loss_mode=loss_mode, **pl)
    else:
        policy_loss = PolicyLossConfig(loss_mode=loss_mode)
    return FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
        use_kl_loss=True,
        kl_loss_coef=COEF,
        kl_loss_type=kl_type,
        policy_loss=policy_loss,
    )


def _run_ppo_loss(
    cfg: FSDPActorConfig, x: dict[str, Tensor], **batch_kw: Any
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """verl's actor loss and its gradient with respect to the [B, T] log-probs."""
    logp = x["logp"].clone().requires_grad_(True)
    loss, metrics = ppo_loss(cfg, {"log_probs": _packed(logp, x["mask"])}, _batch(x, **batch_kw))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def _metric(m: Any) -> float:
    """A verl ``Metric`` (one value appended) or a plain number, as a float."""
    v = m.values[-1] if hasattr(m, "values") else m
    return float(v.item() if isinstance(v, Tensor) else v)


# --------------------------------------------------------------------------------------------
# clip + kl_k3 == vanilla + low_var_kl
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp_size,with_isw", [(1, False), (2, True)])
@pytest.mark.parametrize("mode", MODES)
def test_plugin_clip_k3_equals_vanilla_low_var_kl_in_ppo_loss(
    mode: str, dp_size: int, with_isw: bool
) -> None:
    """verl's ppo_loss with loss_mode=gbmpo_clip, kl_loss_type=gbmpo_kl_k3 vs vanilla +
    low_var_kl: loss, gradient and verl's metrics; with rollout IS weights and dp scaling too."""
    x = _tensors(seed=11 + MODES.index(mode), empty_row=dp_size == 2)
    ref_cfg = _actor_config(mode, "vanilla", "low_var_kl")
    gb_cfg = _actor_config(mode, "gbmpo_clip", "gbmpo_kl_k3")
    l_ref, g_ref, m_ref = _run_ppo_loss(ref_cfg, x, dp_size=dp_size, with_isw=with_isw)
    l_gb, g_gb, m_gb = _run_ppo_loss(gb_cfg, x, dp_size=dp_size, with_isw=with_isw)
    # the batch really exercises both clip sides and the dual clip
    assert _metric(m_ref["actor/pg_clipfrac"]) > 0.05
    assert _metric(m_ref["actor/pg_clipfrac_lower"]) > 0.0
    assert g_ref.abs().max() > 1e-3
    dl = float((l_gb - l_ref).abs())
    dg = float((g_gb - g_ref).abs().max())
    record(dl, dg)
    assert dl <= _bound(l_ref), (mode, float(l_gb), float(l_ref))
    assert dg <= TOL, (mode, dg)
    for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "kl_loss"):
        assert _metric(m_gb[k]) == pytest.approx(_metric(m_ref[k]), rel=TOL, abs=TOL), k


@pytest.mark.parametrize("mode", MODES)
def test_gbmpo_compute_policy_loss_equals_verl(mode: str) -> None:
    """gbmpo's own compute_policy_loss (its own aggregation, no verl code) with clip (dual clip
    3) + kl_k3 equals verl's vanilla + agg_loss(low_var_kl) in loss and gradient."""
    x = _tensors(seed=101 + MODES.index(mode))
    cfg = _actor_config(mode, "vanilla", "low_var_kl")
    lp_v = x["logp"].clone().requires_grad_(True)
    pg, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=x["old"], log_prob=lp_v, advantages=x["adv"], response_mask=x["mask"],
        loss_agg_mode=mode, config=cfg,
    )  # fmt: skip
    kl = core_algos.agg_loss(core_algos.kl_penalty(lp_v, x["ref"], "low_var_kl"), x["mask"], mode)
    l_ref = pg + COEF * kl
    (g_ref,) = torch.autograd.grad(l_ref, lp_v)

    agg, kw = GBMPO_AGG[mode]
    if agg == "dr_grpo":
        kw = {"max_len": x["mask"].shape[1]}
    lp_g = x["logp"].clone().requires_grad_(True)
    surrogate = get_surrogate("clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    l_gb, _ = compute_policy_loss(
        logp=lp_g,
        old_logp=x["old"],
        advantages=x["adv"],
        mask=x["mask"],
        surrogate=surrogate,
        terms=[LossTerm("kl_k3", "kl_k3", COEF, x["ref"])],
        aggregation=agg,
        **kw,
    )  # fmt: skip
    (g_gb,) = torch.autograd.grad(l_gb, lp_g)
    dl = float((l_gb - l_ref).detach().abs())
    dg = float((g_gb - g_ref).abs().max())
    record(dl, dg)
    assert dl <= _bound(l_ref) and dg <= TOL, (mode, dl, dg)


def test_parity_is_sensitive() -> None:
    """The comparison can fail: a different clip or KL coefficient is caught."""
    x = _tensors(seed=5)
    l_ref, g_ref, _ = _run_ppo_loss(_actor_config("token-mean", "vanilla", "low_var_kl"), x)
    l_1, g_1, _ = _run_ppo_loss(
        _actor_config("token-mean", "gbmpo_clip", "gbmpo_kl_k3", gbmpo_surrogate={"eps_high": 0.2}),
        x,
    )
    l_2, g_2, _ = _run_ppo_loss(_actor_config("token-mean", "gbmpo_clip", "gbmpo_kl_k1"), x)
    assert float((g_1 - g_ref).abs().max()) > 1e-3
    assert float((g_2 - g_ref).abs().max()) > 1e-4


# --------------------------------------------------------------------------------------------
# Every plugin name through verl's own get_policy_loss_fn
# --------------------------------------------------------------------------------------------


def _call(loss_mode: str, x: dict[str, Tensor], mode: str, **pl: Any) -> tuple[Tensor, Tensor]:
    cfg = _actor_config(mode, loss_mode, "low_var_kl", **pl)
    lp = x["logp"].clone().requires_grad_(True)
    fn = core_algos.get_policy_loss_fn(loss_mode)
    loss, metrics = fn(
        old_log_prob=x["old"], log_prob=lp, advantages=x["adv"], response_mask=x["mask"],
        loss_agg_mode=mode, config=cfg, rollout_is_weights=None,
    )  # fmt: skip
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def test_every_surrogate_is_registered() -> None:
    names = gv.policy_loss_names()
    assert set(names) >= {"gbmpo_clip", "gbmpo_gspo", "gbmpo_atr", "gbmpo_divergence_clip",
                          "gbmpo_rpg_clip", "gbmpo_rpg_reinforce"}  # fmt: skip
    for n in names:
        assert n in core_algos.POLICY_LOSS_REGISTRY
        assert core_algos.get_policy_loss_fn(n).__name__ == f"compute_policy_loss_{n}"


@pytest.mark.parametrize(
    "loss_mode,params",
    [
        ("gbmpo_clip", {}),
        ("gbmpo_gspo", {}),
        ("gbmpo_atr", {"delta": 0.02}),
        ("gbmpo_divergence_clip", {"measure": "k1", "delta": 0.2}),
        ("gbmpo_divergence_clip", {"measure": "prob_l2", "delta": 0.01}),
        ("gbmpo_rpg_clip", {"variant": "urkl", "beta": 0.01}),
        ("gbmpo_rpg_reinforce", {"variant": "rkl", "beta": 0.01}),
    ],
)
def test_plugin_name_matches_gbmpo(loss_mode: str, params: dict[str, Any]) -> None:
    """Each name, called through verl's get_policy_loss_fn with verl's fields, equals gbmpo's
    compute_policy_loss with the surrogate parameters derived from those fields."""
    x = _tensors(seed=7)
    loss, grad = _call(loss_mode, x, "token-mean", gbmpo_surrogate=params)
    name = loss_mode[len(gv.PREFIX) :]
    derived = {
        "clip": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0},
        "gspo": {"eps_low": 0.2, "eps_high": 0.28},
        "atr": {"dual_clip_c": 3.0},
        "divergence_clip": {"dual_clip_c": 3.0},
        "rpg_clip": {"eps_low": 0.2, "eps_high": 0.28, "c": 3.0},
        "rpg_reinforce": {"eps_low": 0.2, "eps_high": 0.28, "c": 3.0},
    }[name]
    surrogate = get_surrogate(name, **derived, **params)
    lp = x["logp"].clone().requires_grad_(True)
    l_gb, _ = compute_policy_loss(
        logp=lp,
        old_logp=x["old"],
        advantages=x["adv"],
        mask=x["mask"],
        surrogate=surrogate,
        terms=(),
        aggregation="bnpo",
    )  # fmt: skip
    (g_gb,) = torch.autograd.grad(l_gb, lp)
    assert float((loss - l_gb).abs()) <= TOL
    assert float((grad - g_gb).abs().max()) <= TOL
    assert torch.isfinite(grad).all() and grad.abs().max() > 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_atr_equals_vanilla_with_kl3_bounds(mode: str) -> None:
    """gbmpo_atr(delta) is verl's vanilla with clip_ratio_low = 1 - l_delta and
    clip_ratio_high = u_delta - 1 (ATR-GRPO's KL3 trust region)."""
    x = _tensors(seed=21)
    delta = 0.03
    low, high = atr_bounds(delta)
    loss, grad = _call("gbmpo_atr", x, mode, gbmpo_surrogate={"delta": delta})
    cfg = FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=1.0 - low,
        clip_ratio_high=high - 1.0, clip_ratio_c=3.0, loss_agg_mode=mode,
    )  # fmt: skip
    lp = x["logp"].clone().requires_grad_(True)
    l_ref, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=x["old"], log_prob=lp, advantages=x["adv"], response_mask=x["mask"],
        loss_agg_mode=mode, config=cfg,
    )  # fmt: skip
    (g_ref,) = torch.autograd.grad(l_ref, lp)
    assert float((loss - l_ref).abs()) <= TOL
    assert float((grad - g_ref).abs().max()) <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_divergence_clip_ratio_equals_vanilla(mode: str) -> None:
    """gbmpo_divergence_clip with measure=ratio and delta_low / delta_high is verl's vanilla
    with clip_ratio_low / clip_ratio_high (the ratio clip as the framework's first measure)."""
    x = _tensors(seed=22)
    loss, grad = _call("gbmpo_divergence_clip", x, mode,
                       gbmpo_surrogate={"measure": "ratio", "delta_low": 0.2, "delta_high": 0.28})
    cfg = FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
        clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode,
    )  # fmt: skip
    lp = x["logp"].clone().requires_grad_(True)
    l_ref, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=x["old"], log_prob=lp, advantages=x["adv"], response_mask=x["mask"],
        loss_agg_mode=mode, config=cfg,
    )  # fmt: skip
    (g_ref,) = torch.autograd.grad(l_ref, lp)
    assert float((loss - l_ref).abs()) <= TOL
    assert float((grad - g_ref).abs().max()) <= TOL


def test_gspo_equals_verl_gspo() -> None:
    """gbmpo_gspo equals verl's gspo in value for every mode, and in gradient under
    seq-mean-token-mean with per-sequence advantages (verl's GSPO-token form)."""
    x = _tensors(seed=31)
    x["old"] = x["logp"] - torch.randn_like(x["logp"]) * 0.02  # GSPO's ratios are near 1
    x["adv"] = x["adv"][:, :1].expand_as(x["adv"]).contiguous()
    for mode in MODES:
        pl = {"gbmpo_surrogate": {"eps_low": 3e-4, "eps_high": 4e-4}}
        loss, grad = _call("gbmpo_gspo", x, mode, **pl)
        cfg = FSDPActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=3e-4,
            clip_ratio_high=4e-4, loss_agg_mode=mode,
        )  # fmt: skip
        lp = x["logp"].clone().requires_grad_(True)
        l_ref, _ = core_algos.get_policy_loss_fn("gspo")(
            old_log_prob=x["old"], log_prob=lp, advantages=x["adv"], response_mask=x["mask"],
            loss_agg_mode=mode, config=cfg,
        )  # fmt: skip
        (g_ref,) = torch.autograd.grad(l_ref, lp)
        assert float((loss - l_ref).abs()) <= TOL, mode
        if mode == "seq-mean-token-mean":
            assert float((grad - g_ref).abs().max()) <= TOL


def test_unknown_loss_mode_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="gbmpo_clip"):
        core_algos.get_policy_loss_fn("gbmpo_nope")
    with pytest.raises(ValueError, match="'gbmpo_nope' is not a gbmpo policy loss.*gbmpo_atr"):
        gv.GBMPOPolicyLossConfig(loss_mode="gbmpo_nope")
    with pytest.raises(ValueError, match="not a gbmpo regularizer.*gbmpo_prob_l2"):
        core_algos.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "gbmpo_nope")
    with pytest.raises(TypeError, match="delta"):
        _call("gbmpo_atr", _tensors(seed=1), "token-mean")  # ATR needs its radius


# --------------------------------------------------------------------------------------------
# Regularizers as verl's KL loss
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gbmpo_name,verl_name", [("kl_k1", "k1"), ("kl_k2", "k2"), ("kl_k3", "low_var_kl")]
)
def test_kl_types_equal_verl_estimators(gbmpo_name: str, verl_name: str) -> None:
    x = _tensors(seed=3)
    a = x["logp"].clone().requires_grad_(True)
    b = x["logp"].clone().requires_grad_(True)
    v_ref = core_algos.kl_penalty(a, x["ref"], verl_name)
    v_gb = core_algos.kl_penalty(b, x["ref"], gv.PREFIX + gbmpo_name)
    (g_ref,) = torch.autograd.grad(v_ref.sum(), a)
    (g_gb,) = torch.autograd.grad(v_gb.sum(), b)
    assert float((v_gb - v_ref).abs().max()) <= TOL
    assert float((g_gb - g_ref).abs().max()) <= TOL


def test_straight_through_suffix_keeps_verl_semantics() -> None:
    """``gbmpo_prob_l2+``: gbmpo's value, verl's straight-through k2 gradient."""
    x = _tensors(seed=4)
    lp = x["logp"].clone().requires_grad_(True)
    v = core_algos.kl_penalty(lp, x["ref"], "gbmpo_prob_l2+")
    (g,) = torch.autograd.grad(v.sum(), lp)
    expected = get_regularizer("prob_l2")(logp=x["logp"], anchor_logp=x["ref"])
    torch.testing.assert_close(v.detach(), expected)
    torch.testing.assert_close(g, x["logp"] - x["ref"])


@pytest.mark.parametrize("name", ["prob_l2", "log_l2", "kl_k3_is", "rpg_fkl", "rpg_rkl",
                                  "rpg_ufkl", "rpg_urkl", "none"])  # fmt: skip
def test_every_regularizer_through_kl_penalty(name: str) -> None:
    x = _tensors(seed=8)
    lp = x["logp"].clone().requires_grad_(True)
    v = core_algos.kl_penalty(lp, x["ref"], gv.PREFIX + name)
    expected = get_regularizer(name)(logp=x["logp"], anchor_logp=x["ref"])
    torch.testing.assert_close(v.detach(), expected)


def test_neural_mirror_from_file_and_required(tmp_path: Path) -> None:
    path = NeuralMirrorMap.random(0.05, 3).save(tmp_path / "mirror.json")
    x = _tensors(seed=9)
    with pytest.raises(ValueError, match=r"gbmpo_kl\.mirror"):
        core_algos.kl_penalty(x["logp"], x["ref"], "gbmpo_neural_mirror")
    cfg = _actor_config(
        "token-mean", "vanilla", "gbmpo_neural_mirror", gbmpo_kl={"mirror": str(path)}
    )
    lp = x["logp"].clone().requires_grad_(True)
    v = core_algos.kl_penalty(lp, x["ref"], cfg.kl_loss_type)
    expected = get_regularizer("neural_mirror", mirror=NeuralMirrorMap.load(path))
    torch.testing.assert_close(v.detach(), expected(logp=x["logp"], anchor_logp=x["ref"]))
    (g,) = torch.autograd.grad(v.sum(), lp)
    assert torch.isfinite(g).all() and g.abs().max() > 0
    assert gv.describe(cfg)["regularizer"].name == "neural_mirror"


def test_old_log_probs_reach_the_kl_loss() -> None:
    """kl_k3_is, and rpg_* with the objective's anchor old, use the rollout log-probs that
    the gbmpo policy loss of the same micro-batch saw (through verl's ppo_loss)."""
    x = _tensors(seed=12)
    for name, anchor in (("kl_k3_is", "ref"), ("rpg_ufkl", "old")):
        kl_params = {} if anchor == "ref" else {"anchor": "old"}
        cfg = _actor_config("token-mean", "gbmpo_clip", gv.PREFIX + name, gbmpo_kl=kl_params)
        no_kl = _actor_config("token-mean", "gbmpo_clip", "gbmpo_none")
        l_all, g_all, m = _run_ppo_loss(cfg, x)
        l_pg, g_pg, _ = _run_ppo_loss(no_kl, x)
        lp = x["logp"].clone().requires_grad_(True)
        anchor_logp = x["old"] if anchor == "old" else x["ref"]
        reg = get_regularizer(name)(logp=lp, old_logp=x["old"], anchor_logp=anchor_logp)
        kl = core_algos.agg_loss(reg, x["mask"], "token-mean")
        (g_kl,) = torch.autograd.grad(kl, lp)
        assert float((l_all - l_pg - COEF * kl).abs()) <= TOL, name
        assert float((g_all - g_pg - COEF * g_kl).abs().max()) <= TOL, name
        assert _metric(m["kl_loss"]) == pytest.approx(float(kl), abs=1e-6)


def test_anchor_old_without_gbmpo_policy_loss_raises() -> None:
    x = _tensors(seed=13)
    cfg = _actor_config("token-mean", "vanilla", "gbmpo_rpg_ufkl", gbmpo_kl={"anchor": "old"})
    with pytest.raises(ValueError, match="gbmpo_clip"):
        _run_ppo_loss(cfg, x)


# --------------------------------------------------------------------------------------------
# The internals check
# --------------------------------------------------------------------------------------------


def test_module_main_reports_the_check_and_names() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gbmpo.integrations.verl"], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "internals check passed" in out.stdout
    assert "gbmpo_rpg_reinforce" in out.stdout and "gbmpo_neural_mirror" in out.stdout


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )  # fmt: skip


_LOADED = (
    "import verl\n"
    "from verl.trainer.ppo import core_algos as ca\n"
    "assert 'gbmpo_atr' in ca.POLICY_LOSS_REGISTRY, sorted(ca.POLICY_LOSS_REGISTRY)\n"
    "assert getattr(ca.kl_penalty_forward, '_gbmpo_hook', False)\n"
)


@pytest.mark.parametrize(
    "env",
    [
        {"VERL_USE_EXTERNAL_PLUGINS": "auto"},  # the verl.plugins entry point
        {
            "VERL_USE_EXTERNAL_PLUGINS": "none",
            "VERL_USE_EXTERNAL_MODULES": "gbmpo.integrations.verl",
        },
    ],
    ids=["entry_point", "VERL_USE_EXTERNAL_MODULES"],
)
def test_import_verl_loads_the_plugin(env: dict[str, str]) -> None:
    out = _python(_LOADED, **env)
    assert out.returncode == 0, out.stderr[-2000:]


def test_without_switches_not_loaded_and_import_fails_loudly_when_verl_moved() -> None:
    """With neither switch verl does not load the plugin (so the test above tests the switches);
    importing it then against a verl whose agg_loss moved raises, naming it, and logs it."""
    code = (
        "try:\n"
        + "".join("    " + line + "\n" for line in _LOADED.splitlines())
        + "except AssertionError:\n"
        "    print('not loaded')\n"
        "from verl.trainer.ppo import core_algos as ca\n"
        "def agg_loss(loss_mat, loss_mask, loss_agg_mode): return loss_mat\n"
        "ca.agg_loss = agg_loss\n"
        "import gbmpo.integrations.verl\n"
    )
    out = _python(code, VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="")
    assert out.stdout.strip() == "not loaded", out.stdout + out.stderr[-2000:]
    assert out.returncode != 0
    assert "VerlInternalsError" in out.stderr and "agg_loss no longer takes dp_size" in out.stderr
    assert "gbmpo verl plugin not loaded" in out.stderr  # logged too (verl hides plugin errors)


def test_internals_check_passes_on_installed_verl() -> None:
    gv.check_verl_internals(strict=True)
    assert getattr(core_algos.kl_penalty_forward, "_gbmpo_hook", False)
    gv.install_kl_hook()  # idempotent
    assert core_algos.kl_penalty_forward.__wrapped__.__module__ == core_algos.__name__


class _Fake:
    """A copy of core_algos' namespace with one thing changed."""

    def __init__(self, **changes: Any) -> None:
        self.__dict__.update({k: getattr(core_algos, k) for k in dir(core_algos)
                              if not k.startswith("__")})  # fmt: skip
        self.__dict__.update(changes)
        self.__name__ = "fake_core_algos"


def test_internals_check_names_what_moved() -> None:
    with pytest.raises(gv.VerlInternalsError, match="kl_penalty_forward no longer exists"):
        gv.check_verl_internals(_Fake(kl_penalty_forward=None))

    def kl_penalty_forward(logprob: Tensor, ref: Tensor, kind: str) -> Tensor:
        return logprob

    with pytest.raises(gv.VerlInternalsError, match="kl_penalty_forward no longer takes"):
        gv.check_verl_internals(_Fake(kl_penalty_forward=kl_penalty_forward))

    def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
        return loss_mat

    with pytest.raises(gv.VerlInternalsError, match="agg_loss no longer takes dp_size"):
        gv.check_verl_internals(_Fake(agg_loss=agg_loss))

    with pytest.raises(gv.VerlInternalsError, match="POLICY_LOSS_REGISTRY"):
        gv.check_verl_internals(_Fake(POLICY_LOSS_REGISTRY=None))

    def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
        return logprob - ref_logprob  # no longer goes through kl_penalty_forward

    gv.check_verl_internals(_Fake(kl_penalty=kl_penalty))  # signature fine
    with pytest.raises(gv.VerlInternalsError, match="kl_penalty no longer contains"):
        gv.check_verl_internals(_Fake(kl_penalty=kl_penalty), strict=True)


def test_source_facts_checked_at_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A moved source fact (strict check) is reported, naming the function, at the first use of a
    gbmpo name in the process, without stopping the run; once."""
    calls: list[bool] = []

    def fake_check(*args: Any, strict: bool = False, **kw: Any) -> None:
        calls.append(strict)
        raise gv.VerlInternalsError("verl.workers.utils.losses.ppo_loss no longer contains 'x'")

    # the plugin's own module holds the flag and looks the check up (gv is its public path)
    from gbmpo.engines.verl import plugin

    monkeypatch.setattr(plugin, "_sources_checked", False)
    monkeypatch.setattr(plugin, "check_verl_internals", fake_check)
    x = _tensors(seed=2)
    with pytest.warns(UserWarning, match="ppo_loss no longer contains"):
        loss, _ = _call("gbmpo_clip", x, "token-mean")
    assert torch.isfinite(loss)
    _call("gbmpo_clip", x, "token-mean")
    assert calls == [True]


# --------------------------------------------------------------------------------------------
# A sum of regularizer terms: one KL loss gbmpo_sum == the own engine's terms
# --------------------------------------------------------------------------------------------

SUM_SPEC = {
    "surrogate": {"name": "clip", "params": {"eps_low": 0.2, "eps_high": 0.28,
                                             "dual_clip_c": 3.0}},
    "regularizer": [{"name": "prob_l2", "coef": 0.05}, {"name": "kl_k3", "coef": 0.01},
                    {"name": "rpg_ufkl", "coef": 0.002, "anchor": "old",
                     "params": {"clamp": 10.0}},
                    {"name": "kl_k1", "coef": 0.0}],
}  # fmt: skip


def _objective_config(mode: str, ov: dict[str, str], objective: str | None = None,
                      **pl: Any) -> FSDPActorConfig:
    """verl's actor config as the overrides ``ov`` (of :func:`verl_objective_overrides`) set it,
    the objective spec in ``policy_loss.gbmpo_objective`` (``objective``: another JSON text)."""
    a = "actor_rollout_ref.actor"
    use_kl = ov[f"{a}.use_kl_loss"] == "true"
    return FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode,
        use_kl_loss=use_kl, kl_loss_coef=float(ov.get(f"{a}.kl_loss_coef", 0.001)),
        kl_loss_type=ov.get(f"{a}.kl_loss_type", "low_var_kl"),
        policy_loss=gv.GBMPOPolicyLossConfig(
            loss_mode=ov[f"{a}.policy_loss.loss_mode"],
            gbmpo_objective=objective or ov[f"{a}.policy_loss.gbmpo_objective"][1:-1], **pl),
    )  # fmt: skip


def _overrides(spec: dict[str, Any], t: int) -> dict[str, str]:
    from gbmpo.engines.verl.objective import verl_objective_overrides

    return dict(o.lstrip("+").split("=", 1)
                for o in verl_objective_overrides(spec, max_response_length=t))  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_sum_of_terms_equals_the_own_engines_sum(mode: str) -> None:
    """``objective.regularizer`` as a list: the overrides gbmpo composes (``kl_loss_type=
    gbmpo_sum``, coefficient 1, the spec in ``policy_loss.gbmpo_objective``, built by the plugin
    into the own engine's ``BuiltObjective``) through verl's own ``ppo_loss`` equal the own
    engine's ``compute_policy_loss(terms=...)`` in loss and gradient; the terms' ``kl_loss`` is
    the own engine's ``reg_loss``."""
    x = _tensors(seed=211 + MODES.index(mode))
    t = x["mask"].shape[1]
    ov = _overrides({**SUM_SPEC, "aggregation": GBMPO_AGG[mode][0]}, t)
    a = "actor_rollout_ref.actor"
    assert ov[f"{a}.kl_loss_type"] == "gbmpo_sum" and ov[f"{a}.kl_loss_coef"] == "1.0"
    cfg = _objective_config(mode, ov)
    built = gv.describe(cfg)["objective"]
    assert [tm.name for tm in gv.build_sum(built).terms] == ["prob_l2", "kl_k3", "rpg_ufkl"]

    l_v, g_v, m_v = _run_ppo_loss(cfg, x)

    agg, kw = GBMPO_AGG[mode]
    if agg == "dr_grpo":
        kw = {"max_len": t}
    lp = x["logp"].clone().requires_grad_(True)
    own_terms = [LossTerm("prob_l2", get_regularizer("prob_l2"), 0.05, x["ref"]),
                 LossTerm("kl_k3", get_regularizer("kl_k3"), 0.01, x["ref"]),
                 LossTerm("rpg_ufkl", get_regularizer("rpg_ufkl", clamp=10.0), 0.002,
                          x["old"])]  # fmt: skip
    l_g, m_g = compute_policy_loss(
        logp=lp,
        old_logp=x["old"],
        advantages=x["adv"],
        mask=x["mask"],
        surrogate=get_surrogate("clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0),
        aggregation=agg,
        terms=own_terms,
        **kw,
    )  # fmt: skip
    (g_g,) = torch.autograd.grad(l_g, lp)
    dl, dg = float((l_g.detach() - l_v).abs()), float((g_g - g_v).abs().max())
    record(dl, dg)
    assert dl <= _bound(l_v) and dg <= TOL, (mode, dl, dg)
    assert _metric(m_v["kl_loss"]) == pytest.approx(m_g["reg_loss"], rel=TOL, abs=TOL)
    # sensitive: without the 'old' anchor the sum differs
    spec = json.loads(ov[f"{a}.policy_loss.gbmpo_objective"][1:-1])
    spec["regularizer"][2]["anchor"] = "ref"
    l_ref_anchor, _, _ = _run_ppo_loss(_objective_config(mode, ov, json.dumps(spec)), x)
    assert float((l_ref_anchor - l_v).abs()) > 1e-6


# --------------------------------------------------------------------------------------------
# One objective representation: the plugin builds the spec once into a BuiltObjective
# --------------------------------------------------------------------------------------------

ONE_TERM_SPEC = {
    "surrogate": {"name": "atr", "params": {"delta": 0.02}},
    "regularizer": {"name": "rpg_ufkl", "coef": 0.003, "anchor": "old", "params": {"clamp": 8.0}},
}  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_objective_spec_loss_equals_the_own_engines_compute_policy_loss(mode: str) -> None:
    """One term, ``kl_loss_type=gbmpo_<name>`` with ``kl_loss_coef``: verl's ``ppo_loss`` with
    the plugin's objective equals ``compute_policy_loss`` with that same ``BuiltObjective``'s
    surrogate and terms (the objects themselves)."""
    x = _tensors(seed=311 + MODES.index(mode))
    t = x["mask"].shape[1]
    agg, kw = GBMPO_AGG[mode]
    ov = _overrides({**ONE_TERM_SPEC, "aggregation": agg}, t)
    a = "actor_rollout_ref.actor"
    assert ov[f"{a}.kl_loss_type"] == "gbmpo_rpg_ufkl" and float(ov[f"{a}.kl_loss_coef"]) == 0.003
    cfg = _objective_config(mode, ov)
    chosen = gv.describe(cfg)
    built = chosen["objective"]
    assert chosen["surrogate"] is built.surrogate and chosen["anchor"] == "old"
    assert chosen["regularizer"] is built.terms[0].regularizer
    l_v, g_v, m_v = _run_ppo_loss(cfg, x)
    if agg == "dr_grpo":
        kw = {"max_len": t}
    lp = x["logp"].clone().requires_grad_(True)
    anchors = {"ref": x["ref"], "old": x["old"]}
    l_g, m_g = compute_policy_loss(
        logp=lp, old_logp=x["old"], advantages=x["adv"], mask=x["mask"],
        surrogate=built.surrogate, aggregation=agg,
        terms=[LossTerm(tm.name, tm.regularizer, tm.coef, anchors[tm.anchor])
               for tm in built.loss_terms], **kw)  # fmt: skip
    (g_g,) = torch.autograd.grad(l_g, lp)
    dl, dg = float((l_g.detach() - l_v).abs()), float((g_g - g_v).abs().max())
    record(dl, dg)
    assert dl <= _bound(l_v) and dg <= TOL, (mode, dl, dg)
    assert 0.003 * _metric(m_v["kl_loss"]) == pytest.approx(m_g["reg_loss"], abs=1e-7)
    # the surrogate is the spec's: another delta changes the loss
    other = _overrides({**ONE_TERM_SPEC, "aggregation": agg,
                        "surrogate": {"name": "atr", "params": {"delta": 0.2}}}, t)  # fmt: skip
    assert float((_run_ppo_loss(_objective_config(mode, other), x)[0] - l_v).abs()) > 1e-6


def test_objective_is_built_once_per_process_and_checked() -> None:
    ov = _overrides(ONE_TERM_SPEC, 9)
    a = "actor_rollout_ref.actor"
    text = ov[f"{a}.policy_loss.gbmpo_objective"][1:-1]
    first = gv.build_objective(text)
    assert gv.build_objective(text) is first
    assert _objective_config("token-mean", ov).policy_loss is not None
    assert gv.current_objective() is first  # installed when verl builds the config
    with pytest.raises(ValueError, match="loss_mode=gbmpo_atr"):
        gv.GBMPOPolicyLossConfig(loss_mode="gbmpo_clip", gbmpo_objective=text)
    with pytest.raises(ValueError, match="give one of the two"):
        gv.GBMPOPolicyLossConfig(loss_mode="gbmpo_atr", gbmpo_objective=text,
                                 gbmpo_surrogate={"delta": 0.1})  # fmt: skip
    with pytest.raises(ValueError, match="objective.surrogate"):
        gv.build_objective(json.dumps({"surrogate": {"name": "atr", "params": {"nope": 1}}}))
    x = _tensors(seed=5)
    wrong = _objective_config("token-mean", {**ov, f"{a}.kl_loss_type": "gbmpo_kl_k3"})
    with pytest.raises(ValueError, match="not a term of the objective"):
        _run_ppo_loss(wrong, x)
    gv.configure_kl({})
    assert gv.current_objective() is None
    with pytest.raises(ValueError, match="gbmpo_objective"):
        core_algos.kl_penalty(x["logp"], x["ref"], "gbmpo_sum")
