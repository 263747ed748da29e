"""Parity: GBMPOTrainer's loss and gradients equal stock GRPOTrainer's on the same batch.

Both trainers load the same tiny random Qwen3 from disk; each one's ``_compute_loss`` gets the
same ``inputs`` dict (off-policy old log-probs so that the clip is active, reference log-probs,
advantages of both signs, padded completions), inside a gradient-accumulation window of 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer  # noqa: E402
from parity_record import record  # noqa: E402

TOL = 1e-6
BETA = 0.04
ACCUM = 2

#: on top of the ``cpu_args`` fixture
COMMON: dict[str, Any] = {"gradient_accumulation_steps": ACCUM, "max_completion_length": 10}


def _make_inputs(trainer: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """A padded batch of 4 sequences (prompt 6 tokens, completion 10) with off-policy noise."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    b, p, t = 4, 6, 10
    prompt_ids = torch.randint(3, vocab, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_mask[2, :1] = 0
    completion_ids = torch.randint(3, vocab, (b, t), generator=g)
    lengths = torch.tensor([10, 7, 4, 9])
    completion_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            t,
        )
    old = logps + 0.3 * torch.randn(b, t, generator=g)
    ref = logps + 0.5 * torch.randn(b, t, generator=g)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.7, 0.4, -0.9]),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": completion_mask.sum() * 2,  # the generation batch holds 2 of these
    }


def _loss_and_grads(trainer: Any, inputs: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = ACCUM
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return float(loss.detach()), grads


@pytest.fixture
def pair(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any, cpu_args: dict[str, Any]
) -> Callable[[dict[str, Any], dict[str, Any]], tuple[Any, Any]]:
    """``pair(trl_kwargs, gbmpo_kwargs)``: a stock GRPOTrainer and a GBMPOTrainer on the same
    model, dataset and reward, with the same shared settings."""

    def make(trl_kwargs: dict[str, Any], gbmpo_kwargs: dict[str, Any]) -> tuple[Any, Any]:
        common = {**cpu_args, **COMMON}
        # both trainers take the same use_bias_correction_kl (both default to TRL's True)
        bias = trl_kwargs.get("use_bias_correction_kl", True)
        gbmpo_kwargs = {"use_bias_correction_kl": bias, **gbmpo_kwargs}
        stock = GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=reward_fn,
            args=GRPOConfig(output_dir=str(tmp_path / "stock"), **common, **trl_kwargs),
            train_dataset=tiny_dataset,
        )
        ours = GBMPOTrainer(
            model=tiny_model_dir,
            reward_funcs=reward_fn,
            args=GBMPOConfig(output_dir=str(tmp_path / "gbmpo"), **common, **gbmpo_kwargs),
            train_dataset=tiny_dataset,
        )
        return stock, ours

    return make


def _compare(stock: Any, ours: Any, inputs: dict[str, Any]) -> tuple[float, float]:
    loss_s, grads_s = _loss_and_grads(stock, inputs)
    # bnpo: GBMPOTrainer divides by the optimizer step's tokens (its _prepare_inputs adds them);
    # here the window holds ACCUM micro-batches like this one, TRL's per-micro-batch normaliser
    ours_inputs = {**inputs, "mini_batch_tokens": inputs["completion_mask"].sum() * ACCUM}
    loss_o, grads_o = _loss_and_grads(ours, ours_inputs)
    assert set(grads_s) == set(grads_o)
    loss_diff = abs(loss_s - loss_o)
    grad_diff = max(float((grads_s[n] - grads_o[n]).abs().max()) for n in grads_s)
    grad_scale = max(float(g.abs().max()) for g in grads_s.values())
    assert grad_scale > 1e-4, "degenerate test: the stock gradient is ~0"
    assert loss_diff <= TOL, f"loss {loss_s} vs {loss_o}"
    assert grad_diff <= TOL, f"max grad diff {grad_diff} (grad scale {grad_scale})"
    record(loss_diff, grad_diff)
    return loss_diff, grad_diff


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo", "luspo"])
def test_k3_parity_per_loss_type(loss_type: str, pair: Callable[..., tuple[Any, Any]]) -> None:
    """kl_k3 with coef=beta and the ratio clip equals TRL's k3 (bias correction off)."""
    trl_kw = {"loss_type": loss_type, "beta": BETA, "use_bias_correction_kl": False,
              "epsilon": 0.2, "epsilon_high": 0.28}
    ours_kw = {"loss_type": loss_type, "regularizer": "kl_k3", "regularizer_coef": BETA,
               "epsilon": 0.2, "epsilon_high": 0.28}
    stock, ours = pair(trl_kw, ours_kw)
    inputs = _make_inputs(stock)
    loss_diff, grad_diff = _compare(stock, ours, inputs)
    print(f"parity {loss_type}: max|dloss|={loss_diff:.3g} max|dgrad|={grad_diff:.3g}")
    # the clip is active in this batch, so the comparison covers both branches
    assert ours._metrics["train"]["clip_ratio/region_mean"][-1] > 0
    # evaluation mode (prediction_step): no accumulation scaling
    evals = []
    for trainer in (stock, ours):
        trainer.model.eval()
        with torch.no_grad():
            evals.append(float(trainer._compute_loss(trainer.model, dict(inputs))))
    assert abs(evals[0] - evals[1]) <= TOL, evals
    assert "kl" in ours._metrics["eval"] and "reg_value" in ours._metrics["eval"]


