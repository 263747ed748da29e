"""The rollout-training mismatch correction (gbmpo.objectives.rollout_correction): properties of
each mode on fixed tensors, the registry and its errors, and parity with TRL 1.16's own code
(``GRPOTrainer.get_off_policy_mask`` and the importance-sampling block of
``_generate_and_score_completions``, run as TRL wrote it). verl's parity runs in .venv-verl
(tests_verl/test_rollout_correction_parity.py)."""

from __future__ import annotations

import inspect
import math
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gbmpo.objectives.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    check_correction,
    correction_weights,
    icepop,
    masked_is,
    off_policy_sequence_mask,
    sampler_log_ratio,
    truncated_is,
    weight_stats,
)
from gbmpo.registry import UnknownNameError


def _fixed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trainer and sampler log-probs [5, 7] with token log-ratios in [-1.5, 1.5] and a ragged
    mask (one row has a single valid token)."""
    g = torch.Generator().manual_seed(0)
    sampler = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    trainer = sampler + (torch.rand(5, 7, generator=g, dtype=torch.float64) - 0.5) * 3
    mask = torch.ones(5, 7)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    mask[4, 6] = 0
    return trainer, sampler, mask


def test_registry_names_and_unknown_name_lists_them() -> None:
    assert set(ROLLOUT_CORRECTIONS.names()) == {"none", "tis", "mis", "icepop"}
    with pytest.raises(UnknownNameError, match="valid names: icepop, mis, none, tis"):
        correction_weights("cispo", *_fixed())


def test_equal_log_probs_give_weight_one_for_every_mode() -> None:
    trainer, _, mask = _fixed()
    for mode, low in (("none", None), ("tis", None), ("mis", 0.5), ("icepop", 0.5)):
        for level in ("token", "sequence") if mode != "icepop" else ("token",):
            w = correction_weights(mode, trainer, trainer.clone(), mask, level=level, low=low,
                                   high=2.0)  # fmt: skip
            assert torch.equal(w, mask.double()), (mode, level)


def test_token_tis_is_the_clamped_ratio_and_mis_zeroes_outside() -> None:
    trainer, sampler, mask = _fixed()
    rho = torch.exp(trainer - sampler)
    tis = correction_weights("tis", trainer, sampler, mask, low=0.5, high=2.0)
    assert torch.allclose(tis, rho.clamp(0.5, 2.0) * mask, atol=0, rtol=1e-12)
    mis = correction_weights("mis", trainer, sampler, mask, low=0.5, high=2.0)
    inside = (rho >= 0.5) & (rho <= 2.0)
    assert torch.allclose(mis, torch.where(inside, rho, 0.0) * mask, rtol=1e-12)
    assert (mis[mask.bool()] == 0).any() and (mis[mask.bool()] > 0).any()  # both cases occur
    ice = correction_weights("icepop", trainer, sampler, mask, low=0.5, high=2.0)
    assert torch.equal(ice, mis)
    assert torch.equal(tis[~mask.bool()], torch.zeros_like(tis[~mask.bool()]))


def test_sequence_level_is_the_product_broadcast() -> None:
    trainer, sampler, mask = _fixed()
    seq = torch.exp(((trainer - sampler) * mask).sum(-1, keepdim=True))
    w = correction_weights("tis", trainer, sampler, mask, level="sequence", high=2.0)
    assert torch.allclose(w, seq.clamp(max=2.0).expand_as(w) * mask, rtol=1e-12)
    # one value per sequence on its valid tokens
    for i in range(5):
        assert w[i][mask[i].bool()].unique().numel() == 1


def test_pure_functions_and_nan_sampler_log_probs() -> None:
    x = torch.tensor([[-1.0, 0.0, 1.0]], dtype=torch.float64)
    assert torch.allclose(truncated_is(x, high=2.0), torch.tensor([[math.exp(-1), 1, 2]],
                                                                  dtype=torch.float64))
    assert torch.equal(masked_is(x, low=0.5, high=2.0)[0, ::2], torch.zeros(2, dtype=x.dtype))
    with pytest.raises(ValueError, match="both bounds"):
        icepop(x, high=2.0)
    trainer = torch.zeros(1, 3)
    sampler = torch.tensor([[float("nan"), -1.0, 0.0]])
    lr = sampler_log_ratio(trainer, sampler, torch.ones(1, 3))
    assert torch.equal(lr, torch.tensor([[0.0, 1.0, 0.0]]))  # NaN counts as no mismatch


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(mode="tis", level="seq"), "level"), (dict(mode="mis", low=2.0, high=1.0), "below"),
     (dict(mode="tis", high=None), "must be set"), (dict(mode="icepop"), "set"),
     (dict(mode="icepop", low=0.5, level="sequence"), "token-level"),
     (dict(mode="tis", high=-1.0), "> 0"), (dict(mode="none", threshold=-0.1), ">= 0")],
)  # fmt: skip
def test_bad_settings_name_the_key(kwargs: dict[str, Any], match: str) -> None:
    args = {"mode": "none", "level": "token", "low": None, "high": 2.0, "threshold": None,
            **kwargs}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        check_correction(args["mode"], args["level"], args["low"], args["high"], args["threshold"])


def test_weight_stats() -> None:
    w = torch.tensor([[0.5, 2.0, 9.0], [0.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    s = weight_stats(w, mask)
    assert s == pytest.approx({"weight_mean": 0.9, "weight_min": 0.0, "weight_max": 2.0,
                               "masked_frac": 0.2})  # fmt: skip
    keep = torch.tensor([[0.0], [1.0]])
    assert weight_stats(w, mask, keep)["masked_frac"] == pytest.approx(0.6)


# ------------------------------------------------------------------ parity with TRL 1.16


trl = pytest.importorskip("trl")


def _trl_is_ratio(mode: str, clip_min: float | None, clip_max: float | None,
                  old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's own importance-sampling block (GRPOTrainer._generate_and_score_completions, from
    ``per_token_logps_diff = ...`` to the reference log-probs), executed as TRL wrote it."""
    src = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    first = src.index("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps)")
    start = src.rindex("\n", 0, first) + 1  # with the line's indentation
    end = src.index("# Compute the per-token log probabilities for the reference model")
    block = textwrap.dedent(src[start:end].rstrip())
    ns: dict[str, Any] = {
        "torch": torch, "math": math, "mask": mask,
        "old_per_token_logps": old, "sampling_per_token_logps": sampling,
        "self": SimpleNamespace(vllm_importance_sampling_mode=mode,
                                vllm_importance_sampling_clip_min=clip_min,
                                vllm_importance_sampling_clip_max=clip_max),
    }  # fmt: skip
    exec(compile(block, "trl_is_block", "exec"), ns)  # noqa: S102 - TRL's own code
    return ns["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize(
    ("mode", "level", "low", "high", "trl_mode"),
    [("tis", "token", None, 2.0, "token_truncate"), ("tis", "token", 0.5, 2.0, "token_truncate"),
     ("tis", "sequence", None, 3.0, "sequence_truncate"),
     ("tis", "sequence", 0.2, 3.0, "sequence_truncate"),
     ("mis", "token", 0.5, 2.0, "token_mask"), ("mis", "token", None, 2.0, "token_mask"),
     ("mis", "sequence", 0.1, 3.0, "sequence_mask"),
     ("mis", "sequence", None, 3.0, "sequence_mask"),
     ("icepop", "token", 0.5, 5.0, "token_mask")],
)  # fmt: skip
def test_weights_match_trls_importance_sampling(
    mode: str, level: str, low: float | None, high: float, trl_mode: str
) -> None:
    from gbmpo.engines.trl.objective import rollout_correction_args
    from gbmpo.objectives.spec import RolloutCorrectionSpec

    rc = RolloutCorrectionSpec(mode=mode, level=level, low=low, high=high)
    args = rollout_correction_args(rc)  # what the TRL engine sets
    assert args["vllm_importance_sampling_mode"] == trl_mode
    trainer, sampler, mask = _fixed()
    ours = correction_weights(mode, trainer, sampler, mask, level=level, low=low, high=high)
    theirs = _trl_is_ratio(trl_mode, args["vllm_importance_sampling_clip_min"],
                           args["vllm_importance_sampling_clip_max"], trainer, sampler, mask)
    assert torch.allclose(ours, theirs.expand_as(ours) * mask, rtol=1e-12, atol=0)
    if mode != "tis":
        assert (ours[mask.bool()] == 0).any()  # the mask is exercised


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.3])
def test_off_policy_mask_matches_trl(threshold: float) -> None:
    trainer, _, mask = _fixed()
    # mean log(mu / pi) per row: 0.5, 1.0, 0.02, 0.0, -0.3 (advantages -, +, -, 0, -)
    offsets = torch.tensor([0.5, 1.0, 0.02, 0.0, -0.3], dtype=torch.float64)
    sampler = trainer + offsets.unsqueeze(1)
    sampler[2, 3] = float("nan")  # counts as 0 in TRL's mean
    adv = torch.tensor([-1.0, 0.5, -0.2, 0.0, -2.0], dtype=torch.float64)
    ours = off_policy_sequence_mask(adv, trainer, sampler, mask.double(), threshold)
    theirs = trl.GRPOTrainer.get_off_policy_mask(
        advantages=adv.unsqueeze(1), per_token_logps=trainer, sampling_per_token_logps=sampler,
        mask=mask.double(), off_policy_threshold=threshold,
    )  # fmt: skip
    assert torch.equal(ours, theirs)
    assert ours.shape == (5, 1) and 0 < float(ours.sum()) < 5  # both outcomes occur
