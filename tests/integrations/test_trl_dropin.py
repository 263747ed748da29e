"""GBMPOTrainer as a drop-in for TRL's GRPOTrainer.

Every field of the installed ``trl.GRPOConfig`` has an answer (:data:`TRL_FIELDS`); TRL's loss
types, its bias-corrected KL and its adaptive entropy coefficient give TRL's own loss, gradients
and metrics on a fixed batch (both trainers load the same tiny random Qwen3, as in
``test_trl_parity.py``); a short training run logs TRL's metric names beside gbmpo's.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from gbmpo.integrations.trl import (  # noqa: E402
    FIELD_STATUSES,
    TRL_FIELDS,
    GBMPOConfig,
    GBMPOTrainer,
    adaptive_entropy_coef,
    objective_spec,
    trl_field_status,
)

TOL = 1e-6
BETA = 0.04
ACCUM = 2
COMMON: dict[str, Any] = {"gradient_accumulation_steps": ACCUM, "max_completion_length": 10}
BASE = {"output_dir": "/tmp/gbmpo-dropin-unused", "report_to": "none", "use_cpu": True}

# --- the field table -------------------------------------------------------------------------


def test_every_grpo_config_field_has_an_answer() -> None:
    training = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    names = [f.name for f in dataclasses.fields(GRPOConfig)]
    missing = [n for n in names if n not in training and n not in TRL_FIELDS]
    assert not missing, f"GRPOConfig fields without an entry in TRL_FIELDS: {missing}"
    stale = sorted(set(TRL_FIELDS) - set(names))
    assert not stale, f"TRL_FIELDS entries that are not GRPOConfig fields: {stale}"
    counts: Counter[str] = Counter()
    for name in names:
        status, how = trl_field_status(name)
        assert status in FIELD_STATUSES and how.strip(), name
        counts[status] += 1
    print("GRPOConfig fields:", dict(counts), "of", len(names))
    with pytest.raises(KeyError, match="no answer in GBMPOTrainer"):
        trl_field_status("not_a_grpo_field")
    # every field TRL's GRPOConfig defines is a GBMPOConfig field with TRL's default
    # (test_every_default_is_trls checks the default factories too)
    gb = {f.name: f for f in dataclasses.fields(GBMPOConfig)}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is dataclasses.MISSING:
            continue
        assert gb[f.name].default == f.default, f.name


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def test_every_default_is_trls() -> None:
    """A TRL user who swaps GBMPOConfig in for GRPOConfig trains what TRL trains: every
    GRPOConfig dataclass field has the same default (value or factory) in GBMPOConfig."""
    gb = {f.name: f for f in dataclasses.fields(GBMPOConfig)}
    differ = {f.name: (_default(f), _default(gb[f.name])) for f in dataclasses.fields(GRPOConfig)
              if _default(f) != _default(gb[f.name])}  # fmt: skip
    assert not differ, differ


def _spec(**kw: Any) -> dict[str, Any]:
    return objective_spec(GBMPOConfig(**{**BASE, **kw})).to_dict()


@pytest.mark.parametrize(
    ("base", "changed"),
    [
        ({}, {"epsilon": 0.1}),
        ({}, {"epsilon_high": 0.28}),
        ({}, {"delta": 2.0}),
        ({}, {"importance_sampling_level": "sequence"}),
        ({}, {"beta": 0.04}),
        ({"beta": 0.04, "use_bias_correction_kl": False}, {"beta": 0.04}),
        ({}, {"loss_type": "dr_grpo"}),
        ({"loss_type": "cispo", "epsilon_high": 5.0}, {"loss_type": "cispo", "epsilon_high": 3.0}),
        ({"loss_type": "sapo"}, {"loss_type": "sapo", "sapo_temperature_pos": 2.0}),
        ({"loss_type": "sapo"}, {"loss_type": "sapo", "sapo_temperature_neg": 2.0}),
        ({"loss_type": "vespo"}, {"loss_type": "vespo", "vespo_k_pos": 1.0}),
        ({"loss_type": "vespo"}, {"loss_type": "vespo", "vespo_lambda_pos": 1.0}),
        ({"loss_type": "vespo"}, {"loss_type": "vespo", "vespo_k_neg": 1.0}),
        ({"loss_type": "vespo"}, {"loss_type": "vespo", "vespo_lambda_neg": 1.0}),
    ],
)  # fmt: skip
def test_mapped_fields_change_the_objective(base: dict[str, Any], changed: dict[str, Any]) -> None:
    """A field the table calls ``mapped`` reaches the gbmpo objective spec."""
    for name in set(changed) - set(base):
        assert trl_field_status(name)[0] == "mapped", name
    assert _spec(**base) != _spec(**changed)


def test_loss_type_surrogates_and_their_refusals() -> None:
    spec = _spec(loss_type="cispo", epsilon_high=5.0, beta=BETA, regularizer="prob_l2")
    assert spec["surrogate"] == {"name": "cispo", "params": {"eps_low": 1.0, "eps_high": 4.0}}
    assert spec["regularizer"]["name"] == "prob_l2" and spec["aggregation"] == "bnpo"
    assert _spec(loss_type="sapo")["aggregation"] == "grpo"
    refusals = [
        ({"loss_type": "cispo"}, "cap below 1"),  # TRL's default cap would be epsilon = 0.2
        ({"loss_type": "sapo", "delta": 2.0}, "does not use it"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "token level"),
        ({"loss_type": "cispo", "epsilon_high": 5.0, "clip_mode": "atr", "atr_delta": 0.1},
         "selects another"),
        ({"loss_type": "vespo", "use_vllm": True}, "vllm_importance_sampling_correction=False"),
    ]  # fmt: skip
    for kw, match in refusals:
        with pytest.raises(ValueError, match=match):
            GBMPOConfig(**{**BASE, **kw})


def test_adaptive_entropy_coef_rule() -> None:
    kw = {"target": 1.0, "delta": 0.1, "coef_min": 0.0, "coef_max": 0.25}
    assert adaptive_entropy_coef(0.1, 0.5, **kw) == pytest.approx(0.2)
    assert adaptive_entropy_coef(0.2, 1.0, **kw) == 0.25  # at the target: up, capped
    assert adaptive_entropy_coef(0.05, 1.5, **kw) == 0.0  # above: down, floored


# --- parity with TRL's own trainer on a fixed batch ------------------------------------------


def _inputs(trainer: Any, seed: int) -> dict[str, torch.Tensor]:
    """4 padded sequences (prompt 6, completion 10) with off-policy noise and both advantage
    signs; the generation batch holds two of these (``num_items_in_batch``)."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    b, p, t = 4, 6, 10
    prompt_ids = torch.randint(3, vocab, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[1, :3] = 0
    completion_ids = torch.randint(3, vocab, (b, t), generator=g)
    completion_mask = (torch.arange(t)[None, :] < torch.tensor([10, 6, 8, 3])[:, None]).long()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), t,
        )  # fmt: skip
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.1, -0.8, 0.5, -0.6]),
        "old_per_token_logps": logps + 0.3 * torch.randn(b, t, generator=g),
        "ref_per_token_logps": logps + 0.5 * torch.randn(b, t, generator=g),
        "num_items_in_batch": completion_mask.sum() * 2,
    }


