"""The whole divergence knob on TRL: ``estimator: full`` and ``placement: reward`` through
GBMPOTrainer give the own engine's values and gradients on a fixed batch (float64), the
enumerated-policy gradient check passes through GBMPOTrainer's reward shaping, and the
settings that meant two things (bnpo's normaliser, the entropy metric with several passes,
``trust_remote_code``) mean one."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from gbmpo.engines.trl.full import (  # noqa: E402
    TRL_STD_EPS,
    sequence_penalties,
    shaped_advantages,
)
from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer  # noqa: E402
from gbmpo.objectives.loss import compute_policy_loss, sequence_divergence  # noqa: E402
from gbmpo.objectives.regularizers import get_regularizer  # noqa: E402
from gbmpo.rollout.sampling import Rollout  # noqa: E402
from gbmpo.train import Trainer, load_config  # noqa: E402
from gbmpo.train.step import accumulate_gradients, in_reward_penalties  # noqa: E402

B, P, T, G = 8, 5, 7, 4  # rows, prompt length (no padding), completion length, group size
TEMPERATURE = 0.8
LENGTHS = torch.tensor([7, 3, 5, 1, 7, 2, 6, 4])


def _objective(regularizer: dict[str, Any], aggregation: str = "dr_grpo") -> dict[str, Any]:
    return {"advantage": "dr_grpo", "aggregation": aggregation, "regularizer": regularizer,
            "monitor_regularizers": False}  # fmt: skip


def _perturb(model: Any) -> None:
    """Move the policy off the reference (the same way on both engines): divergences are not 0."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def _pair(tmp_path: Path, model_dir: str, tiny_dataset: Any, reward_fn: Any,
          cpu_args: dict[str, Any], regularizer: dict[str, Any],
          aggregation: str = "dr_grpo") -> tuple[Trainer, GBMPOTrainer]:  # fmt: skip
    """The own engine's Trainer and a GBMPOTrainer on the same float64 model (perturbed off
    its float64 reference) with the same objective."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    objective = _objective(regularizer, aggregation)
    overrides = {"model.path": model_dir, "rollout.prompts_per_step": B // G,
                 "rollout.num_generations": G, "rollout.max_new_tokens": T,
                 "rollout.temperature": TEMPERATURE, "optim.mini_batch_size": None,
                 "eval.before": False, "eval.after": False, "run.progress": False,
                 "run.time_budget_seconds": None,
                 **{f"objective.{k}": v for k, v in objective.items()}}  # fmt: skip
    cfg = load_config(None, list(overrides.items()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    own_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    own = Trainer(cfg, model=own_model, tokenizer=tok, reward_fn=lambda p, c, **k: [0.0] * len(c))
    _perturb(own.model)
    args = GBMPOConfig(output_dir=str(tmp_path), **{**cpu_args, "per_device_train_batch_size": B},
                       max_completion_length=T, temperature=TEMPERATURE,
                       objective=objective)  # fmt: skip
    trl = GBMPOTrainer(model=model_dir, reward_funcs=reward_fn, args=args,
                       train_dataset=tiny_dataset)  # fmt: skip
    trl.model.double()
    if trl.ref_model is not None:
        trl.ref_model.double()
    _perturb(trl.model)
    return own, trl


def _batch() -> Rollout:
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 300, (B, P), generator=g)
    completion_ids = torch.randint(3, 300, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < LENGTHS[:, None]).long()
    return Rollout(prompt_ids=prompt_ids, prompt_mask=torch.ones(B, P, dtype=torch.long),
                   completion_ids=completion_ids, completion_mask=mask, texts=[""] * B,
                   num_tokens=LENGTHS.tolist())  # fmt: skip


def _trl_inputs(batch: Rollout, old: torch.Tensor, ref: torch.Tensor,
                advantages: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    return {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask,
            "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
            "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
            "num_items_in_batch": batch.completion_mask.sum(),
            "mini_batch_tokens": batch.completion_mask.sum()}  # fmt: skip


@pytest.mark.parametrize("regularizer", [
    {"name": "kl_k3", "coef": 0.7, "estimator": "full"},
    [{"name": "prob_l2", "coef": 3.0, "estimator": "full"}, {"name": "kl_k1", "coef": 0.2}],
], ids=["kl_full", "prob_l2_full_plus_k1"])  # fmt: skip
def test_full_estimator_loss_and_gradient_equal_the_own_engines(
    regularizer: Any, tmp_path: Path, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:
    """A fixed batch (ragged completions, off-policy old log-probs, advantages of both signs),
    float64: GBMPOTrainer's loss and every parameter's gradient equal the own engine's, whose
    exact-divergence gradient is checked against a brute-force loss in tests/train."""
    own, trl = _pair(tmp_path, tiny_model_dir, tiny_dataset, reward_fn, cpu_args, regularizer)
    assert trl.objective.full_loss_terms
    batch = _batch()
    from gbmpo.train.step import no_grad_logprobs

    ref = no_grad_logprobs(own.models, batch, own.inference_batch, reference=True)
    g = torch.Generator().manual_seed(1)
    old = (no_grad_logprobs(own.models, batch, own.inference_batch, reference=False)
           + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64))  # fmt: skip
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8, 0.6, -1.2, 0.2, 0.9], dtype=torch.float64)

    own.model.zero_grad(set_to_none=True)
    stats = accumulate_gradients(own.models, own.objective, own.config, own.micro_batch, batch,
                                 torch.arange(B), advantages, old, ref)
    own_grads = {n: p.grad for n, p in own.model.named_parameters()}

    trl.model.train()
    trl.current_gradient_accumulation_steps = 1
    trl.model.zero_grad(set_to_none=True)
    loss = trl._compute_loss(trl.model, _trl_inputs(batch, old, ref, advantages))
    loss.backward()
    trl_grads = {n: p.grad for n, p in trl.model.named_parameters()}

    assert float(loss) == pytest.approx(stats.loss, rel=1e-9, abs=1e-12)
    assert set(own_grads) == set(trl_grads)
    scale = max(float(g.abs().max()) for g in own_grads.values())
    assert scale > 1e-4
    for name, grad in own_grads.items():
        torch.testing.assert_close(trl_grads[name], grad, rtol=1e-7, atol=1e-10, msg=name)
    # the exact term is in the loss: the sampled-token estimate would give another loss
    sampled = copy.deepcopy(regularizer)
    for term in sampled if isinstance(sampled, list) else [sampled]:
        term["estimator"] = "sample"
    own_s, _ = _pair(tmp_path / "s", tiny_model_dir, tiny_dataset, reward_fn, cpu_args, sampled)
    other = accumulate_gradients(own_s.models, own_s.objective, own_s.config, own_s.micro_batch,
                                 batch, torch.arange(B), advantages, old, ref)
    assert abs(other.loss - stats.loss) > 1e-6


@pytest.mark.parametrize("regularizer", [
    {"name": "kl_k1", "coef": 0.3, "placement": "reward"},
    [{"name": "prob_l2", "coef": 2.0, "placement": "reward", "estimator": "full"},
     {"name": "kl_k3", "coef": 0.1, "placement": "reward"}],
], ids=["k1_sample", "prob_l2_full_plus_k3"])  # fmt: skip
def test_reward_penalties_and_advantages_equal_the_own_engines(
    regularizer: Any, tmp_path: Path, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:
    """The per-sequence penalties GBMPOTrainer subtracts (from TRL's rollout and reference
    log-probs; the exact divergence from the logits for ``full``) and the advantages of the
    shaped rewards equal the own engine's (its advantage with TRL's std epsilon); the loss has
    no regularizer term."""
    own, trl = _pair(tmp_path, tiny_model_dir, tiny_dataset, reward_fn, cpu_args, regularizer)
    assert trl.objective.reward_terms and trl.beta != 0  # TRL computes the reference log-probs
    batch = _batch()
    from gbmpo.train.step import no_grad_logprobs

    old = no_grad_logprobs(own.models, batch, own.inference_batch, reference=False)
    ref = no_grad_logprobs(own.models, batch, own.inference_batch, reference=True)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.25, 1.0], dtype=torch.float64)
    mask = batch.completion_mask.double()
    shaped, own_pen = in_reward_penalties(own.objective.reward_terms, rewards, old, ref, mask,
                                          own.models, batch, own.micro_batch)
    output = _trl_inputs(batch, old, ref, torch.zeros(B))
    trl_pen = sequence_penalties(trl, output, trl.objective.reward_terms)
    assert set(own_pen) == set(trl_pen)
    for name in own_pen:
        assert float(own_pen[name].abs().min()) > 1e-6
        torch.testing.assert_close(trl_pen[name].double(), own_pen[name].double(), rtol=1e-5,
                                   atol=1e-9)  # fmt: skip
    # on-policy (TRL skipped the old log-probs): the current policy's, the same penalties
    no_old = {k: v for k, v in output.items() if k != "old_per_token_logps"}
    again = sequence_penalties(trl, no_old, trl.objective.reward_terms)
    for name in own_pen:
        torch.testing.assert_close(again[name], trl_pen[name])
    total = sum(trl_pen.values()).double()
    for scale, mode in (("none", "dr_grpo"), ("group", "grpo"), ("batch", "batch")):
        from gbmpo.objectives.advantages import ADVANTAGES

        want = ADVANTAGES.get(mode)(shaped, G, eps=TRL_STD_EPS)
        got = shaped_advantages(rewards, total, G, scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_reward_placement_shapes_trls_advantages(
    tmp_path: Path, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:
    """Through TRL's generation step: the batch's advantages are those of the rewards minus the
    penalties, and without a penalty :func:`shaped_advantages` is TRL's own advantage (GRPOTrainer's
    step on the same samples); reward_penalty is logged beside TRL's reward."""
    reg = {"name": "kl_k1", "coef": 0.5, "placement": "reward"}
    args = GBMPOConfig(output_dir=str(tmp_path), **cpu_args, max_completion_length=6,
                       objective={**_objective(reg), "advantage": "grpo"})  # fmt: skip
    trainer = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                           train_dataset=tiny_dataset)  # fmt: skip
    _perturb(trainer.model)  # the rollout policy differs from the reference
    examples = [tiny_dataset[i] for i in range(4)]
    trainer.model.train()
    torch.manual_seed(0)
    stock = GRPOTrainer._generate_and_score_completions(trainer, examples)
    rewards = trainer._rewards_per_func.sum(dim=1)
    torch.testing.assert_close(
        shaped_advantages(rewards, torch.zeros_like(rewards), 4, "group"), stock["advantages"]
    )
    torch.manual_seed(0)
    ours = trainer._generate_and_score_completions(examples)
    assert torch.equal(ours["completion_ids"], stock["completion_ids"])
    penalty = sequence_penalties(trainer, ours, trainer.objective.reward_terms)["kl_k1"]
    assert float(penalty.abs().max()) > 1e-3
    torch.testing.assert_close(ours["advantages"], shaped_advantages(rewards, penalty, 4, "group"))
    assert not torch.allclose(ours["advantages"], stock["advantages"])
    assert trainer._metrics["train"]["reward_penalty"][-1] == pytest.approx(float(penalty.mean()))


