"""Trainer on a micro model: accumulation exactness, parameters move (all / adapters only),
kill-and-resume equality, reward failure handling, run-directory states."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gbmpo.lifecycle.logging import read_metrics, without_timing
from gbmpo.rewards.scoring import RewardError
from gbmpo.rollout import generate
from gbmpo.train import Trainer, load_config
from gbmpo.train.checkpoint import latest_checkpoint
from gbmpo.train.step import accumulate_gradients, no_grad_logprobs


def varied_reward(prompts, completions, **columns):
    """A deterministic reward with spread inside every group (gives non-zero advantages)."""
    return [float(len(c) % 3) / 2 for c in completions]


def micro_config(model_dir: Path, out: Path | None, **extra: str):
    overrides = {
        "model.path": str(model_dir),
        "rollout.prompts_per_step": "2",
        "rollout.num_generations": "4",
        "rollout.max_new_tokens": "8",
        "eval.before": "false",
        "eval.after": "false",
        "eval.every": "0",
        "run.time_budget_seconds": "null",
        "run.progress": "false",
        "run.steps": "3",
        "optim.lr": "1e-3",
        "optim.mu": "1",
        "optim.mini_batch_size": "null",
        "optim.schedule": "constant",
    }
    if out is not None:
        overrides["run.output_dir"] = str(out)
    overrides.update(extra)
    return load_config(None, list(overrides.items()))


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("aggregation", ["dr_grpo", "bnpo", "grpo", "seq_mean_token_sum"])
def test_micro_batch_accumulation_equals_one_batch(micro_model_dir, aggregation):
    cfg = micro_config(
        micro_model_dir,
        None,
        **{"objective.aggregation": aggregation, "objective.regularizer.coef": "0.5"},
    )
    trainer = Trainer(cfg, reward_fn=varied_reward)
    prompts = ["Q: Anna has 3 eggs.\nA:", "Q: Ben has 12 pens and 4 more.\nA:"]
    batch = generate(
        trainer.model,
        trainer.tokenizer,
        prompts,
        num_return_sequences=4,
        max_new_tokens=8,
        generator_seed=5,
    )
    # unequal completion lengths, so that bnpo / grpo normalisers differ from dr_grpo's
    lengths = torch.tensor([8, 3, 5, 1, 7, 2, 8, 4])
    batch.completion_mask = (torch.arange(batch.completion_ids.shape[1]) < lengths[:, None]).long()
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(len(batch), generator=g)
    with torch.no_grad():
        current = no_grad_logprobs(trainer.models, batch, trainer.inference_batch,
                                   reference=False)
    ref = current - 0.3 * torch.rand(current.shape, generator=g)  # so ProbL2 has a gradient
    rows = torch.arange(len(batch))

    def grads(micro: int) -> list[torch.Tensor]:
        trainer.model.zero_grad(set_to_none=True)
        accumulate_gradients(trainer.models, trainer.objective, trainer.config, micro, batch,
                             rows, advantages, None, ref)
        return [p.grad.clone() for p in trainer.params]

    one = grads(len(batch))
    for micro in (1, 2, 4):
        acc = grads(micro)
        for a, b in zip(one, acc, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(x.abs().sum() > 0 for x in one)


def test_inference_mode_outputs_are_ordinary_tensors(micro_model_dir):
    """The decode loop runs in inference mode; the rollout it hands on and the no-grad
    log-probs are ordinary tensors, which autograd may save for a backward
    (an inference tensor saved for the backward raises)."""
    cfg = micro_config(micro_model_dir, None, **{"objective.regularizer.coef": "0.5"})
    trainer = Trainer(cfg, reward_fn=varied_reward)
    assert trainer.ref_model is not None
    batch = generate(trainer.model, trainer.tokenizer, ["Q: Anna has 3 eggs.\nA:"],
                     num_return_sequences=2, max_new_tokens=4, generator_seed=1,
                     return_logprobs=True)
    old = no_grad_logprobs(trainer.models, batch, trainer.inference_batch, reference=False)
    ref = no_grad_logprobs(trainer.models, batch, trainer.inference_batch, reference=True)
    assert batch.sampling_logp is not None
    tensors = {"old": old, "ref": ref, "sampling_logp": batch.sampling_logp,
               "prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask,
               "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask}
    for name, tensor in tensors.items():
        assert not tensor.is_inference(), name
    # a product saves both factors for its backward, an embedding its indices
    w = torch.ones((), requires_grad=True)
    embed = trainer.model.get_input_embeddings().weight
    loss = (w * old).sum() + (w * ref).sum() + (w * batch.sampling_logp).sum()
    loss = loss + torch.nn.functional.embedding(batch.completion_ids, embed).sum()
    loss.backward()
    assert w.grad is not None and embed.grad is not None


# ----------------------------------------------------------------------------- parameters move


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_full_finetuning_changes_every_trainable_parameter(micro_model_dir, tmp_path):
    cfg = micro_config(micro_model_dir, tmp_path / "run", **{"optim.lr": "1e-2"})
    trainer = Trainer(cfg, reward_fn=varied_reward)
    before = _snapshot(trainer.model)
    ref_before = _snapshot(trainer.ref_model)
    summary = trainer.train()
    assert summary["steps"] == 3
    after = _snapshot(trainer.model)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    # the frozen reference did not move
    for n, t in _snapshot(trainer.ref_model).items():
        assert torch.equal(t, ref_before[n])


def test_lora_changes_only_adapters(micro_model_dir, tmp_path):
    pytest.importorskip("peft")
    cfg = micro_config(
        micro_model_dir,
        tmp_path / "run",
        **{"optim.lr": "1e-2", "lora.enabled": "true", "lora.target_modules": "q_proj,v_proj"},
    )
    trainer = Trainer(cfg, reward_fn=varied_reward)
    assert trainer.ref_model is None  # the reference is the model with adapters disabled
    prompts = ["Q: Anna has 3 eggs.\nA:"]
    batch = generate(
        trainer.model,
        trainer.tokenizer,
        prompts,
        num_return_sequences=2,
        max_new_tokens=6,
        generator_seed=1,
    )
    ref0 = no_grad_logprobs(trainer.models, batch, trainer.inference_batch, reference=True)
    before = _snapshot(trainer.model)
    trainer.train()
    after = _snapshot(trainer.model)
    lora = [n for n in before if "lora_" in n]
    base = [n for n in before if "lora_" not in n]
    assert lora and base
    assert all(not torch.equal(before[n], after[n]) for n in lora), "every adapter must move"
    assert all(torch.equal(before[n], after[n]) for n in base), "base weights must be frozen"
    # adapters disabled still give the initial policy; adapters enabled do not
    models, rows = trainer.models, trainer.inference_batch
    torch.testing.assert_close(no_grad_logprobs(models, batch, rows, reference=True), ref0)
    assert not torch.allclose(no_grad_logprobs(models, batch, rows, reference=False), ref0)
    # the exported model is the adapter
    assert (tmp_path / "run" / "model" / "adapter_config.json").is_file()


# ----------------------------------------------------------------------------- resume


class _Crash(Exception):
    pass


class CrashingTrainer(Trainer):
    crash_at = 4

    def train_step(self):
        if self.step == self.crash_at:
            raise _Crash("simulated kill")
        return super().train_step()


@pytest.mark.parametrize("mu", [1, 2])
def test_kill_and_resume_reproduces_metrics(micro_model_dir, tmp_path, mu):
    extra = {
        "run.steps": "6",
        "run.checkpoint_every": "3",
        "optim.mu": str(mu),
        "optim.mini_batch_size": "4",
        "optim.schedule": "cosine",
        "optim.warmup_steps": "2",
    }
    full = tmp_path / "full"
    Trainer(micro_config(micro_model_dir, full, **extra), reward_fn=varied_reward).train()

    part = tmp_path / "part"
    with pytest.raises(_Crash):
        CrashingTrainer(
            micro_config(micro_model_dir, part, **extra), reward_fn=varied_reward
        ).train()
    assert not (part / "summary.json").exists()
    assert json.loads((part / "status.json").read_text())["status"] == "failed"
    assert latest_checkpoint(part).name == "step-3"
    assert [r["step"] for r in read_metrics(part)] == [1, 2, 3, 4]

    Trainer.resume(part, reward_fn=varied_reward).train()
    a = [without_timing(r) for r in read_metrics(full)]
    b = [without_timing(r) for r in read_metrics(part)]
    assert [r["step"] for r in b] == list(range(1, 7))
    assert a == b
    wa = load_file(str(latest_checkpoint(full) / "trainable.safetensors"))
    wb = load_file(str(latest_checkpoint(part) / "trainable.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((part / "summary.json").read_text())["steps"] == 6


def test_lean_decoder_switch_gives_the_same_run(micro_model_dir, tmp_path):
    """``rollout.lean_decoder`` and ``rollout.decode_step`` change how the decode forwards run,
    not what they compute: the same seed gives the same metrics (rewards, lengths, losses) with
    the lean decoder, the model's own forward and the static step."""
    runs = {}
    for name, key, value in (("lean", "rollout.lean_decoder", "true"),
                             ("model", "rollout.lean_decoder", "false"),
                             ("static", "rollout.decode_step", "static")):  # fmt: skip
        out = tmp_path / name
        Trainer(micro_config(micro_model_dir, out, **{key: value}),
                reward_fn=varied_reward).train()
        runs[name] = [without_timing(r) for r in read_metrics(out)]
    assert runs["lean"] == runs["model"] == runs["static"]
    assert len(runs["lean"]) == 3


