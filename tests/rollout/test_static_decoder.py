"""StaticDecoder: the static-shape decode step draws the same tokens as the lean decoder from the
same uniform numbers, with the same sampler log-probs, left padding and EOS handled alike; with
LoRA (merged, or inline) the same as peft's unmerged forward; the stop test every k steps, the
slots and the CUDA graph (on a GPU) change nothing.

Tolerances: the static step attends over the whole masked buffer (``W + T`` columns) where the
lean decoder attends over the ``col + 1`` written ones; the extra terms are exact zeros, but
vectorised sums group their terms by length, so the logits agree to float rounding only: a few
ulps per layer, i.e. ~1e-7 relative in float32 on logits of magnitude < 10, hence 1e-5 on a
log-prob (an order of magnitude above it), and 1e-12 in float64 (machine epsilon 2e-16). The
sampler's log-probs are float32 (``sampled_logprobs``) whatever the model's dtype, so float64
models are compared on their logits, not on those."""

from __future__ import annotations

import warnings

import pytest
import torch

import gbmpo.rollout.static_decoder as static_module
from gbmpo.rollout import StaticDecoder, generate, static_decoder_unsupported_reason
from gbmpo.rollout.sampling import _decode, static_by_default
from gbmpo.rollout.static_decoder import width_bucket

transformers = pytest.importorskip("transformers")

from llama_like import SMALL, padded_prompts, tiny_llama_like  # noqa: E402

#: many EOS ids (a quarter of the vocabulary), so that rows end early: a row's end and the
#: trimmed width are tested
EOS = list(range(5, 97, 4))


