"""The 'gbmpo' rollout generator (shared-prefill decode loop) and the prompt-sharing log-prob
forward: same decisions as transformers, same distribution, same log-probs and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.rollout import completion_logprobs, generate
from gbmpo.rollout.sampling import filter_logits, sample_from_logits

PROMPTS = [
    "Q: Anna has 3 eggs and 4 more.\nA:",
    "Q: 5*6=?\nA:",
    "Q: Ben picks 12 apples. He eats 2.\nA:",
]


def _masked(r):  # noqa: ANN001, ANN202
    return r.completion_ids * r.completion_mask


@pytest.mark.parametrize("batch_size", [None, 2])
def test_greedy_generator_matches_transformers_generate(micro_model, batch_size):
    """Greedy decoding takes the same tokens as ``model.generate`` (left-padded prompts,
    several rows per prompt from one expanded cache, prompts split into batches;
    transformers refuses several greedy sequences, so it gets each prompt twice)."""
    model, tok = micro_model
    kw = dict(max_new_tokens=12, do_sample=False)
    ours = generate(model, tok, PROMPTS, generator="gbmpo", num_return_sequences=2,
                    batch_size=batch_size, **kw)
    twice = [p for p in PROMPTS for _ in range(2)]
    theirs = generate(model, tok, twice, generator="hf", batch_size=batch_size and 2 * batch_size,
                      **kw)
    assert ours.num_tokens == theirs.num_tokens
    assert ours.truncated == theirs.truncated
    assert torch.equal(_masked(ours), _masked(theirs))
    assert ours.texts == theirs.texts


def test_greedy_generator_matches_on_the_shipped_model():
    from gbmpo.eval.evaluation import resolve_task
    from gbmpo.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("tiny")
    task = resolve_task("arithmetic", tokenizer=tok)
    prompts = [ex["prompt"] for ex in task.split(task.eval_split)[:6]]
    kw = dict(max_new_tokens=40, do_sample=False)
    ours = generate(model, tok, prompts, generator="gbmpo", **kw)
    theirs = generate(model, tok, prompts, generator="hf", **kw)
    assert ours.texts == theirs.texts
    assert not any(ours.truncated), "the SFT model ends its answers with EOS"


def test_top_k_one_sampling_is_greedy(micro_model):
    model, tok = micro_model
    sampled = generate(model, tok, PROMPTS, num_return_sequences=3, max_new_tokens=8, top_k=1,
                       generator_seed=5)
    greedy = generate(model, tok, PROMPTS, num_return_sequences=3, max_new_tokens=8,
                      do_sample=False)
    assert torch.equal(_masked(sampled), _masked(greedy))


def test_unknown_generator_lists_the_valid_ones(micro_model):
    model, tok = micro_model
    with pytest.raises(ValueError, match="valid generators: gbmpo, hf"):
        generate(model, tok, PROMPTS, generator="vllm")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(2, 30),
    temperature=st.sampled_from([0.3, 1.0, 1.7]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.1]),
    seed=st.integers(0, 10_000),
)
def test_filter_logits_matches_transformers_warpers(rows, vocab, temperature, top_k, top_p, seed):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1.0:
        want = TopPLogitsWarper(top_p)(None, want)
    got = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_inverse_cdf_sampler_frequencies():
    """20,000 draws from a 6-token distribution with two removed tokens: chi-square goodness
    of fit (df = 3) below the 0.999 quantile (16.27), removed tokens never drawn."""
    probs = torch.tensor([0.0, 0.1, 0.2, 0.0, 0.3, 0.4])
    z = probs.log().expand(20_000, 6)
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts = torch.bincount(sample_from_logits(z, u), minlength=6).double()
    assert counts[0] == counts[3] == 0
    expected = probs.double() * 20_000
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 16.27, chi2


def test_inverse_cdf_sampler_edges_never_pick_removed_tokens():
    z = torch.tensor([[-math.inf, 0.0, 1.0, -math.inf]] * 3)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sample_from_logits(z, u).tolist() == [1, 2, 2]


def _rollout_tensors(micro_model, g: int, max_new_tokens: int):  # noqa: ANN001, ANN202
    model, tok = micro_model
    r = generate(model, tok, PROMPTS, num_return_sequences=g, max_new_tokens=max_new_tokens,
                 generator_seed=11)
    assert (r.prompt_mask == 0).any(), "the test needs a left-padded prompt"
    return r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask


@pytest.mark.parametrize(("g", "max_new_tokens", "temperature"),
                         [(4, 10, 1.0), (3, 1, 1.0), (2, 7, 0.7)])
def test_shared_prompt_logprobs_and_gradients_match_single_forward(
    micro_model, g, max_new_tokens, temperature
):
    model, _ = micro_model
    args = _rollout_tensors(micro_model, g, max_new_tokens)
    mask = args[3].float()
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(model, *args, temperature=temperature,
                                        with_entropy=True, share_prompts=share)
        (logp * w * mask).sum().backward()
        results.append((logp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    (lp0, e0, g0), (lp1, e1, g1) = results
    assert lp0.shape == lp1.shape == mask.shape
    torch.testing.assert_close(lp1 * mask, lp0 * mask, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(e1 * mask, e0 * mask, atol=2e-5, rtol=1e-5)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()) + 1e-7, rtol=1e-4)


def test_shared_prompt_path_sums_the_group_gradient_exactly_in_float64(micro_model_dir,
                                                                        monkeypatch):
    """In float64 the prompt-sharing forward and the single forward agree to ~1e-12: the
    sharing is exact, not an approximation. (Qwen3's RMSNorm computes in float32 whatever the
    model dtype, which alone leaves ~1e-7 differences; it is swapped for a float64 one.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen3 import modeling_qwen3

    def rms_norm_in_input_dtype(self, x):  # noqa: ANN001, ANN202
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_input_dtype)

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(micro_model_dir)
    r = generate(model, tok, PROMPTS, num_return_sequences=3, max_new_tokens=6, generator_seed=2)
    args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    mask = r.completion_mask.double()
    out = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        # transformers' cache-sharing path (LeanForward's is tested in test_lean_forward.py)
        logp, _ = completion_logprobs(model, *args, share_prompts=share, lean=False)
        (logp.double() * mask).sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(out[1], out[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_logprobs_of_an_empty_completion(micro_model):
    model, tok = micro_model
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    empty = torch.zeros(len(PROMPTS), 0, dtype=torch.long)
    logp, ent = completion_logprobs(model, enc["input_ids"], enc["attention_mask"], empty, empty,
                                    with_entropy=True)
    assert logp.shape == (len(PROMPTS), 0) and ent is not None and ent.shape == (len(PROMPTS), 0)