def _step(trainer: Any, inputs: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = ACCUM
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture
def pair(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any, cpu_args: dict[str, Any]
) -> Callable[[dict[str, Any]], tuple[Any, Any]]:
    """``pair(kwargs)``: TRL's GRPOTrainer and GBMPOTrainer built from the same TRL fields."""

    def make(kwargs: dict[str, Any]) -> tuple[Any, Any]:
        common = {**cpu_args, **COMMON, **kwargs}
        out = []
        for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (GBMPOTrainer, GBMPOConfig)):
            args = config_cls(output_dir=str(tmp_path / trainer_cls.__name__), **common)
            out.append(trainer_cls(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                                   train_dataset=tiny_dataset))  # fmt: skip
        return out[0], out[1]

    return make


def _compare(stock: Any, ours: Any, inputs: dict[str, Any]) -> None:
    """Same loss and gradients, and every metric TRL logs is logged under its name with TRL's
    value (``clip_ratio/*_mean`` of the sequence-level ratio aside: gbmpo counts tokens)."""
    for t in (stock, ours):
        t._metrics["train"].clear()
    loss_s, grads_s = _step(stock, inputs)
    loss_o, grads_o = _step(ours, inputs)
    scale = max(float(g.abs().max()) for g in grads_s.values())
    diff = max(float((grads_s[n] - grads_o[n]).abs().max()) for n in grads_s)
    assert scale > 1e-4, "degenerate: TRL's gradient is ~0"
    assert abs(loss_s - loss_o) <= TOL and diff <= TOL, (loss_s, loss_o, diff)
    ms, mo = stock._metrics["train"], ours._metrics["train"]
    assert set(ms) <= set(mo), f"TRL metrics GBMPOTrainer does not log: {set(ms) - set(mo)}"
    sequence = stock.importance_sampling_level == "sequence"
    for key in ms:
        if sequence and key.endswith("_mean") and key.startswith("clip_ratio/"):
            continue
        assert ms[key] == pytest.approx(mo[key], abs=1e-6), key


