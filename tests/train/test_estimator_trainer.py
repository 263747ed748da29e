"""The own trainer with ``objective.regularizer.estimator: full``: the accumulated gradient is
the gradient of the exact full-vocabulary divergence (checked against an independent brute-force
loss), the in-reward penalty is the exact divergence of the rollout, ``gbmpo train`` runs end to
end, and the TRL and verl engines refuse it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gbmpo.config import ConfigError
from gbmpo.config.support import check_support
from gbmpo.objectives.aggregate import aggregate
from gbmpo.rollout import generate
from gbmpo.rollout.logprobs import completion_logits
from gbmpo.train import Trainer, load_config
from gbmpo.train.step import accumulate_gradients, no_grad_logprobs


def varied_reward(prompts, completions, **columns):
    return [float(len(c) % 3) / 2 for c in completions]


def _config(model_dir: Path, out: Path | None = None, **extra: str):
    overrides = {
        "model.path": str(model_dir),
        "rollout.prompts_per_step": "2",
        "rollout.num_generations": "4",
        "rollout.max_new_tokens": "6",
        "eval.before": "false",
        "eval.after": "false",
        "eval.every": "0",
        "run.time_budget_seconds": "null",
        "run.progress": "false",
        "run.steps": "2",
        "optim.lr": "1e-3",
        "optim.mini_batch_size": "null",
        "objective.monitor_regularizers": "false",
    }
    if out is not None:
        overrides["run.output_dir"] = str(out)
    overrides.update(extra)
    return load_config(None, list(overrides.items()))


def _perturbed_trainer(model_dir: Path, **extra: str) -> Trainer:
    trainer = Trainer(_config(model_dir, **extra), reward_fn=varied_reward)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the policy off the reference: the divergence is not 0
        for p in trainer.params:
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
    return trainer


def _batch(trainer: Trainer):
    prompts = ["Q: Anna has 3 eggs.\nA:", "Q: Ben has 12 pens and 4 more.\nA:"]
    batch = generate(trainer.model, trainer.tokenizer, prompts, num_return_sequences=4,
                     max_new_tokens=6, generator_seed=5)  # fmt: skip
    lengths = torch.tensor([6, 3, 5, 1, 6, 2, 4, 6])
    c = batch.completion_ids.shape[1]
    batch.completion_mask = (torch.arange(c) < lengths[:, None].clamp(max=c)).long()
    return batch


def _logits(trainer: Trainer, model, batch) -> torch.Tensor:
    return completion_logits(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                             batch.completion_mask, temperature=trainer.config.rollout.temperature)


def _brute_kl(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    lp, lq = torch.log_softmax(x.double(), -1), torch.log_softmax(y.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def test_full_kl_gradient_is_the_exact_divergences_gradient(micro_model_dir: Path) -> None:
    """Advantages 0 (no surrogate gradient): the accumulated gradient is coef * grad of
    agg(KL(pi || pi_ref)), with the same value for 1 and 8 sequences per micro-batch."""
    coef = 0.7
    trainer = _perturbed_trainer(micro_model_dir, **{
        "objective.regularizer.name": "kl_k3", "objective.regularizer.coef": str(coef),
        "objective.regularizer.estimator": "full",
    })  # fmt: skip
    batch = _batch(trainer)
    mask = batch.completion_mask.float()
    rows = torch.arange(len(batch))
    advantages = torch.zeros(len(batch))
    ref_logp = no_grad_logprobs(trainer.models, batch, trainer.inference_batch, reference=True)

    def grads(micro: int) -> list[torch.Tensor]:
        trainer.model.zero_grad(set_to_none=True)
        accumulate_gradients(trainer.models, trainer.objective, trainer.config, micro, batch,
                             rows, advantages, None, ref_logp)
        return [p.grad.clone() for p in trainer.params]

    got = grads(len(batch))
    trainer.model.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref = _logits(trainer, trainer.ref_model, batch)
    kl = _brute_kl(_logits(trainer, trainer.model, batch), ref) * mask.double()
    loss = aggregate(coef * kl, mask.double(), "dr_grpo", trainer.config.rollout.max_new_tokens,
                     num_sequences=len(batch), num_tokens=float(mask.sum()))  # fmt: skip
    want = torch.autograd.grad(loss, trainer.params)
    assert float(kl.detach().sum()) > 1e-4
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-4, atol=1e-7)
    for a, b in zip(got, grads(1), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_full_in_reward_penalty_is_the_exact_divergence_of_the_rollout(
    micro_model_dir: Path,
) -> None:
    from gbmpo.train.penalties import in_reward_penalties

    trainer = _perturbed_trainer(micro_model_dir, **{
        "objective.regularizer.name": "prob_l2", "objective.regularizer.coef": "2.0",
        "objective.regularizer.placement": "reward", "objective.regularizer.estimator": "full",
    })  # fmt: skip
    trainer.micro_batch = 3  # uneven chunks of the rollout
    batch = _batch(trainer)
    mask = batch.completion_mask.float()
    rewards = torch.arange(len(batch), dtype=torch.float32)
    old = no_grad_logprobs(trainer.models, batch, trainer.inference_batch, reference=False)
    ref_logp = no_grad_logprobs(trainer.models, batch, trainer.inference_batch, reference=True)
    shaped, penalties = in_reward_penalties(trainer.objective.reward_terms, rewards, old,
                                            ref_logp, mask, trainer.models, batch,
                                            trainer.micro_batch)
    with torch.no_grad():
        p = torch.softmax(_logits(trainer, trainer.model, batch).double(), -1)
        q = torch.softmax(_logits(trainer, trainer.ref_model, batch).double(), -1)
    exact = (((p - q) ** 2).sum(-1) * mask.double()).sum(-1)
    assert float(exact.min()) > 0
    torch.testing.assert_close(penalties["prob_l2"].double(), 2.0 * exact, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(shaped.double(), rewards.double() - 2.0 * exact, rtol=1e-5,
                               atol=1e-7)


def test_gbmpo_train_with_full_estimators_runs_end_to_end(micro_model_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    from gbmpo.cli import main

    run = tmp_path / "run"
    spec = tmp_path / "objective.yaml"
    spec.write_text(
        "objective:\n"
        "  regularizer:\n"
        "    - {name: kl_k3, coef: 0.05, estimator: full}\n"
        "    - {name: prob_l2, coef: 0.1}\n"
        "    - {name: kl_k1, coef: 0.01, placement: reward, estimator: full}\n"
    )
    args = ["train", "--config", str(spec), "--model", str(micro_model_dir), "--output-dir",
            str(run), "--steps", "2", "--rollout.prompts_per_step", "2",
            "--rollout.num_generations", "2", "--rollout.max_new_tokens", "4",
            "--time-budget", "null", "--eval.before", "false", "--eval.after", "false",
            "--eval.every", "0", "--run.progress", "false",
            "--objective.monitor_regularizers", "false",
            "--optim.mini_batch_size", "null"]  # fmt: skip
    code = main(args)
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reg_value/kl_k3" in r]
    assert len(steps) == 2
    for r in steps:
        # exact KL >= 0; at step 1 the policy is the reference, so rounding may give -1e-10
        assert r["reg_value/kl_k3"] >= -1e-6 and "reward_penalty/kl_k1" in r
        assert all(v == v for v in r.values() if isinstance(v, float))  # no NaN


@pytest.mark.parametrize("engine", ["verl"])
def test_other_engines_refuse_full(engine: str) -> None:
    from gbmpo.config.support import REQUIRED

    cfg = load_config(None, [*REQUIRED[engine].items(),
                             ("objective.regularizer.estimator", "full")])  # fmt: skip
    with pytest.raises(ConfigError, match=rf"regularizer.estimator.*'full'.*engine '{engine}'"):
        check_support(cfg, engine)


def test_gbmpo_trainer_takes_full_and_verl_overrides_refuse_it() -> None:
    pytest.importorskip("trl")
    from gbmpo.engines.verl.objective import verl_objective_overrides
    from gbmpo.integrations.trl import GBMPOConfig, build_objective

    spec = {"regularizer": {"name": "kl_k3", "coef": 0.1, "estimator": "full"}}
    args = GBMPOConfig(output_dir="/tmp/unused-gbmpo-probe", objective=spec, use_cpu=True)
    assert [t.name for t in build_objective(args).full_loss_terms] == ["kl_k3"]
    assert check_support(load_config(None, [("engine", "trl"),
                                            ("objective.regularizer.estimator", "full")])) == []
    with pytest.raises(ValueError, match="estimator'='full'.*verl"):
        verl_objective_overrides(spec, max_response_length=8)


def test_reports_keep_full_apart_from_sample() -> None:
    from gbmpo.config import config_to_dict
    from gbmpo.experiments.runs import default_label, group_key

    def cfg(*overrides: tuple[str, str]) -> dict:
        return config_to_dict(load_config(None, [("regularizer", "kl_k3"), *overrides]))

    sample, full = cfg(), cfg(("objective.regularizer.estimator", "full"))
    assert default_label(full) == "kl_k3[estimator=full]" and default_label(sample) == "kl_k3"
    assert group_key(full) != group_key(sample)
    old_run = cfg()
    del old_run["objective"]["regularizer"]["estimator"]  # a run directory from before the key
    assert group_key(old_run) == group_key(sample)
    assert group_key(sample)[1:] == ("kl_k3", 0.05, "{}")


def test_full_with_lora_takes_the_reference_from_the_disabled_adapters(
    micro_model_dir: Path,
) -> None:
    """With LoRA the reference is the model with its adapters off (no copy); after the adapters
    move, the exact KL of the next step is positive and finite."""
    trainer = Trainer(_config(micro_model_dir, **{
        "lora.enabled": "true", "lora.target_modules": "q_proj,v_proj", "optim.lr": "5e-2",
        "objective.regularizer.name": "kl_k2", "objective.regularizer.estimator": "full",
    }), reward_fn=varied_reward)  # fmt: skip
    assert trainer.ref_model is None
    first = trainer.train_step()
    second = trainer.train_step()
    assert first["reg_value"] == pytest.approx(0.0, abs=1e-6)  # adapters start at zero
    assert 0 < second["reg_value"] < float("inf")
