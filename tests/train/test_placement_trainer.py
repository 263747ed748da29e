"""The own trainer with ``objective.regularizer.placement: reward`` and with a list of regularizer
terms: the penalty reaches the advantages (not the loss), each term is logged, the summary names
the sum."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gbmpo.config import ConfigError, validate
from gbmpo.train import Trainer, load_config


def varied_reward(prompts, completions, **columns):
    """A deterministic reward with spread inside every group."""
    return [float(len(c) % 3) / 2 for c in completions]


def _config(model_dir: Path, out: Path | None, *overrides: tuple[str, Any]):
    base = {
        "model.path": str(model_dir),
        "rollout.prompts_per_step": "2",
        "rollout.num_generations": "4",
        "rollout.max_new_tokens": "8",
        "eval.before": "false",
        "eval.after": "false",
        "eval.every": "0",
        "run.time_budget_seconds": "null",
        "run.progress": "false",
        "run.steps": "1",
        "optim.lr": "1e-2",
        "optim.mini_batch_size": "null",
    }
    if out is not None:
        base["run.output_dir"] = str(out)
    return validate(load_config(None, [*base.items(), *overrides]))


def _capture_advantage_inputs(trainer: Trainer) -> list[torch.Tensor]:
    """Record the rewards the advantage estimator receives."""
    seen: list[torch.Tensor] = []
    estimator = trainer.objective.advantage

    def capture(rewards: torch.Tensor, group: int) -> torch.Tensor:
        seen.append(rewards.detach().clone())
        return estimator(rewards, group)

    trainer.objective = dataclasses.replace(trainer.objective, advantage=capture)
    return seen


def _perturb(trainer: Trainer) -> None:
    """Move the policy off the reference so that D(pi_old || pi_ref) is not 0."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))


def test_reward_placement_shapes_the_advantages_not_the_loss(micro_model_dir: Path) -> None:
    cfg = _config(
        micro_model_dir, None,
        ("objective.regularizer.name", "kl_k1"),
        ("objective.regularizer.coef", "0.5"),
        ("objective.regularizer.placement", "reward"),
    )  # fmt: skip
    trainer = Trainer(cfg, reward_fn=varied_reward)
    assert trainer.needs_ref and trainer.ref_model is not None
    _perturb(trainer)
    seen = _capture_advantage_inputs(trainer)
    record = trainer.train_step()
    (shaped,) = seen
    # reward_mean is the task reward; the penalty is what the advantages saw subtracted
    assert record["reward_penalty"] != 0
    assert record["reward_mean"] - float(shaped.mean()) == pytest.approx(
        record["reward_penalty"], abs=1e-5
    )
    assert record["reg_loss"] == 0.0 and record["reg_value"] == 0.0  # nothing in the loss
    assert "reg/kl_k1" in record
    # the per-sequence penalty is coef * the token sum of D(pi_old || pi_ref); averaged over the
    # batch, coef * mean sequence length * the token mean logged as reg/kl_k1
    tokens_per_seq = record["response_length_mean"]
    assert record["reward_penalty"] == pytest.approx(
        0.5 * tokens_per_seq * record["reg/kl_k1"], rel=1e-4
    )


def test_a_sum_of_regularizers_logs_each_term(micro_model_dir: Path, tmp_path: Path) -> None:
    terms = "[{name: prob_l2, coef: 0.05}, {name: kl_k3, coef: 0.01}, " \
            "{name: kl_k1, coef: 0.2, placement: reward}]"  # fmt: skip
    cfg = _config(micro_model_dir, tmp_path / "run", ("objective.regularizer", terms))
    trainer = Trainer(cfg, reward_fn=varied_reward)
    _perturb(trainer)
    summary = trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    record = rows[0]
    for name in ("prob_l2", "kl_k3"):
        assert f"reg_loss/{name}" in record and f"reg/{name}" in record
    assert record["reg_loss"] == pytest.approx(
        record["reg_loss/prob_l2"] + record["reg_loss/kl_k3"], rel=1e-6
    )
    assert "reg_loss/kl_k1" not in record  # placed in the reward
    assert record["reward_penalty/kl_k1"] == pytest.approx(record["reward_penalty"])
    assert summary["regularizer"] == "prob_l2+kl_k3+kl_k1"
    assert summary["coef"] == [0.05, 0.01, 0.2]


def test_placement_errors_name_the_key(micro_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"objective.regularizer.placement' must be"):
        _config(micro_model_dir, None, ("objective.regularizer.placement", "bogus"))
    with pytest.raises(ConfigError, match=r"placement'=reward.*anchor"):
        _config(
            micro_model_dir, None,
            ("objective.regularizer.anchor", "old"),
            ("objective.regularizer.placement", "reward"),
        )  # fmt: skip
    with pytest.raises(ConfigError, match="lists 'kl_k3' twice"):
        _config(
            micro_model_dir, None,
            ("objective.regularizer", [{"name": "kl_k3"}, {"name": "kl_k3", "coef": 0.1}]),
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"objective.regularizer\[1\].coef"):
        _config(
            micro_model_dir,
            None,
            ("objective.regularizer", [{"name": "kl_k3"}, {"name": "prob_l2", "coef": "x"}]),
        )