def _model(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_llama_like(kind, dtype).eval()


def _run(model, step: str, lean: bool = True, seed: int = 9, **kw):
    """``_decode``'s tokens and per-step sampler log-probs ``[rows, C]``."""
    ids, mask = (t.to(next(model.parameters()).device) for t in padded_prompts())
    args = dict(repeats=4, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9,
                top_k=30, eos_ids=EOS, pad_id=0)  # fmt: skip
    args.update(kw)
    logp: list[torch.Tensor] = []
    torch.manual_seed(seed)
    with torch.no_grad():
        tokens = _decode(model, ids, mask, lean=lean, decode_step=step, logprobs=logp, **args)
    return tokens, (torch.stack(logp, 1) if logp else None)


def _use(monkeypatch, decoder: StaticDecoder) -> None:
    """Make ``_decode`` take ``decoder`` (built with options ``generate`` does not pass)."""
    monkeypatch.setattr(StaticDecoder, "for_model", classmethod(lambda cls, m, **o: decoder))


def _lora(kind: str, dtype: torch.dtype, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj")):
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(tiny_llama_like(kind, dtype), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=list(targets)))
    with torch.no_grad():  # B starts at 0: a random B makes the adapters change the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_same_tokens_and_sampler_logprobs_as_the_lean_decoder(kind):
    model = _model(kind)
    lean, lean_logp = _run(model, "lean")
    static, static_logp = _run(model, "static")
    assert torch.equal(static, lean)
    torch.testing.assert_close(static_logp, lean_logp, rtol=0, atol=1e-5)
    # EOS and padding alike: rows ended early are padded after their EOS, the width trimmed
    # to the step at which every row had ended (or the budget)
    ended = torch.isin(lean, torch.tensor(EOS))
    assert ended.any(1).sum() >= 6, "the EOS ids end most rows"
    first = ended.int().argmax(1)
    for row in range(lean.shape[0]):
        if ended[row].any():
            assert (static[row, first[row] + 1 :] == 0).all()
            assert (static_logp[row, first[row] + 1 :] == 0).all()
    assert len(set(lean.flatten().tolist())) > 10, "sampling, not a constant sequence"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_float64_logits_equal_the_lean_decoders(kind, monkeypatch):
    """The step's arithmetic is the lean decoder's: in float64 the logits it feeds the sampler
    agree to 1e-12 (compared by recording every step's logits)."""
    from gbmpo.rollout import decoder as lean_module

    model = _model(kind, torch.float64)
    seen: dict[str, list[torch.Tensor]] = {"lean": [], "static": []}
    lean_step = lean_module.LeanDecoder.step

    def lean_spy(self, tokens, positions):
        out = lean_step(self, tokens, positions)
        seen["lean"].append(out.clone())
        return out

    static_forward = StaticDecoder._forward

    def static_spy(self, slot, tokens):
        out = static_forward(self, slot, tokens)
        seen["static"].append(out.clone())
        return out

    monkeypatch.setattr(lean_module.LeanDecoder, "step", lean_spy)
    monkeypatch.setattr(StaticDecoder, "_forward", static_spy)
    lean, _ = _run(model, "lean", eos_ids=[-1])
    static, _ = _run(model, "static", eos_ids=[-1])
    assert torch.equal(static, lean) and lean.shape == (12, 16)
    # the static step also feeds the last token (its logits are never used)
    assert len(seen["lean"]) == 15 and len(seen["static"]) == 16
    for a, b in zip(seen["static"], seen["lean"], strict=False):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_greedy_and_check_every_k_steps_change_nothing(monkeypatch):
    model = _model("qwen3")
    greedy_lean, _ = _run(model, "lean", do_sample=False)
    greedy_static, _ = _run(model, "static", do_sample=False)
    assert torch.equal(greedy_static, greedy_lean)
    lean, lean_logp = _run(model, "lean")
    decoder = StaticDecoder(model, check_every=5)
    _use(monkeypatch, decoder)
    static, static_logp = _run(model, "static")
    # every row ended after 14 steps: the static loop ran 15 (checks every 5), trimmed to 14
    assert lean.shape[1] == 14
    assert torch.equal(static, lean)
    torch.testing.assert_close(static_logp, lean_logp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["merge", "inline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lora_decode_matches_the_unmerged_peft_forward(mode, dtype, monkeypatch):
    model = _lora("qwen3", dtype)
    assert static_decoder_unsupported_reason(model) is None
    assert static_by_default(model), "the lean decoder refuses LoRA: auto takes the static step"
    peft_tokens, peft_logp = _run(model, "lean", lean=False)  # peft's own forward per token
    decoder = StaticDecoder(model, lora=mode)
    assert (len(decoder._merges) == 14) == (mode == "merge")  # 7 projections x 2 layers
    with monkeypatch.context() as patch:
        _use(patch, decoder)
        tokens, logp = _run(model, "static")
    assert torch.equal(tokens, peft_tokens)
    # float32 log-probs either way (see the module docstring); merged weights round W + sBA
    # once in the model's dtype, a few ulps of the weights: within the same 1e-5
    torch.testing.assert_close(logp, peft_logp, rtol=0, atol=1e-5)
    # the adapters matter: without them the tokens differ
    with model.disable_adapter():
        base_tokens, _ = _run(model, "static")
    assert not torch.equal(base_tokens, tokens)


def test_lora_weights_updated_in_place_are_followed():
    """The merged copy is refreshed at each decode: an optimizer step on the adapters (in place)
    changes the decode as it changes peft's forward; disabling the adapters decodes the base."""
    model = _lora("qwen3", torch.float32, targets=("q_proj", "v_proj", "down_proj"))
    first, _ = _run(model, "static")
    decoder = StaticDecoder.for_model(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(-2.0)
    assert StaticDecoder.for_model(model) is decoder, "in-place updates keep the decoder"
    updated, _ = _run(model, "static")
    reference, _ = _run(model, "lean", lean=False)
    assert torch.equal(updated, reference) and not torch.equal(updated, first)
    with model.disable_adapter():
        assert StaticDecoder.for_model(model) is not decoder  # the adapter state changed
        base, _ = _run(model, "static")
    with model.disable_adapter():
        plain, _ = _run(model, "lean", lean=False)
    assert torch.equal(base, plain)


def test_generate_with_the_static_step(micro_model):
    """Through :func:`generate`: the same completions, masks and (1e-5) sampler log-probs as the
    lean decoder, chunked prompts included; an unknown decode step is refused."""
    model, tok = micro_model
    prompts = ["1+1=", "12+30=", "7+8=", "100+1="]
    out = {}
    for step in ("lean", "static"):
        out[step] = generate(model, tok, prompts, num_return_sequences=3, max_new_tokens=10,
                             top_p=0.9, generator_seed=5, batch_size=3, decode_step=step,
                             return_logprobs=True)  # fmt: skip
    a, b = out["lean"], out["static"]
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask) and a.texts == b.texts
    torch.testing.assert_close(b.sampling_logp, a.sampling_logp, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown decode step 'graph'.*auto, static, lean"):
        generate(model, tok, prompts, max_new_tokens=4, decode_step="graph")


def test_slots_are_reused_and_the_oldest_dropped(monkeypatch):
    monkeypatch.setattr(static_module, "MAX_SLOTS", 2)
    model = _model("qwen2")
    static_module._DECODERS.pop(model, None)
    want = {n: _run(model, "lean", max_new_tokens=n)[0] for n in (6, 7, 8)}
    for n in (6, 7, 6, 8, 6):  # three shapes through two slots
        assert torch.equal(_run(model, "static", max_new_tokens=n)[0], want[n])
    decoder = StaticDecoder.for_model(model)
    assert [key[2] for key in decoder._slots] == [8, 6]  # least recently used first


def test_a_failed_graph_capture_falls_back_to_the_eager_step(monkeypatch):
    """Should an op of the step not be capturable on some torch/CUDA, the decode runs eagerly
    with a warning instead of failing (simulated on the CPU)."""
    model = _model("qwen3")
    want, _ = _run(model, "lean")
    decoder = StaticDecoder(model)
    decoder.graphs = True

    def fail(slot):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decoder, "_capture", fail)
    _use(monkeypatch, decoder)
    with pytest.warns(RuntimeWarning, match="capture failed.*without graphs"):
        got, _ = _run(model, "static")
    assert torch.equal(got, want) and decoder.graphs is False


def test_width_buckets_and_bad_arguments():
    assert [width_bucket(w) for w in (1, 64, 65, 128, 129, 700)] == [64, 64, 128, 128, 256,
                                                                     1024]  # fmt: skip
    with pytest.raises(ValueError, match="at least one column"):
        width_bucket(0)
    model = _model("qwen3")
    with pytest.raises(ValueError, match="unknown lora mode 'fused'; valid: merge, inline"):
        StaticDecoder(model, lora="fused")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        StaticDecoder(model, graphs=True)
    with pytest.raises(ValueError, match="check_every"):
        StaticDecoder(model, check_every=0)
    ids, mask = padded_prompts()
    with pytest.raises(ValueError, match="uniforms of shape"):
        StaticDecoder(model).run([], mask, torch.zeros(3, 97), repeats=1, max_new_tokens=4,
                                 do_sample=True, eos_ids=[1], pad_id=0)  # fmt: skip


def test_unsupported_models_are_refused_with_the_reason():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "model_type 'gpt2'" in static_decoder_unsupported_reason(gpt2)
    assert StaticDecoder.for_model(gpt2) is None
    sliding = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=1))
    assert "sliding-window" in static_decoder_unsupported_reason(sliding)
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dora = peft.get_peft_model(_model("qwen3"), peft.LoraConfig(
            r=2, target_modules=["q_proj"], use_dora=True))
    assert "q_proj: a LoRA variant" in static_decoder_unsupported_reason(dora)
    assert StaticDecoder.for_model(dora) is None
    assert static_by_default(_model("qwen3")) is False, "the CPU keeps the lean decoder"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decodes_as_the_eager_step(monkeypatch):
    """On a GPU: the captured graph replays the eager static step (the same tokens), follows
    in-place weight updates without a new capture, and is the default there."""
    model = _lora("qwen3", torch.float32).cuda()
    assert static_by_default(model)
    eager, graph = StaticDecoder(model, graphs=False), StaticDecoder(model)
    assert graph.graphs and not eager.graphs

    def decode(decoder):
        with monkeypatch.context() as patch:
            _use(patch, decoder)
            return _run(model, "static")

    assert torch.equal(decode(graph)[0], decode(eager)[0])
    assert all(slot.graph is not None for slot in graph._slots.values())
    with torch.no_grad():  # an optimizer-like in-place update of the adapters
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(-2.0)
    updated, before = decode(graph), decode(eager)
    assert torch.equal(updated[0], before[0]) and len(graph._slots) == 1


def _slot_nbytes(slot) -> int:
    """Bytes of every tensor a slot holds (its key/value lists included)."""
    total = 0
    for value in vars(slot).values():
        tensors = value if isinstance(value, list) else [value]
        total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return total


@pytest.mark.parametrize(("kind", "dtype", "new"), [("qwen3", torch.bfloat16, 16),
                                                    ("llama", torch.float32, 9)])
def test_the_memory_plan_counts_a_slot_to_the_byte(kind, dtype, new):
    """:func:`gbmpo.train.memory.static_decode_bytes` is the sum of the buffers the slot
    allocates (keys, values, mask, rotary tables, logits, per-step records, EOS ids)."""
    from gbmpo.train.memory import static_decode_bytes

    model = _model(kind, dtype)
    static_module._DECODERS.pop(model, None)
    _run(model, "static", max_new_tokens=new)
    (slot,) = StaticDecoder.for_model(model)._slots.values()
    ids, _ = padded_prompts()
    rows, width = 4 * ids.shape[0], ids.shape[1]  # _run: 4 completions per prompt
    planned = static_decode_bytes(model.config, rows, width, new, dtype.itemsize,
                                  eos_ids=len(EOS))  # fmt: skip
    assert _slot_nbytes(slot) == planned


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("k_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj")])
def test_the_memory_plan_counts_the_merged_weights_to_the_byte(targets):
    """:func:`gbmpo.train.memory.merged_lora_bytes` is the size of the merged copies the
    decoder keeps (``lora="merge"``), for the adapted projections only."""
    from gbmpo.train.memory import merged_lora_bytes

    model = _lora("qwen3", torch.bfloat16, targets)
    decoder = StaticDecoder(model, lora="merge", graphs=False)
    assert len(decoder._merges) == len(targets) * len(decoder.layers)
    merged = sum(m.out.nbytes for m in decoder._merges)
    assert merged == merged_lora_bytes(model.config, targets, 2)
    assert StaticDecoder(model, lora="inline", graphs=False)._merges == []