LOSS_TYPE_CASES = [
    ("cispo", {"epsilon_high": 1.3}),
    ("sapo", {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 3.0}),
    ("vespo", {}),
    ("luspo", {"importance_sampling_level": "sequence", "epsilon": 0.02, "epsilon_high": 0.03}),
]


@pytest.mark.parametrize(("loss_type", "extra"), LOSS_TYPE_CASES, ids=[c[0] for c in
                                                                      LOSS_TYPE_CASES])
def test_loss_type_parity_with_trl(
    loss_type: str,
    extra: dict[str, Any],
    pair: Callable[..., tuple[Any, Any]],
    tmp_path: Any,
    tiny_model_dir: str,
    tiny_dataset: Any,
    reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:
    """sapo / luspo with beta=0, cispo / vespo with TRL's k3 (beta > 0): GBMPOTrainer's loss,
    gradients and TRL's metrics equal TRL's own trainer's; cispo combines with another gbmpo
    regularizer (prob_l2) too."""
    beta = BETA if loss_type in ("cispo", "vespo") else 0.0
    kw = {"loss_type": loss_type, "beta": beta, "use_bias_correction_kl": False, **extra}
    stock, ours = pair(kw)
    inputs = _inputs(stock, seed=len(loss_type))
    _compare(stock, ours, inputs)
    assert ours.objective.spec.surrogate.name == {"luspo": "gspo"}.get(loss_type, loss_type)
    if loss_type == "cispo":
        kw = {**cpu_args, **COMMON, **kw, "beta": 0.0, "regularizer": "prob_l2",
              "regularizer_coef": BETA}  # fmt: skip
        args = GBMPOConfig(output_dir=str(tmp_path / "prob_l2"), **kw)
        other = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                             train_dataset=tiny_dataset)  # fmt: skip
        assert [t.name for t in other.objective.terms] == ["prob_l2"]
        loss_o, _ = _step(other, inputs)
        loss_s, _ = _step(stock, inputs)
        assert abs(loss_o - loss_s) > 1e-6 and "reg_value" in other._metrics["train"]


def test_bias_corrected_kl_parity_with_trl(pair: Callable[..., tuple[Any, Any]]) -> None:
    """TRL's use_bias_correction_kl=True (k3 times the token ratio) is GBMPOConfig's mapping onto
    kl_k3_is: same loss, gradients and ``kl`` metric."""
    stock, ours = pair({"loss_type": "dapo", "beta": BETA, "use_bias_correction_kl": True})
    assert [t.name for t in ours.objective.terms] == ["kl_k3_is"]
    _compare(stock, ours, _inputs(stock, seed=7))
    assert "kl" in ours._metrics["train"]