def test_config_overrides_of_the_list_and_of_one_term(tmp_path: Path) -> None:
    cfg = load_config(None, [("objective.regularizer.placement", "reward"), ("coef", "0.1")])
    assert cfg.objective.regularizer.placement == "reward" and cfg.objective.regularizer.coef == 0.1
    listed = "[{name: prob_l2, coef: 0.05}, {name: kl_k3, coef: 0.01}]"
    cfg = load_config(None, [("objective.regularizer", listed)])
    assert [t.name for t in cfg.objective.terms] == ["prob_l2", "kl_k3"]
    assert cfg.objective.regularizer_label == "prob_l2+kl_k3"
    path = tmp_path / "sum.yaml"
    path.write_text(f"objective:\n  regularizer: {listed}\n")
    assert load_config(path).objective.coef_label == [0.05, 0.01]
    with pytest.raises(ConfigError, match="is a list of 2 terms"):
        load_config(path, [("coef", "0.2")])
    with pytest.raises(ConfigError, match=r"unknown key 'objective.regularizer\[1\].foo'"):
        load_config(None, [("objective.regularizer", "[{name: kl_k3}, {name: kl_k1, foo: 1}]")])
    with pytest.raises(ConfigError, match=r"unknown key 'objective.regularizer.foo'"):
        load_config(None, [("objective.regularizer.foo", "1")])


def test_reports_group_a_sum_by_its_terms_and_a_placement_apart() -> None:
    from gbmpo.config import config_to_dict
    from gbmpo.experiments.report import _coef
    from gbmpo.experiments.runs import default_label, group_key

    def cfg(*overrides: tuple[str, Any]) -> dict[str, Any]:
        return config_to_dict(load_config(None, list(overrides)))

    listed = cfg(
        ("objective.regularizer", "[{name: prob_l2, coef: 0.05}, {name: kl_k3, coef: 0.01}]")
    )
    assert default_label(listed) == "prob_l2+kl_k3"
    assert group_key(listed)[1:3] == ("prob_l2+kl_k3", (0.05, 0.01))
    assert _coef(group_key(listed)[2]) == "0.05+0.01"
    assert group_key(cfg())[1:] == ("prob_l2", 0.05, "{}")  # one term: as before
    old_run = cfg()
    del old_run["objective"]["regularizer"]["placement"]  # a run directory from before the key
    assert group_key(old_run) == group_key(cfg())
    in_reward = cfg(("regularizer", "kl_k1"), ("objective.regularizer.placement", "reward"))
    assert default_label(in_reward) == "kl_k1[placement=reward]"
    assert group_key(in_reward) != group_key(cfg(("regularizer", "kl_k1")))


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo"])
def test_advantage_placement_subtracts_the_future_penalty_after_normalising(
    micro_model_dir: Path, advantage: str
) -> None:
    """placement: advantage (FRPO): the advantage estimator sees the task rewards unchanged, the
    loss sees per-token advantages A_i - beta * sum_{s >= t} D_s, and the logged penalty is
    beta * sum_t D_t per sequence."""
    from gbmpo.objectives.placement import advantage_penalty
    from gbmpo.train import step as step_mod

    cfg = _config(
        micro_model_dir, None,
        ("objective.advantage", advantage),
        ("objective.regularizer.name", "kl_k1"),
        ("objective.regularizer.coef", "0.5"),
        ("objective.regularizer.placement", "advantage"),
    )  # fmt: skip
    trainer = Trainer(cfg, reward_fn=varied_reward)
    _perturb(trainer)
    seen = _capture_advantage_inputs(trainer)
    used: list[torch.Tensor] = []
    original = step_mod.accumulate_gradients

    def spy(models, objective, cfg, micro_batch, batch, rows, advantages, *args, **kwargs):
        used.append(advantages.detach().clone())
        return original(models, objective, cfg, micro_batch, batch, rows, advantages, *args,
                        **kwargs)

    step_mod.accumulate_gradients = spy
    try:
        record = trainer.train_step()
    finally:
        step_mod.accumulate_gradients = original
    (rewards,) = seen
    assert record["reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-6)
    assert "reward_penalty" not in record and record["reg_loss"] == 0.0
    (adv,) = used
    assert adv.dim() == 2  # per token
    tokens_per_seq = record["response_length_mean"]
    assert record["advantage_penalty"] == pytest.approx(
        0.5 * tokens_per_seq * record["reg/kl_k1"], rel=1e-4
    )
    # the first token's advantage is the normalised one minus beta * the whole sequence's D
    base = trainer.objective.advantage(rewards, cfg.rollout.num_generations)
    shift = base[:, None] - adv
    first = shift[:, 0]
    assert float(first.abs().max()) > 0
    assert float(first.mean() / 0.5) == pytest.approx(
        record["advantage_penalty"] / 0.5, rel=1e-4
    )
    assert advantage_penalty  # the function the step uses (unit-tested with the enumeration)


def test_advantage_placement_is_refused_on_trl_and_verl_and_reward_notes_the_std(
    micro_model_dir: Path,
) -> None:
    from gbmpo.config.support import VERL_REQUIRED, check_support

    cfg = _config(micro_model_dir, None, ("objective.regularizer.placement", "advantage"))
    assert check_support(cfg, "gbmpo") == []
    for engine in ("trl", "verl"):
        c = cfg
        if engine == "verl":
            c = _config(micro_model_dir, None, ("objective.regularizer.placement", "advantage"),
                        *VERL_REQUIRED.items())
        with pytest.raises(ConfigError, match=r"placement'='advantage'.*not supported"):
            check_support(c, engine)
    noted = _config(
        micro_model_dir, None,
        ("objective.advantage", "grpo"),
        ("objective.regularizer.name", "kl_k1"),
        ("objective.regularizer.placement", "reward"),
    )  # fmt: skip
    (note,) = check_support(noted, "gbmpo")
    assert "beta is divided by each group's std" in note and "Dr. GRPO" in note
    plain = _config(
        micro_model_dir, None,
        ("objective.advantage", "dr_grpo"),
        ("objective.regularizer.name", "kl_k1"),
        ("objective.regularizer.placement", "reward"),
    )  # fmt: skip
    assert check_support(plain, "gbmpo") == []