# --- the enumerated policy (tests/objectives/test_placement.py) through GBMPOTrainer's shaping


def test_k1_in_the_reward_through_gbmpo_trainer_is_the_exact_kl_regularized_gradient() -> None:
    """The 2-step, 3-token policy enumerated (all 9 sequences, float64): GBMPOTrainer's in-reward
    penalty (:func:`sequence_divergence` of kl_k1, as :func:`sequence_penalties` applies it) and
    its advantages of the shaped rewards (:func:`shaped_advantages`, TRL's ``scale_rewards=
    "none"``: the group mean is a baseline, exact in expectation) give exactly the gradient of
    E[r] - beta * KL(pi || pi_ref), as on the own engine."""
    V, steps, beta = 3, 2, 0.5
    seqs = torch.tensor(list(itertools.product(range(V), repeat=steps)))
    mask = torch.ones(len(seqs), steps, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    theta1 = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_()
    theta2 = torch.randn(V, V, generator=g, dtype=torch.float64).requires_grad_()
    ref1 = torch.randn(V, generator=g, dtype=torch.float64)
    ref2 = torch.randn(V, V, generator=g, dtype=torch.float64)
    rewards = torch.rand(len(seqs), generator=g, dtype=torch.float64)

    def token_logp(l1: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
        first = torch.log_softmax(l1, -1)[seqs[:, 0]]
        second = torch.log_softmax(l2, -1)[seqs[:, 0], seqs[:, 1]]
        return torch.stack([first, second], dim=1)

    logp, ref_logp = token_logp(theta1, theta2), token_logp(ref1, ref2)
    p = logp.sum(1).exp().detach()
    penalty = beta * sequence_divergence(get_regularizer("kl_k1"), rollout_logp=logp,
                                         ref_logp=ref_logp, mask=mask)  # fmt: skip
    advantages = shaped_advantages(rewards, penalty, len(seqs), "none")
    loss, _ = compute_policy_loss(
        logp=logp,
        old_logp=None,
        advantages=advantages,
        mask=mask,
        surrogate="clip",
        terms=(),
        aggregation="seq_mean_token_sum",
        token_weights=(p * len(seqs))[:, None],
    )  # fmt: skip
    grads = torch.autograd.grad(loss, (theta1, theta2), retain_graph=True)
    got = -torch.cat([x.flatten() for x in grads])
    seq, ref_seq = logp.sum(1), ref_logp.sum(1)
    j = (seq.exp() * rewards).sum() - beta * (seq.exp() * (seq - ref_seq)).sum()
    want = torch.cat([x.flatten() for x in torch.autograd.grad(j, (theta1, theta2))])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# --- one meaning per setting ----------------------------------------------------------------


def test_entropy_averages_the_first_pass_only(
    tmp_path: Path, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:
    """With num_iterations (optim.mu) 2, ``entropy`` is the rollout policy's: the micro-steps of
    the first pass over a generation batch log it, the second pass's do not (the own engine
    averages its first epoch)."""
    args = GBMPOConfig(output_dir=str(tmp_path), **cpu_args, num_iterations=2,
                       max_completion_length=T)  # fmt: skip
    trainer = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                           train_dataset=tiny_dataset)  # fmt: skip
    assert trainer.args.steps_per_generation == 1
    batch = _batch()
    inputs = {k: v[:4] for k, v in _trl_inputs(batch, torch.zeros(B, T), torch.zeros(B, T),
                                               torch.ones(B)).items() if v.dim() > 0}  # fmt: skip
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    counts = []
    for step in range(4):
        trainer._step = step
        trainer._compute_loss(trainer.model, dict(inputs))
        counts.append(len(trainer._metrics["train"]["entropy"]))
    assert counts == [1, 1, 2, 2]


def test_trust_remote_code_reaches_trls_reference_model() -> None:
    from gbmpo.engines.trl.args import grpo_args

    cfg = load_config(None, [("engine", "trl"), ("model.trust_remote_code", True)])
    assert grpo_args(cfg, "unused").trust_remote_code is True
    assert grpo_args(load_config(None, [("engine", "trl")]), "unused").trust_remote_code is False
