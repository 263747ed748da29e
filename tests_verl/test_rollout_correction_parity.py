"""Parity of gbmpo's rollout correction (:mod:`gbmpo.objectives.rollout_correction`) with verl
0.9.1's own ``compute_rollout_correction_and_rejection_mask``, called with the
``algorithm.rollout_correction`` settings the verl engine writes for each mode
(:func:`gbmpo.engines.verl.objective.verl_rollout_correction_overrides`), on fixed tensors; and the
``rollout_correction/*`` metrics the engine reads from verl's (:func:`gbmpo.engines.
verl_metrics.rollout_correction_metrics`) against gbmpo's own statistics of the same weights."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("verl")

from verl.trainer.ppo.rollout_corr_helper import (  # noqa: E402
    compute_rollout_correction_and_rejection_mask,
)

from gbmpo.engines.verl.metrics import rollout_correction_metrics  # noqa: E402
from gbmpo.engines.verl.objective import verl_rollout_correction_overrides  # noqa: E402
from gbmpo.objectives.rollout_correction import correction_weights, weight_stats  # noqa: E402
from gbmpo.objectives.spec import RolloutCorrectionSpec  # noqa: E402


def _fixed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sampler = -torch.rand(6, 7, generator=g) * 3
    trainer = sampler + (torch.rand(6, 7, generator=g) - 0.5) * 1.6
    mask = torch.ones(6, 7)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    mask[4, 6] = 0
    return trainer, sampler, mask


def _verl_settings(rc: RolloutCorrectionSpec) -> dict[str, Any]:
    """The engine's overrides of algorithm.rollout_correction, parsed back into values."""
    out: dict[str, Any] = {}
    for item in verl_rollout_correction_overrides(rc):
        key, _, value = item.partition("=")
        if key.startswith("algorithm.rollout_correction."):
            name = key.rsplit(".", 1)[1]
            value = value.strip("'")
            out[name] = None if value == "null" else value
    return out


CASES = [("tis", "token", None, 2.0), ("tis", "token", None, 1.1),
         ("tis", "sequence", None, 2.0), ("mis", "token", 0.5, 2.0),
         ("mis", "sequence", 0.3, 2.0), ("mis", "sequence", 0.01, 100.0),
         ("icepop", "token", 0.8, 1.25)]  # fmt: skip


@pytest.mark.parametrize(("mode", "level", "low", "high"), CASES)
def test_weights_and_metrics_match_verl(mode: str, level: str, low: float | None,
                                        high: float) -> None:  # fmt: skip
    rc = RolloutCorrectionSpec(mode=mode, level=level, low=low, high=high)
    s = _verl_settings(rc)
    assert s["rollout_is"] == level and s["rollout_rs"] is None
    trainer, sampler, mask = _fixed()
    proto, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=trainer, rollout_log_prob=sampler, response_mask=mask,
        rollout_is=s["rollout_is"], rollout_is_threshold=s["rollout_is_threshold"],
        rollout_is_batch_normalize=s["rollout_is_batch_normalize"] == "true",
        rollout_rs=None,
    )  # fmt: skip
    assert torch.equal(new_mask, mask)  # no rejection sampling
    theirs = proto.batch["rollout_is_weights"]
    ours = correction_weights(mode, trainer, sampler, mask, level=level, low=low, high=high)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), (ours - theirs).abs().max()
    # the schema's metrics read from verl's equal gbmpo's own statistics of the weights
    cfg = SimpleNamespace(objective=SimpleNamespace(rollout_correction=rc))
    mapped = rollout_correction_metrics(cfg, metrics)
    own = weight_stats(ours, mask)
    assert "rollout_correction/weight_mean" in mapped
    for key, value in mapped.items():
        assert value == pytest.approx(own[key.split("/", 1)[1]], rel=1e-5, abs=1e-7), key


def test_the_cases_mask_and_truncate() -> None:
    trainer, sampler, mask = _fixed()
    masked = correction_weights("mis", trainer, sampler, mask, level="sequence", low=0.3,
                                high=2.0)  # fmt: skip
    assert (masked[mask.bool()] == 0).any() and (masked[mask.bool()] > 0).any()
    capped = correction_weights("tis", trainer, sampler, mask, high=1.1)
    assert (capped[mask.bool()] == 1.1).any()
