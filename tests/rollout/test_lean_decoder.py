"""LeanDecoder: the same next-token logits as the model's own forward with a KV cache, for each
supported architecture, left padding and grouped-query attention included; unsupported models
are refused with the reason, and the 'gbmpo' engine samples the same tokens either way."""

from __future__ import annotations

import pytest
import torch

import gbmpo.rollout.decoder as decoder_module
from gbmpo.rollout import LeanDecoder, LeanForward, lean_decoder_unsupported_reason
from gbmpo.rollout.decoder import _rms, _rotate, _rotate_swap, _signed_sin
from gbmpo.rollout.sampling import _decode, _prefill

transformers = pytest.importorskip("transformers")

from llama_like import SMALL, padded_prompts, tiny_llama_like  # noqa: E402


def _model(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_llama_like(kind, dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_logits_match_the_models_own_cached_forward(kind, dtype):
    model = _model(kind, dtype)
    ids, mask = padded_prompts()
    repeats, steps = 2, 9
    with torch.no_grad():
        cache, logits = _prefill(model, ids, mask, repeats)
        att = mask.repeat_interleave(repeats, dim=0)
        decoder = LeanDecoder(model)
        decoder.start(cache, att, steps)
        # Qwen3's q_norm/k_norm run as one norm over the query and key heads
        assert all((n is not None) == (kind == "qwen3") for n in decoder._qk_norms)
        ref_cache, _ = _prefill(model, ids, mask, repeats)
        position = att.sum(dim=-1)
        g = torch.Generator().manual_seed(2)
        tok = logits.argmax(-1)
        seen = []
        for _ in range(steps):
            ours = decoder.step(tok, position)
            att = torch.cat([att, att.new_ones(att.shape[0], 1)], dim=1)
            out = model(input_ids=tok[:, None], attention_mask=att,
                        position_ids=position[:, None], past_key_values=ref_cache,
                        use_cache=True)
            ref_cache, theirs = out.past_key_values, out.logits[:, -1]
            tol = 1e-12 if dtype == torch.float64 else 2e-5
            torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
            seen.append(theirs)
            tok = torch.multinomial(theirs.float().softmax(-1), 1, generator=g)[:, 0]
            position = position + 1
    # the check is not vacuous: the logits move from step to step and differ between rows
    assert (seen[0] - seen[-1]).abs().max() > 1e-3
    assert (seen[0][0] - seen[0][2]).abs().max() > 1e-3


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_lean_prefill_matches_the_models_own_prefill(kind, shared, monkeypatch):
    """LeanForward.prompt_cache + LeanDecoder.start_repeated (the lean engine's prefill: each
    prompt's keys/values copied straight to its rows, or kept once per prompt and attended to
    per prompt, ``shared``) give the same last-position logits, the same keys/values at the
    real prompt positions and the same decode logits afterwards as transformers' prefill
    expanded with batch_repeat_interleave, in float64."""
    monkeypatch.setattr(decoder_module, "_SHARED_PROMPT_MIN_BYTES", 0 if shared else 1 << 62)
    model = _model(kind, torch.float64)
    ids, mask = padded_prompts()
    repeats, steps = 3, 4
    with torch.no_grad():
        cache, theirs = _prefill(model, ids, mask, repeats)
        logits, keys_values = LeanForward(model).prompt_cache(ids, mask)
        ours = logits.repeat_interleave(repeats, dim=0)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        att = mask.repeat_interleave(repeats, dim=0)
        real = att.bool()[:, None, :, None]  # padded positions are never attended to
        hf_decoder, lean_decoder = LeanDecoder(model), LeanDecoder(model)
        hf_decoder.start(cache, att, steps)
        lean_decoder.start_repeated(keys_values, mask, repeats, steps)
        width = ids.shape[1]
        assert lean_decoder._shared is shared and not hf_decoder._shared
        if shared:  # once per prompt
            ours_kv = [(k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0))
                       for k, v in lean_decoder._prompt_kv]
        else:
            ours_kv = [(k[:, :, :width], v[:, :, :width])
                       for k, v in zip(lean_decoder._keys, lean_decoder._values, strict=True)]
        for (k_hf, v_hf), (k_ours, v_ours) in zip(
            [(layer.keys, layer.values) for layer in cache.layers], ours_kv, strict=True,
        ):
            torch.testing.assert_close(torch.where(real, k_ours, 0),
                                       torch.where(real, k_hf, 0), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(torch.where(real, v_ours, 0),
                                       torch.where(real, v_hf, 0), rtol=1e-12, atol=1e-12)
        position, tok = att.sum(-1), theirs.argmax(-1)
        for _ in range(steps):
            a, b = lean_decoder.step(tok, position), hf_decoder.step(tok, position)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            tok, position = b.argmax(-1), position + 1
    with pytest.raises(ValueError, match="layers"):
        LeanDecoder(model).start_repeated(keys_values[:1], mask, repeats, steps)


@pytest.mark.parametrize("shared", [False, True])
def test_engine_samples_the_same_tokens_with_and_without_it(shared, monkeypatch):
    monkeypatch.setattr(decoder_module, "_SHARED_PROMPT_MIN_BYTES", 0 if shared else 1 << 62)
    model = _model("qwen3")
    ids, mask = padded_prompts()
    kw = dict(repeats=4, max_new_tokens=12, do_sample=True, temperature=1.0, top_p=0.9,
              top_k=0, eos_ids=[5], pad_id=0)
    out = {}
    for lean in (True, False):
        torch.manual_seed(3)
        with torch.no_grad():
            out[lean] = _decode(model, ids, mask, lean=lean, **kw)
    assert torch.equal(out[True], out[False])
    assert out[True].shape[0] == 12
    assert len(set(out[True].flatten().tolist())) > 5, "sampling, not a constant sequence"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_by_half_swap_is_bit_identical(dtype):
    """The decode step's rotation (one flip, the sign folded into the sin table) gives the same
    bits as the rotate-half formula transformers uses."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 5, 16, generator=g, dtype=dtype)
    cos = torch.randn(6, 1, 16, generator=g, dtype=dtype)
    sin = torch.randn(6, 1, 16, generator=g, dtype=dtype)
    assert torch.equal(_rotate_swap(x, cos, _signed_sin(sin)), _rotate(x, cos, sin))


@pytest.mark.parametrize("shape", [(5, 16), (4, 6, 16), (3, 5, 2, 16)])
@pytest.mark.parametrize("joint", [False, True])
def test_float32_rms_norm_is_bit_identical_to_the_formula(shape, joint):
    """_rms takes F.rms_norm for float32 (one call instead of six): the same bits as the
    Llama/Qwen formula, values and both gradients, for a per-channel and a joint (per-head)
    weight."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(*shape, generator=g) * 3).requires_grad_()
    w_shape = shape[-2:] if joint and len(shape) > 2 else shape[-1:]
    w = torch.randn(*w_shape, generator=g).requires_grad_()
    x32 = x.float()
    formula = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    ours = _rms(x, w, 1e-6)
    assert torch.equal(ours, formula)
    weights = torch.randn(*shape, generator=g)
    grads = torch.autograd.grad((ours * weights).sum(), (x, w))
    want = torch.autograd.grad((formula * weights).sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True))


def test_more_steps_than_reserved_is_an_error():
    model = _model("qwen2")
    ids, mask = padded_prompts()
    with torch.no_grad():
        cache, logits = _prefill(model, ids, mask, 1)
        decoder = LeanDecoder(model)
        decoder.start(cache, mask, 1)
        decoder.step(logits.argmax(-1), mask.sum(-1))
        with pytest.raises(RuntimeError, match="max_new_tokens"):
            decoder.step(logits.argmax(-1), mask.sum(-1) + 1)


def test_unsupported_models_are_refused_with_the_reason():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "model_type 'gpt2'" in lean_decoder_unsupported_reason(gpt2)
    assert LeanDecoder.for_model(gpt2) is None
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        LeanDecoder(gpt2)

    sliding = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=1))
    assert "sliding-window" in lean_decoder_unsupported_reason(sliding)

    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_model("qwen3"), peft.LoraConfig(
        r=2, target_modules=["q_proj", "v_proj"]))
    assert lean_decoder_unsupported_reason(lora) is not None
    merged_base = lora.get_base_model()  # adapted layers inside a plain causal LM
    assert "not a plain nn.Linear" in lean_decoder_unsupported_reason(merged_base)
    assert lean_decoder_unsupported_reason(_model("qwen3")) is None