def test_adaptive_entropy_parity_with_trl(pair: Callable[..., tuple[Any, Any]]) -> None:
    """TRL's adaptive entropy coefficient: the first window applies no bonus, the coefficient
    grows while the entropy (~5.7 nats on the random model) is below the target and is applied,
    then, with a target below the entropy, shrinks and is not applied; TRL's policy_loss and
    entropy_coef are logged with TRL's values at every step."""
    stock, ours = pair({"loss_type": "grpo", "beta": 0.0, "use_adaptive_entropy": True,
                        "entropy_coef": 0.1, "entropy_coef_delta": 0.05,
                        "entropy_target": 10.0})  # fmt: skip
    coefs = []
    for seed in range(3):
        _compare(stock, ours, _inputs(stock, seed=seed))
        assert ours.entropy_coef == pytest.approx(stock.entropy_coef)
        assert ours._last_world_entropy == pytest.approx(stock._last_world_entropy)
        coefs.append(ours.entropy_coef)
    assert coefs == pytest.approx([0.15, 0.2, 0.25])
    for t in (stock, ours):
        t.args.entropy_target = 1.0
    _compare(stock, ours, _inputs(stock, seed=3))  # applies 0.25: the last entropy was below 10
    _compare(stock, ours, _inputs(stock, seed=4))  # applies 0: the last entropy is above 1
    assert ours.entropy_coef == pytest.approx(stock.entropy_coef) == pytest.approx(0.15)
    assert "policy_loss" in ours._metrics["train"] and "entropy_coef" in ours._metrics["train"]


# --- training runs on the tiny model ---------------------------------------------------------


def test_training_logs_trl_metric_names_beside_gbmpo_names(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any, cpu_args: dict[str, Any]
) -> None:
    """Two optimizer steps with TRL's bias-corrected KL, adaptive entropy and a static entropy
    bonus: log_history has TRL's names (policy_loss, kl, entropy, entropy_coef, clip_ratio/*)
    beside gbmpo's under the run directory's names (pg_loss, reg_loss, reg_value, reg/<name>)."""
    kw = {**cpu_args, "max_steps": 2, "logging_steps": 1, "max_completion_length": 6,
          "beta": BETA, "use_bias_correction_kl": True, "use_adaptive_entropy": True,
          "entropy_coef": 0.01, "entropy_target": 10.0}  # fmt: skip
    args = GBMPOConfig(output_dir=str(tmp_path), **kw)
    trainer = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                           train_dataset=tiny_dataset)  # fmt: skip
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    trl_names = {"policy_loss", "kl", "entropy", "entropy_coef", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max"}  # fmt: skip
    gbmpo_names = {"pg_loss", "reg_loss", "reg_value", "reg/kl_k3_is"}
    for row in rows:
        assert trl_names | gbmpo_names <= set(row), (trl_names | gbmpo_names) - set(row)
    assert rows[1]["entropy_coef"] == pytest.approx(0.02)  # 0.01 + delta 0.005 per step


def test_use_liger_kernel_behaves_as_in_trl(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any, cpu_args: dict[str, Any]
) -> None:
    """use_liger_kernel=True is accepted by the config and left to TRL / transformers: the same
    outcome as TRL's trainer (an ImportError at train() without liger-kernel)."""
    outcomes = []
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (GBMPOTrainer, GBMPOConfig)):
        args = config_cls(output_dir=str(tmp_path / trainer_cls.__name__), use_liger_kernel=True,
                          **{**cpu_args, "max_steps": 1, "max_completion_length": 4})  # fmt: skip
        trainer = trainer_cls(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                              train_dataset=tiny_dataset)  # fmt: skip
        try:
            trainer.train()
            outcomes.append("trained")
        except ImportError as err:
            outcomes.append(f"ImportError: {err}")
    assert outcomes[0] == outcomes[1], outcomes