@pytest.mark.parametrize(
    ("name", "trl_kw", "ours_kw"),
    [
        # TRL 1.16's default KL: k3 times the (differentiable) token ratio == gbmpo kl_k3_is
        ("bias_corrected_kl", {"use_bias_correction_kl": True}, {"regularizer": "kl_k3_is"}),
        # GSPO: sequence-level ratio
        (
            "sequence_level",
            {"importance_sampling_level": "sequence", "use_bias_correction_kl": False,
             "loss_type": "grpo", "epsilon": 3e-3, "epsilon_high": 4e-3},
            {"importance_sampling_level": "sequence", "loss_type": "grpo",
             "epsilon": 3e-3, "epsilon_high": 4e-3},
        ),
        # TRL options that weight or mask the surrogate, and the entropy bonus
        (
            "delta_entropy_offpolicy",
            {"delta": 1.5, "top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.05,
             "entropy_coef": 0.01, "use_bias_correction_kl": False},
            {"delta": 1.5, "top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.05,
             "entropy_coef": 0.01},
        ),
    ],
)
def test_parity_trl_options(
    name: str,
    trl_kw: dict[str, Any],
    ours_kw: dict[str, Any],
    pair: Callable[..., tuple[Any, Any]],
) -> None:
    trl_kw = {"beta": BETA, "loss_type": "dapo", **trl_kw}
    ours_kw = {"regularizer_coef": BETA, "loss_type": trl_kw["loss_type"], **ours_kw}
    stock, ours = pair(trl_kw, ours_kw)
    loss_diff, grad_diff = _compare(stock, ours, _make_inputs(stock, seed=1))
    print(f"parity {name}: max|dloss|={loss_diff:.3g} max|dgrad|={grad_diff:.3g}")


def _compare_with_vllm_is(
    stock: Any, ours: Any, inputs: dict[str, Any], shape: tuple[int, int], seed: int
) -> tuple[float, float]:
    """:func:`_compare` with vLLM importance-sampling correction on both trainers and random
    ratios in [0.5, 1.5) of ``shape`` (``[B, T]`` token-level, ``[B, 1]`` sequence-level)."""
    g = torch.Generator().manual_seed(seed)
    inputs["importance_sampling_ratio"] = 0.5 + torch.rand(*shape, generator=g)
    for t in (stock, ours):
        t.use_vllm = True
        t.vllm_importance_sampling_correction = True
    return _compare(stock, ours, inputs)


def test_parity_vllm_importance_ratio_and_on_policy(
    pair: Callable[..., tuple[Any, Any]],
) -> None:
    """The vLLM importance-sampling ratio multiplies the surrogate only (no vLLM here: the flag is
    set on both trainers after construction and the ratio supplied in the batch); on-policy
    batches (no old log-probs) use the detached current log-probs."""
    trl_kw = {"beta": BETA, "loss_type": "bnpo", "use_bias_correction_kl": False}
    ours_kw = {"regularizer_coef": BETA, "loss_type": "bnpo"}
    stock, ours = pair(trl_kw, ours_kw)
    inputs = _make_inputs(stock, seed=2)
    del inputs["old_per_token_logps"]
    loss_diff, grad_diff = _compare_with_vllm_is(stock, ours, inputs, (4, 10), seed=3)
    print(f"parity vllm_is_on_policy: max|dloss|={loss_diff:.3g} max|dgrad|={grad_diff:.3g}")


def test_parity_dapo_normaliser_below_local_count_and_sequence_weights(
    pair: Callable[..., tuple[Any, Any]],
) -> None:
    """TRL ``dapo``'s normaliser Z = num_items_in_batch / P * G_acc / S_gen can be below this
    process's token count (data-parallel, uneven split): emulated with one process by a
    ``num_items_in_batch`` smaller than the batch's own tokens, so Z = 21 < 30 local tokens,
    which GBMPOTrainer now passes to ``aggregate`` as ``num_tokens``. The weights are
    per-sequence ``[B, 1]`` (vLLM sequence-level IS ratio times the off-policy mask)."""
    trl_kw = {
        "beta": BETA,
        "loss_type": "dapo",
        "use_bias_correction_kl": False,
        "off_policy_mask_threshold": 0.05,
    }
    ours_kw = {"regularizer_coef": BETA, "loss_type": "dapo", "off_policy_mask_threshold": 0.05}
    stock, ours = pair(trl_kw, ours_kw)
    inputs = _make_inputs(stock, seed=4)
    local = int(inputs["completion_mask"].sum())
    inputs["num_items_in_batch"] = torch.tensor(local - 9)
    loss_diff, grad_diff = _compare_with_vllm_is(stock, ours, inputs, (4, 1), seed=5)
    print(f"parity dapo_z_below_local: max|dloss|={loss_diff:.3g} max|dgrad|={grad_diff:.3g}")


def test_gbmpo_regularizer_changes_the_loss(
    pair: Callable[..., tuple[Any, Any]],
) -> None:
    """Guard against a parity test that passes because the regularizer is ignored: ProbL2 with
    the same coefficient gives a different loss and gradient than TRL's k3."""
    trl_kw = {"beta": BETA, "loss_type": "dr_grpo", "use_bias_correction_kl": False}
    ours_kw = {"regularizer": "prob_l2", "regularizer_coef": BETA, "loss_type": "dr_grpo"}
    stock, ours = pair(trl_kw, ours_kw)
    inputs = _make_inputs(stock)
    loss_s, grads_s = _loss_and_grads(stock, inputs)
    loss_o, grads_o = _loss_and_grads(ours, inputs)
    assert abs(loss_s - loss_o) > 1e-4
    assert max(float((grads_s[n] - grads_o[n]).abs().max()) for n in grads_s) > 1e-5