def test_released_decoder_buffers_give_the_same_run(micro_model_dir, tmp_path):
    """``rollout.decode_buffers: release`` frees the static decoder's slots after each rollout
    (re-allocated by the next): the same metrics as ``keep``, which leaves them allocated."""
    from gbmpo.rollout.static_decoder import _DECODERS

    runs, slots = {}, {}
    for mode in ("keep", "release"):
        out = tmp_path / mode
        trainer = Trainer(micro_config(micro_model_dir, out, **{
            "rollout.decode_step": "static", "rollout.decode_buffers": mode}),
            reward_fn=varied_reward)  # fmt: skip
        trainer.train()
        runs[mode] = [without_timing(r) for r in read_metrics(out)]
        slots[mode] = len(_DECODERS[trainer.model][1]._slots)
    assert runs["keep"] == runs["release"] and len(runs["keep"]) == 3
    assert slots["keep"] >= 1 and slots["release"] == 0


# ----------------------------------------------------------------------------- rewards


def test_per_sample_reward_failures_count_as_zero(micro_model_dir, tmp_path):
    def flaky(prompts, completions, **columns):
        return [
            None if i % 4 == 0 else (float("nan") if i % 4 == 1 else 1.0 * (i % 2))
            for i, _ in enumerate(completions)
        ]

    Trainer(
        micro_config(micro_model_dir, tmp_path / "run", **{"run.steps": "2"}), reward_fn=flaky
    ).train()
    rec = read_metrics(tmp_path / "run")
    assert [r["reward_failures"] for r in rec] == [4, 4]  # 8 completions, rows 0,1,4,5
    assert rec[-1]["reward_failures_total"] == 8
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["reward_failures"] == 8


