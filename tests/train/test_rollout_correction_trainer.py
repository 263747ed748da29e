"""The rollout correction on the own engine (gbmpo.train.correction): where the sampler's
log-probs equal the trainer's the weights are 1 (up to the rounding of the two forwards), top-p
sampling is a real mismatch the weights see, the weights multiply the surrogate's gradient, and
a run writes the rollout_correction/* metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gbmpo.lifecycle.logging import read_metrics
from gbmpo.rollout import generate
from gbmpo.rollout.logprobs import completion_logprobs
from gbmpo.train import Trainer, load_config
from gbmpo.train.step import accumulate_gradients, no_grad_logprobs

PROMPTS = ["Q: Anna has 3 eggs.\nA:", "Q: Ben has 12 pens and 4 more.\nA:"]


def varied_reward(prompts, completions, **columns):
    return [float(len(c) % 3) / 2 for c in completions]


def _gap(model, tok, generator: str, top_p: float) -> torch.Tensor:
    """log pi_old - log mu over the valid tokens of one sampled batch."""
    batch = generate(model, tok, PROMPTS, num_return_sequences=4, max_new_tokens=10,
                     temperature=0.9, top_p=top_p, generator_seed=3, generator=generator,
                     return_logprobs=True)  # fmt: skip
    trainer, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask,
                                     batch.completion_ids, batch.completion_mask,
                                     temperature=0.9)  # fmt: skip
    assert batch.sampling_logp is not None
    return (trainer - batch.sampling_logp)[batch.completion_mask.bool()]


@pytest.mark.parametrize("generator", ["gbmpo", "hf"])
def test_sampler_log_probs_equal_the_trainers_without_truncation(micro_model, generator):
    model, tok = micro_model
    gap = _gap(model, tok, generator, top_p=1.0)
    assert gap.numel() > 0 and gap.abs().max() < 1e-4  # float32 rounding of two forwards


@pytest.mark.parametrize("generator", ["gbmpo", "hf"])
def test_top_p_is_a_mismatch_with_ratio_at_most_one(micro_model, generator):
    model, tok = micro_model
    gap = _gap(model, tok, generator, top_p=0.5)
    assert gap.max() < 1e-4  # mu is the renormalised truncation: mu >= pi_old
    assert gap.mean() < -1e-2  # and the mismatch is real


def _trainer(micro_model_dir: Path, out: Path | None, **extra: str) -> Trainer:
    overrides = {
        "model.path": str(micro_model_dir), "rollout.prompts_per_step": "2",
        "rollout.num_generations": "4", "rollout.max_new_tokens": "8", "eval.before": "false",
        "eval.after": "false", "eval.every": "0", "run.time_budget_seconds": "null",
        "run.progress": "false", "run.steps": "2", "optim.mini_batch_size": "null",
        "objective.regularizer.name": "none", "objective.regularizer.coef": "0.0",
        "objective.monitor_regularizers": "false",
        **extra,
    }  # fmt: skip
    if out is not None:
        overrides["run.output_dir"] = str(out)
    return Trainer(load_config(None, list(overrides.items())), reward_fn=varied_reward)


def test_weights_multiply_the_surrogate_gradient(micro_model_dir):
    tr = _trainer(micro_model_dir, None)
    batch = generate(tr.model, tr.tokenizer, PROMPTS, num_return_sequences=4, max_new_tokens=8,
                     generator_seed=5)  # fmt: skip
    advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(len(batch))
    old = no_grad_logprobs(tr.models, batch, tr.inference_batch, reference=False)

    def grads(correction: torch.Tensor | None) -> list[torch.Tensor]:
        tr.model.zero_grad(set_to_none=True)
        accumulate_gradients(tr.models, tr.objective, tr.config, tr.micro_batch, batch, rows,
                             advantages, old, None, correction=correction)
        return [p.grad.clone() for p in tr.params]

    mask = batch.completion_mask.float()
    plain, ones, zeros = grads(None), grads(mask.clone()), grads(torch.zeros_like(mask))
    doubled = grads(2 * mask)
    for a, b, c, d in zip(plain, ones, zeros, doubled, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert c.abs().max() == 0  # no regularizer: every token masked -> no gradient
        torch.testing.assert_close(d, 2 * a, rtol=1e-5, atol=1e-7)
    assert any(x.abs().sum() > 0 for x in plain)


@pytest.mark.parametrize(
    ("settings", "one"),
    [({"objective.rollout_correction.mode": "tis"}, True),
     ({"objective.rollout_correction.mode": "mis", "objective.rollout_correction.low": "0.9",
       "objective.rollout_correction.high": "1.0", "rollout.top_p": "0.5",
       "objective.rollout_correction.off_policy_mask_threshold": "0.0"}, False)],
)  # fmt: skip
def test_a_run_logs_the_correction(micro_model_dir, tmp_path, settings, one):
    tr = _trainer(micro_model_dir, tmp_path / "run", **settings)
    assert tr.needs_old  # the trainer's old log-probs are computed for the comparison
    tr.train()
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in r
            and "rollout_correction/weight_mean" in r]  # fmt: skip
    assert len(rows) == 2
    for r in rows:
        if one:  # top_p 1: the sampler is the trainer up to rounding
            assert abs(r["rollout_correction/weight_min"] - 1) < 1e-4
            assert abs(r["rollout_correction/weight_max"] - 1) < 1e-4
            assert r["rollout_correction/masked_frac"] == 0.0
        else:  # top_p 0.5: ratios below 1, those under 0.9 masked
            assert r["rollout_correction/weight_max"] <= 1.0 + 1e-4
            assert 0.0 < r["rollout_correction/masked_frac"] <= 1.0


def test_default_is_off(micro_model_dir, tmp_path):
    tr = _trainer(micro_model_dir, tmp_path / "run", **{"run.steps": "1"})
    assert not tr.needs_old
    tr.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert not any(k.startswith("rollout_correction/") for r in rows for k in r)
