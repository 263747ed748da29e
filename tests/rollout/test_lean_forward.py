"""LeanForward: the same completion log-probs AND the same parameter gradients as transformers'
forward, for each supported architecture, both layouts (prompt-shared and single), left padding,
masked completion tails and grouped-query attention included; unsupported models fall back to
transformers' forward; the trainer gives the same run with ``rollout.lean_forward`` on and off.

The float64 comparisons run transformers' ``sdpa`` attention: its ``eager`` attention gives NaN
gradients for left-padded rows in float64 (a fully masked softmax row; a known transformers
issue), which the lean forward avoids by letting such rows attend to themselves.

Llama/Qwen RMSNorms compute in float32 whatever the model dtype, so in float64 two correct
forwards that accumulate the gradient of a shared prompt in a different order differ at ~1e-7.
The exactness tests therefore swap the norm for one computing in the input dtype on both sides
(transformers' modules and ``lean_forward._rms``), which leaves ~1e-15; the unpatched float32
and float64 paths are compared at float32 tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

import gbmpo.rollout.lean_forward as lean_forward
from gbmpo.rollout import LeanForward, completion_logprobs, lean_forward_unsupported_reason

transformers = pytest.importorskip("transformers")

from llama_like import KINDS, tiny_llama_like  # noqa: E402


def _model(kind: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model = tiny_llama_like(kind, dtype)
    model.config._attn_implementation = "sdpa"
    return model.train()


def _batch(groups: int = 3, g: int = 2, prompt: int = 6, completion: int = 5
           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``groups`` prompts (two left-padded by different amounts) x ``g`` completions each,
    two completions with a masked tail (an early EOS)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (groups, prompt), generator=gen)
    mask = torch.ones(groups, prompt, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, :1] = 0
    cids = torch.randint(1, 97, (groups * g, completion), generator=gen)
    cmask = torch.ones_like(cids)
    cmask[1, 3:] = 0
    cmask[-2, 1:] = 0
    return ids.repeat_interleave(g, 0), mask.repeat_interleave(g, 0), cids, cmask


def _logp_and_grads(model: torch.nn.Module, batch: tuple[Tensor, ...], *, lean: bool,
                    share: bool) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, *batch, share_prompts=share, lean=lean)
    # a loss touching every valid token with different weights
    weights = torch.linspace(0.5, 1.5, logp.numel(), dtype=logp.dtype).view_as(logp)
    (logp * weights * batch[3]).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def norms_in_input_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm in the input dtype on both sides (see the module docstring)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, x):  # noqa: ANN001, ANN202
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))

    for cls in (modeling_qwen3.Qwen3RMSNorm, modeling_qwen2.Qwen2RMSNorm,
                modeling_llama.LlamaRMSNorm):
        monkeypatch.setattr(cls, "forward", forward)
    monkeypatch.setattr(
        lean_forward, "_rms",
        lambda x, w, eps: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)),
    )


@pytest.mark.parametrize("share", [True, False], ids=["shared", "single"])
@pytest.mark.parametrize("kind", KINDS)
def test_values_and_parameter_gradients_match_transformers_in_float64(
    kind, share, norms_in_input_dtype
):
    model = _model(kind)
    batch = _batch()
    assert LeanForward.for_model(model) is not None
    ours, our_grads = _logp_and_grads(model, batch, lean=True, share=share)
    theirs, their_grads = _logp_and_grads(model, batch, lean=False, share=share)
    # every position, masked tails included (they are computed as transformers does)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-10, atol=1e-10, msg=name)
        # not vacuous: every parameter (norms, biases, both layers) receives a gradient
        assert grad.abs().max() > 1e-6, name
    assert (theirs[0] - theirs[2]).abs().max() > 1e-3  # rows differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_unpatched_model_matches_at_float32_rounding(kind, dtype):
    model = _model(kind, dtype)
    batch = _batch()
    ours, our_grads = _logp_and_grads(model, batch, lean=True, share=True)
    theirs, their_grads = _logp_and_grads(model, batch, lean=False, share=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_packed_additive_mask_is_the_boolean_mask_bit_for_bit(dtype):
    """The additive mask built once per pass gives ``scaled_dot_product_attention`` the same
    attention and input gradients as the boolean mask it converts on every call."""
    model = _model("qwen3", dtype)  # 4 query heads on 2 key/value heads: folded queries
    forward = LeanForward.for_model(model)
    assert forward is not None
    real = torch.ones(3, 7, dtype=torch.bool)
    real[0, :2] = False  # left padding: those positions attend to themselves
    allowed = forward._self_masks(real)
    # the query heads of a key/value head folded into the query sequence: [R, 1, 2*T, S]
    boolean = allowed.unsqueeze(1).repeat(1, 1, 2, 1)
    additive = forward._pack_mask(allowed, dtype)
    assert additive.dtype == dtype and boolean.dtype == torch.bool
    assert torch.equal(additive == 0, boolean) and bool((additive[~boolean] == -math.inf).all())
    gen = torch.Generator().manual_seed(0)
    shape = (3, 2, boolean.shape[2], 16)
    q, k, v = (torch.randn(*shape[:2], s, 16, generator=gen).to(dtype).requires_grad_()
               for s in (shape[2], 7, 7))
    outs = []
    for mask in (boolean, additive):
        q.grad = k.grad = v.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype))
        outs.append((out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert not torch.isnan(outs[0][0]).any()


def test_no_grad_pass_and_single_prompt_group():
    """Under ``no_grad`` (old/reference passes) and with nothing to share (``G = 1``)."""
    model = _model("qwen3").eval()
    ids, mask, cids, cmask = _batch(g=1)
    with torch.no_grad():
        ours, _ = completion_logprobs(model, ids, mask, cids, cmask, lean=True)
        theirs, _ = completion_logprobs(model, ids, mask, cids, cmask, lean=False)
    assert not ours.requires_grad
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # a single completion token: only the prompt's last position is used (single forward)
    with torch.no_grad():
        one, _ = completion_logprobs(model, ids, mask, cids[:, :1], cmask[:, :1], lean=True)
    torch.testing.assert_close(one, theirs[:, :1], rtol=1e-6, atol=1e-6)
    # ... and in the prompt-shared layout (two rows per prompt)
    ids2, mask2, cids2, cmask2 = _batch(g=2)
    with torch.no_grad():
        ours2, _ = completion_logprobs(model, ids2, mask2, cids2[:, :1], cmask2[:, :1], lean=True)
        theirs2, _ = completion_logprobs(model, ids2, mask2, cids2[:, :1], cmask2[:, :1],
                                         lean=False)
    torch.testing.assert_close(ours2, theirs2, rtol=1e-6, atol=1e-6)


def test_unsupported_models_fall_back_to_transformers(monkeypatch):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "model_type 'gpt2'" in lean_forward_unsupported_reason(gpt2)
    assert LeanForward.for_model(gpt2) is None
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        LeanForward(gpt2)

    model = _model("qwen3", torch.float32)
    assert lean_forward_unsupported_reason(model) is None
    model.activation_checkpointing_enable()
    assert "checkpointing" in lean_forward_unsupported_reason(model)
    model.activation_checkpointing_disable()
    model.config.attention_dropout = 0.1
    assert "dropout" in lean_forward_unsupported_reason(model.train())
    assert lean_forward_unsupported_reason(model.eval()) is None  # no dropout in eval mode

    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_model("qwen3", torch.float32), peft.LoraConfig(
        r=2, target_modules=["q_proj", "v_proj"]))
    assert lean_forward_unsupported_reason(lora) is not None

    # a refused model never reaches LeanForward inside completion_logprobs
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("LeanForward used for an unsupported model")

    monkeypatch.setattr(LeanForward, "shared_prompt_logits", refuse)
    monkeypatch.setattr(LeanForward, "sequence_logits", refuse)
    logp, _ = completion_logprobs(lora, *_batch())
    assert torch.isfinite(logp).all()


def _trainer_config(model_dir: Path, out: Path, lean: bool):  # noqa: ANN202
    from gbmpo.train import load_config

    overrides = {
        "model.path": str(model_dir), "rollout.prompts_per_step": "2",
        "rollout.num_generations": "4", "rollout.max_new_tokens": "8",
        "rollout.lean_forward": str(lean).lower(),
        "eval.before": "false", "eval.after": "false", "eval.every": "0",
        "run.time_budget_seconds": "null", "run.progress": "false", "run.steps": "3",
        "run.output_dir": str(out), "optim.lr": "1e-3", "optim.schedule": "constant",
        # two AdamW steps on mini-batches per generation batch: the old-policy, reference and
        # policy passes all run
        "optim.mu": "2", "optim.mini_batch_size": "4",
    }
    return load_config(None, list(overrides.items()))


def test_trainer_gives_the_same_run_with_and_without_it(micro_model_dir, tmp_path):
    """``rollout.lean_forward`` changes how the log-prob passes run, not what they compute:
    the same seed gives the same metrics (rewards, lengths, losses, KL, grad norms) to float32
    rounding with it on and off."""
    from gbmpo.lifecycle.logging import read_metrics, without_timing
    from gbmpo.train import Trainer

    def reward(prompts, completions, **columns):  # noqa: ANN001, ANN003, ANN202
        return [float(len(c) % 3) / 2 for c in completions]

    runs = {}
    for lean in (True, False):
        out = tmp_path / str(lean)
        Trainer(_trainer_config(micro_model_dir, out, lean), reward_fn=reward).train()
        runs[lean] = [without_timing(r) for r in read_metrics(out)]
    assert len(runs[True]) == 3
    compared = 0
    for ours, theirs in zip(runs[True], runs[False], strict=True):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, float) and math.isfinite(value):
                assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
                compared += 1
            else:
                assert ours[key] == value, key
    assert compared > 10