@pytest.mark.parametrize(
    ("reward_fn", "message"),
    [
        (lambda prompts, completions, **kw: 1 / 0, "raised for every one of the 8 completions"),
        (lambda prompts, completions, **kw: [float("nan")] * len(completions), "no usable reward"),
        (lambda prompts, completions, **kw: [1.0], "returned 1 values for 8 completions"),
        (lambda prompts, completions, **kw: None, "returned NoneType"),
    ],
)
def test_broken_reward_function_fails_clearly(micro_model_dir, tmp_path, reward_fn, message):
    run = tmp_path / "run"
    with pytest.raises(RewardError, match=message):
        Trainer(micro_config(micro_model_dir, run), reward_fn=reward_fn).train()
    assert not (run / "summary.json").exists()
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "RewardError" in status["error"]


def test_reward_sees_task_columns(micro_model_dir, tmp_path):
    seen = {}

    def spy(prompts, completions, answer, solution, **kw):
        seen["n"] = (len(prompts), len(completions), len(answer), len(solution))
        assert all(isinstance(a, str) for a in answer)
        # every completion of a group gets its prompt's answer
        assert answer[0] == answer[3] and prompts[0] == prompts[3]
        return [0.0] * len(completions)

    Trainer(
        micro_config(micro_model_dir, tmp_path / "run", **{"run.steps": "1"}), reward_fn=spy
    ).train()
    assert seen["n"] == (8, 8, 8, 8)