@pytest.mark.parametrize("lora", [False, True])
def test_release_frees_the_slots_and_merged_copies_and_decodes_the_same(lora):
    """After :meth:`StaticDecoder.release` no slot, graph pool or merged storage is left; the
    next decode allocates them again and draws the same tokens for the same seed as a decoder
    that kept them (``rollout.decode_buffers: release`` vs ``keep``)."""
    from gbmpo.rollout.static_decoder import release_static_decoder

    model = _lora("qwen3", torch.float32) if lora else _model("llama")
    static_module._DECODERS.pop(model, None)
    kept = [_run(model, "static", seed=s) for s in (3, 3, 4)]
    decoder = StaticDecoder.for_model(model)
    assert len(decoder._slots) == 1 and (not lora or decoder._merges)
    merged_bytes = [m.out.untyped_storage().nbytes() for m in decoder._merges]
    released = []
    for seed in (3, 3, 4):
        assert release_static_decoder(model)
        assert not decoder._slots and decoder._pool is None
        assert all(m.out.untyped_storage().nbytes() == 0 for m in decoder._merges)
        released.append(_run(model, "static", seed=seed))
        assert StaticDecoder.for_model(model) is decoder and len(decoder._slots) == 1
        assert [m.out.untyped_storage().nbytes() for m in decoder._merges] == merged_bytes
    for (tok_k, logp_k), (tok_r, logp_r) in zip(kept, released, strict=True):
        assert torch.equal(tok_k, tok_r) and torch.equal(logp_k, logp_r)
    static_module._DECODERS.pop(model, None)
    assert not release_static_decoder(model)  # no decoder kept: nothing to free


