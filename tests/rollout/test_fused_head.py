"""The LM head fused into the log-prob chunks (:func:`linear_selective_log_softmax`): the same
log-probs, entropies and gradients (hidden states, head weight and bias, every model parameter)
as the full ``[B, T, V]`` logits, in float64, on the lean forward and on transformers' own
forward (with and without LoRA adapters), both layouts; a transformed head keeps the logits.

Tolerance 1e-10: both sides do the same float64 arithmetic and differ only in the summation
order of the head's weight gradient (one product per chunk, summed) and in chunk boundaries, a
relative error of a few ulps (~1e-15) times the number of terms, far below 1e-10; a wrong
formula (a missing softmax term, the temperature applied once instead of twice) is > 1e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gbmpo.rollout.logprobs import (
    _body_and_head,
    completion_hidden,
    completion_logits,
    completion_logprobs,
    linear_selective_log_softmax,
    selective_log_softmax_and_entropy,
)

transformers = pytest.importorskip("transformers")

from llama_like import tiny_llama_like  # noqa: E402

TOL = 1e-10


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_selective_log_softmax_equals_full_logits(temperature: float,
                                                         with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(41, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    b = (torch.randn(41, dtype=torch.float64, generator=gen).requires_grad_(True)
         if with_bias else None)
    idx = torch.randint(0, 41, (3, 7), generator=gen)
    g = torch.randn(3, 7, dtype=torch.float64, generator=gen)  # weights every token differently

    ref, ref_h = selective_log_softmax_and_entropy(F.linear(h, w, b) / temperature, idx)
    params = [t for t in (h, w, b) if t is not None]
    ref_grads = torch.autograd.grad((ref * g).sum(), params)
    out, ent = linear_selective_log_softmax(h, w, b, idx, temperature=temperature,
                                            chunk_rows=4, with_entropy=True)  # 6 chunks
    grads = torch.autograd.grad((out * g).sum(), params)
    assert out.dtype == torch.float64 and out.shape == idx.shape
    assert torch.allclose(out, ref, rtol=0, atol=TOL)
    assert ent is not None and torch.allclose(ent, ref_h, rtol=0, atol=1e-6)  # float32 output
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=TOL)
    with torch.no_grad():  # the no-grad path gives the same values
        again, _ = linear_selective_log_softmax(h, w, b, idx, temperature=temperature)
    assert torch.allclose(again, ref, rtol=0, atol=TOL)


def test_linear_selective_log_softmax_refuses_bad_shapes() -> None:
    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="index shape"):
        linear_selective_log_softmax(h, w, None, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="weight must be"):
        linear_selective_log_softmax(h, torch.randn(5, 3), None,
                                     torch.zeros(2, 3, dtype=torch.long))


def _batch() -> tuple[Tensor, ...]:
    """3 prompts (two left-padded) x 2 completions, two completions with a masked tail."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 6), generator=gen)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, :1] = 0
    cids = torch.randint(1, 97, (6, 5), generator=gen)
    cmask = torch.ones_like(cids)
    cmask[1, 3:] = 0
    cmask[-2, 1:] = 0
    return ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), cids, cmask


def _model(kind: str, lora: bool) -> torch.nn.Module:
    model = tiny_llama_like(kind, torch.float64)
    model.config._attn_implementation = "sdpa"
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        for name, p in model.named_parameters():  # non-zero B, so the adapters act
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(2))
    return model.train()


def _run(model: torch.nn.Module, *, fused: bool, lean: bool, share: bool
         ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    batch = _batch()
    logp, entropy = completion_logprobs(model, *batch, temperature=0.8, with_entropy=True,
                                        share_prompts=share, lean=lean, fused_head=fused,
                                        chunk_rows=4)
    weights = torch.linspace(0.5, 1.5, logp.numel(), dtype=logp.dtype).view_as(logp)
    (logp * batch[3] * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp * batch[3], entropy * batch[3], grads


@pytest.mark.parametrize(("kind", "lean", "lora"), [
    ("qwen3", True, False), ("llama", True, False),   # the lean forward (untied head too)
    ("qwen2", False, False),                           # transformers' forward, q/k/v biases
    ("qwen3", False, True),                            # PEFT adapters in the body
])
@pytest.mark.parametrize("share", [True, False])
def test_completion_logprobs_fused_equals_full(kind: str, lean: bool, lora: bool,
                                               share: bool) -> None:
    model = _model(kind, lora)
    logp, ent, grads = _run(model, fused=True, lean=lean, share=share)
    logp0, ent0, grads0 = _run(model, fused=False, lean=lean, share=share)
    assert torch.allclose(logp, logp0, rtol=0, atol=TOL)
    assert torch.allclose(ent, ent0, rtol=0, atol=1e-6)  # entropies come back as float32
    assert grads.keys() == grads0.keys() and grads
    if lora:
        assert any("lora_" in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(g, grads0[name], rtol=0, atol=TOL), name


def test_completion_hidden_is_the_logits_before_the_head() -> None:
    model = _model("qwen3", lora=True)
    batch = _batch()
    hidden, head = completion_hidden(model, *batch)
    logits = completion_logits(model, *batch)
    assert torch.allclose(F.linear(hidden, *head), logits, rtol=0, atol=TOL)


def test_a_transformed_head_keeps_the_models_logits() -> None:
    model = tiny_llama_like("llama", torch.float64)
    assert _body_and_head(model)[1] is not None
    model.config.final_logit_softcapping = 30.0  # the head's output is then not F.linear's
    assert _body_and_head(model) == (None, None)
    assert completion_hidden(model, *_batch(), lean=False) is None