# ----------------------------------------------------------------------------- schedule


def test_learning_rate_schedules(micro_model_dir):
    def trainer(**extra: str) -> Trainer:
        return Trainer(micro_config(micro_model_dir, None, **extra), reward_fn=varied_reward)

    t = trainer(**{"optim.lr": "1e-3", "optim.warmup_steps": "4", "run.steps": "14"})
    lrs = []
    for step in range(6):
        t.step = step
        lrs.append(t.lr_at())
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    t = trainer(
        **{
            "optim.lr": "1e-3",
            "optim.warmup_steps": "4",
            "run.steps": "14",
            "optim.schedule": "cosine",
            "optim.min_lr_ratio": "0.1",
        }
    )
    t.step = 4
    assert t.lr_at() == pytest.approx(1e-3)
    t.step = 9  # half way through the 10 decay steps
    assert t.lr_at() == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    t.step = 14
    assert t.lr_at() == pytest.approx(1e-4)
    # with a time budget the decay ends when the budget is spent, if that comes first
    t = trainer(
        **{
            "optim.lr": "1e-3",
            "optim.schedule": "cosine",
            "run.steps": "1000",
            "run.time_budget_seconds": "100",
        }
    )
    t.step, t.rl_seconds = 10, 50.0
    assert t.lr_at() == pytest.approx(5e-4)
    t.rl_seconds = 150.0
    assert t.lr_at() == pytest.approx(0.0)
    t.step, t.rl_seconds = 900, 1.0  # steps first
    assert t.lr_at() == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    t = trainer(**{"optim.lr": "1e-3", "optim.schedule": "constant", "run.steps": "5"})
    t.step = 4
    assert t.lr_at() == 1e-3


def test_adamw_is_the_fused_kernel_with_a_fallback(monkeypatch):
    """The trainer's AdamW is torch's fused one where it exists (as transformers/TRL use), the
    same update as the for-loop implementation up to float rounding; a device or dtype without
    the fused kernel falls back to the for-loop one."""
    from gbmpo.train.setup import _adamw

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    grads = [torch.randn(w.shape, generator=g) for w in weights]
    results = []
    for fused in (True, False):
        params = [w.clone().requires_grad_() for w in weights]
        kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
        opt = _adamw(params, **kw) if fused else torch.optim.AdamW(params, **kw)
        assert bool(opt.param_groups[0]["fused"]) is fused
        for _ in range(3):
            for p, gr in zip(params, grads, strict=True):
                p.grad = gr.clone()
            opt.step()
        results.append(params)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    real = torch.optim.AdamW

    def no_fused_kernel(params, **kwargs):
        if kwargs.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be ... supported devices")
        return real(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused_kernel)
    opt = _adamw([weights[0].clone().requires_grad_()], lr=1e-3)
    assert not opt.param_groups[0]["fused"]