def test_swapped_in_trains_step_for_step_what_grpo_trainer_trains(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any, cpu_args: dict[str, Any]
) -> None:
    """TRL's defaults (with beta 0.04, so that TRL's default bias-corrected KL is on): the same
    fields in GBMPOConfig / GBMPOTrainer train what GRPOConfig / GRPOTrainer train, step for step
    (the same losses, and the same gradient: the same weights after 3 plain SGD steps).

    Float64 weights and SGD make the verdict independent of the processor's vector kernels:
    an SGD update is linear in the gradient, so a last-bit difference stays a last-bit
    difference (Adam can turn one in a near-zero gradient into up to 2 x lr in a weight). The
    rewards and advantages stay float32 in TRL (its reward tensor's dtype), so the updates agree
    to a few float32 roundings: the bound 1e-6 of the largest weight move is ~8 eps32 (2.4e-8
    of it measured), while any real difference in the loss moves the update by far more."""
    # a large rate, so that the policy leaves the reference after the first step and the KL's
    # gradient (k3 times the token ratio in TRL's default) matters in the later ones
    kw = {**cpu_args, "max_steps": 3, "logging_steps": 1, "max_completion_length": 6,
          "beta": 0.04, "learning_rate": 0.05, "optim": "sgd",
          "model_init_kwargs": {"dtype": torch.float64}}  # fmt: skip
    runs = {}
    for name, config, trainer_cls in (("trl", GRPOConfig, GRPOTrainer),
                                      ("gbmpo", GBMPOConfig, GBMPOTrainer)):  # fmt: skip
        t = trainer_cls(model=tiny_model_dir, reward_funcs=reward_fn, train_dataset=tiny_dataset,
                        args=config(output_dir=str(tmp_path / name), **kw))  # fmt: skip
        start = torch.cat([p.detach().flatten().clone() for p in t.model.parameters()])
        t.train()
        losses = [r["loss"] for r in t.state.log_history if "loss" in r]
        weights = torch.cat([p.detach().flatten() for p in t.model.parameters()])
        runs[name] = (losses, weights, float((weights - start).abs().max()))
    (loss_t, w_t, move), (loss_g, w_g, _) = runs["trl"], runs["gbmpo"]
    assert w_t.dtype == torch.float64 and move > 1e-3  # the policy moved
    assert len(loss_t) == 3 and loss_g == pytest.approx(loss_t, rel=1e-6, abs=1e-9)
    assert float((w_t - w_g).abs().max()) <= 1e-6 * move


def test_the_sampled_token_path_runs_trls_own_chunked_log_probs(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an ``estimator: full`` term, GBMPOTrainer's policy forward is TRL's own
    (its fused LM head: ``ChunkedLogProbFunction``, no ``[B, T, V]`` logits), never the
    completion-logits path that the full estimator takes."""
    import trl.trainer.utils as trl_utils

    import gbmpo.engines.trl.trainer as ours_module

    calls: list[int] = []
    chunked = trl_utils._ChunkedLogProbFunction

    class Counting(chunked):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, hidden: torch.Tensor, *args: Any) -> Any:
            calls.append(hidden.shape[0])
            return chunked.forward(ctx, hidden, *args)

    def no_logits(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the sampled-token path took the completion logits")

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Counting)
    monkeypatch.setattr(ours_module, "logprobs_and_full", no_logits)
    args = GBMPOConfig(output_dir=str(tmp_path), **{**cpu_args, **COMMON, "beta": BETA})
    trainer = GBMPOTrainer(model=tiny_model_dir, reward_funcs=reward_fn, args=args,
                           train_dataset=tiny_dataset)  # fmt: skip
    assert not trainer.objective.full_loss_terms
    inputs = _inputs(trainer, seed=0)
    calls.clear()  # _inputs' no-grad pass went through it too
    loss, grads = _step(trainer, inputs)
    assert calls and sum(calls) > 0 and torch.isfinite(torch.tensor(loss))
    assert any(float(g.abs().sum()) > 0 for g in grads.values() if g is not None)
