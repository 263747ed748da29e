"""GBMPOTrainer with a sum of regularizer terms (``objective.regularizer`` a list) and with
``placement: reward`` (its values against the own engine: test_trl_knob.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer, build_objective  # noqa: E402

SUM = [{"name": "prob_l2", "coef": 0.05}, {"name": "kl_k3", "coef": 0.01, "anchor": "ref"}]
BASE = {"advantage": "grpo", "aggregation": "dr_grpo", "monitor_regularizers": False}


def _inputs(trainer: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    b, p, t = 4, 5, 8
    prompt_ids = torch.randint(3, vocab, (b, p), generator=g)
    completion_ids = torch.randint(3, vocab, (b, t), generator=g)
    completion_mask = (torch.arange(t)[None, :] < torch.tensor([8, 5, 3, 7])[:, None]).long()
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            t,
        )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8]),
        "old_per_token_logps": logps + 0.2 * torch.randn(b, t, generator=g),
        "ref_per_token_logps": logps + 0.5 * torch.randn(b, t, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def test_a_sum_of_terms_builds_and_switches_the_reference_on() -> None:
    c = GBMPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                    objective={**BASE, "regularizer": SUM})  # fmt: skip
    obj = build_objective(c)
    assert [t.name for t in obj.terms] == ["prob_l2", "kl_k3"]
    assert c.needs_reference_model and c.beta == 0.05
    # a first term that needs no reference: beta still switches the reference forward on
    first_old = [{"name": "rpg_fkl", "coef": 0.1, "anchor": "old"}, {"name": "kl_k3", "coef": 0.02}]
    c = GBMPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                    objective={**BASE, "regularizer": first_old})  # fmt: skip
    assert c.needs_reference_model and c.beta == 0.02


def test_reward_placement_builds_and_refuses_normalize_then_sum() -> None:
    """``placement: reward`` is GBMPOTrainer's (the shaped rewards' advantages); TRL's
    normalisation of each reward function before their sum has no one reward to shape."""
    reg = {"name": "kl_k1", "coef": 0.1, "placement": "reward"}
    c = GBMPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                    objective={**BASE, "regularizer": reg})  # fmt: skip
    obj = build_objective(c)
    assert [t.name for t in obj.reward_terms] == ["kl_k1"] and c.beta == 0.1
    with pytest.raises(ValueError, match="placement=reward.*normalize_then_sum"):
        GBMPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                    multi_objective_aggregation="normalize_then_sum",
                    objective={**BASE, "regularizer": reg})  # fmt: skip


def test_the_loss_of_a_sum_is_the_sum_of_the_terms(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any, cpu_args: dict[str, Any]
) -> None:
    def trainer(regularizer: Any) -> Any:
        args = GBMPOConfig(output_dir=str(tmp_path), **cpu_args,
                           objective={**BASE, "regularizer": regularizer})  # fmt: skip
        return GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                            train_dataset=tiny_dataset)  # fmt: skip

    # ProbL2 is ~1e-9 on the tiny model's near-uniform probabilities: log_l2 has a visible term
    terms = [{"name": "log_l2", "coef": 0.5}, {"name": "kl_k3", "coef": 0.1}]
    losses = {}
    inputs = None
    for key, reg in (("sum", terms), ("log_l2", terms[0]), ("kl_k3", terms[1]),
                     ("none", {"name": "none", "coef": 0.0})):  # fmt: skip
        t = trainer(reg)
        inputs = inputs or _inputs(t)
        t.model.train()
        t.current_gradient_accumulation_steps = 1
        losses[key] = float(t._compute_loss(t.model, dict(inputs)).detach())
        if key == "sum":
            metrics = t._metrics["train"]
    reg_a, reg_b = losses["log_l2"] - losses["none"], losses["kl_k3"] - losses["none"]
    assert abs(reg_a) > 1e-6 and abs(reg_b) > 1e-6
    assert losses["sum"] == pytest.approx(losses["none"] + reg_a + reg_b, abs=1e-6)
    assert metrics["reg_loss/log_l2"][-1] == pytest.approx(reg_a, abs=1e-6)
    assert metrics["reg_loss/kl_k3"][-1] == pytest.approx(reg_b, abs=1e-6)
    assert "reg_value" in metrics and "reg_value/kl_k3" in metrics and "reg_value/log_l2" in metrics


def test_schema_names_of_a_sum() -> None:
    from gbmpo.engines.trl.callbacks import schema_record

    logs = {"reg_value": 1.0, "reg_value/log_l2": 0.25, "reg_loss": 0.5,
            "reg_loss/kl_k3": 0.125, "reg/prob_l2": 3.0, "kl": 0.5}  # fmt: skip
    assert schema_record(logs) == {
        "reg_value": 1.0, "reg_value/log_l2": 0.25, "reg_loss": 0.5, "reg_loss/kl_k3": 0.125,
        "reg/prob_l2": 3.0, "trl/kl": 0.5,
    }  # fmt: skip