def _measured_step_bytes(decoder: StaticDecoder, rows: int, width: int, dtype: torch.dtype,
                         settings) -> int:  # fmt: skip
    """The peak of the bytes one ``_step`` allocates beyond its slot (the profiler's memory
    timeline of the step's tensors: created minus destroyed), after one warm-up step."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with torch.inference_mode():
        slot = decoder._slot(rows, width, 8, settings, torch.empty(1, dtype=dtype))
        decoder._refresh()
        slot.logits.normal_()
        slot.mask.zero_()  # every column open: the attention reads the whole buffer
        slot.uniforms.uniform_()
        decoder._step(slot)
        slot.t.zero_()
        slot.col.fill_(slot.bucket)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:  # fmt: skip
            decoder._step(slot)
    alive = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        alive += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize(("dtype", "width", "sampling"), [
    (torch.float32, 60, dict(do_sample=True, temperature=0.7, top_p=0.9)),  # the top-p sort
    (torch.bfloat16, 60, dict(do_sample=True, top_k=50)),  # the float64 CDF of the draw
    (torch.float32, 900, dict(do_sample=False)),  # greedy over a long buffer: the attention
    (torch.bfloat16, 900, dict(do_sample=False)),
])  # fmt: skip
def test_the_decode_steps_transient_memory_matches_its_formula(dtype, width, sampling):
    """:func:`gbmpo.train.memory.decode_step_bytes` (what a captured step keeps in its graph's
    pool on CUDA) against the peak the profiler measures for one step on the CPU, on a model
    whose vocabulary (4096) or buffer (1032 columns) makes one term dominate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gbmpo.rollout.static_decoder import _Settings
    from gbmpo.train.memory import decode_step_bytes

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=2048)
    decoder = StaticDecoder(LlamaForCausalLM(cfg).eval().to(dtype), graphs=False)
    settings = _Settings(sampling["do_sample"], sampling.get("temperature", 1.0),
                         sampling.get("top_k", 0), sampling.get("top_p", 1.0), (1,), 0)
    rows = 16
    measured = _measured_step_bytes(decoder, rows, width, dtype, settings)
    planned = decode_step_bytes(cfg, rows, width_bucket(width) + 8, dtype.itemsize,
                                device="cpu", **sampling)  # fmt: skip
    # the formula leaves out the per-row vectors alive beside its terms (the residual stream,
    # the norm's float32 copy, q/k/v and their rotation, the rotary rows, the MLP's four
    # intermediate-wide tensors, the drawn tokens): fewer than 8 float32 vectors of
    # h + q + 2k + i elements per row (measured: 128 bytes to 2.1% above the formula)
    h, q, k, i = 64, 64, 32, 96
    assert planned <= measured <= planned + 8 * 4 * rows * (h + q + 2 * k + i)
