r"""The memory plan of a run, per GPU, on every engine (``gbmpo train --dry-run``).

The parts (bytes on one device):

* **static**: weights, gradients, optimizer state (AdamW: two fp32 moments, plus fp32 master
  weights for 16-bit parameters), the frozen reference (:func:`gbmpo.train.device.estimate_memory`);
  on verl, FSDP shards them over the GPUs (divided by their number);
* **activations** of the training forward kept for the backward, one micro-batch of ``rows``
  sequences of ``L = prompt + completion`` tokens (:func:`activation_bytes`);
* **generation**: the KV cache of one generate call (own engine, TRL with transformers'
  ``generate``), or the share of the device vLLM reserves (``gpu_memory_utilization``: TRL's
  colocated vLLM, verl's rollout);
* **decode state** of the own engine's static decode step
  (:class:`~gbmpo.rollout.static_decoder.StaticDecoder`, taken on CUDA and for LoRA models,
  :func:`uses_static_decoder`): its slots of buffers for the whole completion
  (:func:`static_decode_bytes`; the rollouts' and the evaluations', up to four,
  :func:`decode_slots`), on CUDA their graphs' memory pool (:func:`decode_step_bytes`), and
  with LoRA the merged copy of the adapted weights (:func:`merged_lora_bytes`); its KV cache is
  the slot's, and what the rollout allocates besides is the prefill's prompt keys/values.
  ``rollout.decode_buffers`` keeps them through the update (``keep``) or frees them after each
  rollout and evaluation (``release``; ``auto``: release when keeping does not fit).

TRL (``GRPOConfig``'s default) and verl (``enable_gradient_checkpointing``) checkpoint the
gradient: their activations are each layer's input plus one layer recomputed.

Generation and the update do not overlap in time (the KV cache is freed before the update, vLLM
keeps its reserve), so the peak is ``static + decode state + max(activations, KV cache)`` with
the decoder's state kept, ``static + max(activations, each generation phase with its decode
state)`` with it released, or ``static + vLLM reserve + activations`` with vLLM.

On the own engine with ``optim.micro_batch_size: null`` and a known device size, the plan
chooses the micro-batch: the largest divisor of the mini-batch whose peak fits with
:data:`PLAN_MARGIN` to spare (:func:`planned_micro_batch`; the trainer asks the same on CUDA,
per prompt width); the no-grad old-policy and reference passes run the most rows whose
memory (:func:`inference_bytes`) fits where the activations or the KV cache would be
(:func:`inference_rows`).
"""

from __future__ import annotations

from typing import Any

from gbmpo.config import TrainConfig
from gbmpo.train.device import (
    _BYTES,
    ONE_DEVICE_REFERENCE_BYTES,
    _kv_cache_bytes,
    estimate_memory,
)

__all__ = [
    "KNOWN_SHAPES",
    "PLAN_MARGIN",
    "activation_bytes",
    "decode_slots",
    "decode_step_bytes",
    "head_bytes",
    "inference_bytes",
    "inference_rows",
    "memory_plan",
    "merged_lora_bytes",
    "model_shape",
    "plan_line",
    "planned_micro_batch",
    "static_decode_bytes",
    "uses_static_decoder",
]

#: the architectures of the models the paper configs name, from each model's ``config.json`` on
#: the Hugging Face hub: a dry run plans their memory without downloading anything
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                            vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                            vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                          vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                          vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip


def model_shape(name: str) -> Any:
    """A ``Qwen3Config`` of the known model ``name`` (:data:`KNOWN_SHAPES`; ``Qwen/`` may be
    left out), or ``None``."""
    # deferred: transformers is heavy; gbmpo.train imports without it
    from transformers import Qwen3Config

    shape = KNOWN_SHAPES.get(name) or KNOWN_SHAPES.get(f"Qwen/{name}")
    return None if shape is None else Qwen3Config(**shape)


def _shape(model_config: Any) -> tuple[int, int, int, int, int, int]:
    """(hidden h, layers N, query width q, key width k, MLP width i, vocabulary V)."""
    cfg = getattr(model_config, "text_config", None) or model_config
    h, n = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hd = int(getattr(cfg, "head_dim", None) or h // heads)
    i = int(getattr(cfg, "intermediate_size", None) or 4 * h)
    return h, n, heads * hd, kv_heads * hd, i, int(cfg.vocab_size)


def head_bytes(model_config: Any, rows: int, completion_len: int, dtype_bytes: int, *,
               head_trained: bool = True) -> tuple[int, int]:
    r"""``(kept, transient)`` bytes of the LM head fused into the log-prob chunks
    (:func:`gbmpo.rollout.logprobs.linear_selective_log_softmax`) for ``rows`` sequences of
    ``completion_len`` scored tokens.

    Kept for the backward: the final hidden states and one float32 log-sum-exp per token,
    :math:`rC(bh + 4)`. Transient, while one chunk of :math:`c` rows
    (:func:`~gbmpo.rollout.logprobs.fused_chunk_rows`) is computed: its float32 logits and one
    float32 temporary as large (the log-sum-exp's shifted exponentials in the forward; the
    16-bit product before its cast, or the 16-bit gradient, are smaller), :math:`8cV`, plus the
    head weight's float32 gradient accumulator :math:`4Vh` when the head is trained (full
    fine-tuning; not with LoRA)."""
    # deferred: gbmpo.rollout imports the decoders; the plan's import stays light
    from gbmpo.rollout.logprobs import fused_chunk_rows

    h, _, _, _, _, vocab = _shape(model_config)
    tokens = rows * completion_len
    chunk = min(tokens, fused_chunk_rows(vocab))
    kept = tokens * (dtype_bytes * h + 4)
    return kept, 8 * chunk * vocab + (4 * vocab * h if head_trained else 0)


def activation_bytes(model_config: Any, rows: int, seq_len: int, completion_len: int,
                     dtype_bytes: int, *, checkpointing: bool = False,
                     fused_head: bool = False, head_trained: bool = True) -> int:  # fmt: skip
    r"""Bytes a decoder's training forward keeps for the backward, for ``rows`` sequences of
    ``seq_len`` tokens of which the last ``completion_len`` are scored:

    .. math:: A = r\,L\,N\,b\,(4h + 3q + 5k + 4i) + r\,C\,V\,(b + 8)

    per token and layer, what autograd saves in a pre-norm attention + SwiGLU block (Korthikanti
    et al., arXiv 2205.05198, Sec. 4.1, for a gated MLP, grouped-query attention and a fused
    attention kernel): RMSNorm inputs and outputs 4h, queries before and after norm and rotary
    plus the attention output 3q, keys likewise and values 5k, gate, up, SiLU and product 4i,
    each of ``dtype_bytes`` b; then the scored logits (b), their float32 log-softmax and its
    gradient (8). ``checkpointing`` keeps each layer's input (rLNbh) plus one layer's set; with
    ``fused_head`` the logits term is :func:`head_bytes`'s (``head_trained``: the head's weight)."""
    h, n, q, k, i, vocab = _shape(model_config)
    per_token = dtype_bytes * (4 * h + 3 * q + 5 * k + 4 * i)
    if fused_head:
        logits = sum(head_bytes(model_config, rows, completion_len, dtype_bytes,
                                head_trained=head_trained))
    else:
        logits = rows * completion_len * vocab * (dtype_bytes + 8)
    if checkpointing:
        return rows * seq_len * (n * dtype_bytes * h + per_token) + logits
    return rows * seq_len * n * per_token + logits


def inference_bytes(model_config: Any, rows: int, seq_len: int, completion_len: int,
                    dtype_bytes: int) -> int:
    r"""Bytes of a no-grad log-prob pass (old policy, reference) over ``rows`` sequences of
    ``seq_len`` tokens: nothing is kept for a backward, so at most one layer's tensors
    :math:`rLb(4h + 3q + 5k + 4i)` and the residual stream :math:`rLbh` are alive at a time,
    plus the fused head's chunk (:func:`head_bytes`, no weight gradient)."""
    h, _, q, k, i, _ = _shape(model_config)
    layer = rows * seq_len * dtype_bytes * (5 * h + 3 * q + 5 * k + 4 * i)
    return layer + sum(head_bytes(model_config, rows, completion_len, dtype_bytes,
                                  head_trained=False))


def static_decode_bytes(model_config: Any, rows: int, prompt_tokens: int, max_new_tokens: int,
                        dtype_bytes: int, *, eos_ids: int = 1) -> int:  # fmt: skip
    r"""Bytes of one slot of :class:`~gbmpo.rollout.static_decoder.StaticDecoder` (``_slot``):
    ``rows`` completions of :math:`T` = ``max_new_tokens`` after prompts in the bucket
    :math:`W` = ``width_bucket(prompt_tokens)``, :math:`S = W + T` columns, ``eos_ids`` EOS ids:

    .. math:: 2NrKSd\,b + rSb + 2(S+1)d\,b + rVb + 9r + 16 + 8e + 20Tr

    keys and values of every layer (:math:`K` key heads of :math:`d`), the additive mask, the
    rotary cos and signed sin tables, the next-token logits (all in the model's :math:`b`
    bytes), the done flags and positions, the column and step index, the EOS ids, and the
    float64 uniforms, int64 tokens and float32 log-probs of every step. The decoder keeps a
    slot per shape and sampling settings (up to ``MAX_SLOTS``) after its decode."""
    from gbmpo.rollout.static_decoder import width_bucket  # deferred: the decoders are heavy

    _, n, q, k, _, vocab = _shape(model_config)
    cfg = getattr(model_config, "text_config", None) or model_config
    head_dim = q // int(cfg.num_attention_heads)
    cols = width_bucket(prompt_tokens) + max_new_tokens
    b = dtype_bytes
    return (2 * n * rows * k * cols * b + rows * cols * b + 2 * (cols + 1) * head_dim * b
            + rows * vocab * b + 9 * rows + 16 + 8 * eos_ids + 20 * max_new_tokens * rows)


def decode_step_bytes(model_config: Any, rows: int, cols: int, dtype_bytes: int, *,
                      do_sample: bool, temperature: float = 1.0, top_k: int = 0,
                      top_p: float = 1.0, device: str = "cuda") -> int:  # fmt: skip
    r"""Peak transient bytes of one static decode step (``StaticDecoder._step``) of ``rows``
    :math:`B` over a slot of :math:`S` = ``cols`` columns: what a captured step's CUDA graph
    keeps in its private memory pool. With :math:`H` query heads, vocabulary :math:`V`:

    .. math:: M = \max\big(D,\; z + \max(BHS\,a,\; BVb)\big)

    :math:`z = 4BV`: the float32 filtered logits, alive through the forward (0 greedy, or for
    float32 logits unfiltered at temperature 1: a view). :math:`D`, the sampler's largest stage
    (``gbmpo.rollout.draw``): temperature :math:`z_0 + 4BV` (:math:`z_0` the float32 copy of
    16-bit logits), top-k :math:`z + 5BV`, top-p :math:`z + 22BV` (sorted values, int64 order,
    cumulative sum, two masks, the masked copy; on CUDA + :math:`12BV`, the radix sort's
    alternate key/value buffers), the draw :math:`z + 12BV` (float32 softmax, float64 CDF).
    Attention per layer, :math:`a = 3b + 4 + c`: scores, masked scores and the previous layer's
    probabilities (:math:`b` each), the float32 softmax (4) and :math:`c = b` for its cast back
    (CUDA) or 4 for the float32 copy of 16-bit scores the CPU softmax makes (0 for float32).
    Left out: per-row vectors of the hidden, q/k/v and MLP widths."""
    vocab = _shape(model_config)[5]
    cfg = getattr(model_config, "text_config", None) or model_config
    heads, b, bv = int(cfg.num_attention_heads), dtype_bytes, rows * vocab
    z = 0
    stages = []
    if do_sample:
        z = 4 * bv if b < 4 else 0  # logits.float(): a copy of 16-bit logits, else a view
        if temperature != 1.0:
            stages.append(z + 4 * bv)
            z = 4 * bv
        if 0 < top_k < vocab:
            stages.append(z + 5 * bv)
            z = 4 * bv
        if top_p < 1.0:
            stages.append(z + 22 * bv + (12 * bv if device == "cuda" else 0))
            z = 4 * bv
        stages.append(z + 12 * bv)
    cast = 0 if b >= 4 else (b if device == "cuda" else 4)
    attention = rows * heads * cols * (3 * b + 4 + cast)
    return max([*stages, z + max(attention, bv * b)])


def merged_lora_bytes(model_config: Any, target_modules: Any, dtype_bytes: int) -> int:
    r"""Bytes of the merged copy :math:`W + sBA` that the static decode step keeps of every
    adapted projection (``lora="merge"``, its default): for the projections named in
    ``target_modules`` among q, k, v, o (:math:`h \times q`, :math:`h \times k` twice,
    :math:`q \times h`) and gate, up, down (:math:`h \times i` each), in every layer,

    .. math:: N\,b \sum_{p \in \text{targets}} \text{in}_p\,\text{out}_p

    (the model's :math:`b` bytes; other modules are not merged)."""
    h, n, q, k, i, _ = _shape(model_config)
    sizes = {"q_proj": h * q, "k_proj": h * k, "v_proj": h * k, "o_proj": q * h,
             "gate_proj": h * i, "up_proj": h * i, "down_proj": i * h}  # fmt: skip
    return n * dtype_bytes * sum(sizes.get(name, 0) for name in set(target_modules))


def uses_static_decoder(cfg: TrainConfig) -> bool:
    """Whether the own engine's rollouts take the static decode step (``rollout.decode_step``:
    ``static``, or ``auto`` on CUDA or with LoRA; the ``gbmpo`` generator with the lean
    decoder, more than one new token), for a Llama-shaped model (others fall back)."""
    ro = cfg.rollout
    if cfg.engine != "gbmpo" or ro.generator != "gbmpo" or not ro.lean_decoder:
        return False
    if ro.max_new_tokens <= 1:
        return False
    auto = cfg.model.device.startswith("cuda") or cfg.lora.enabled
    return ro.decode_step == "static" or (ro.decode_step == "auto" and auto)


def memory_plan(cfg: TrainConfig, model_config: Any, prompt_tokens: int, *, needs_ref: bool,
                device_bytes: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Peak bytes per GPU of ``cfg`` on its engine (``cfg.engine``), by part (see the module
    docstring); ``fits`` against ``device_bytes`` (default: one 80 GiB GPU)."""
    ro, opt, run = cfg.rollout, cfg.optim, cfg.run
    engine = cfg.engine
    world = max(1, run.num_processes) * (max(1, run.num_nodes) if engine == "verl" else 1)
    parts = estimate_memory(cfg, model_config, prompt_tokens, needs_ref)
    b = _BYTES[cfg.model.dtype]
    batch = ro.prompts_per_step * ro.num_generations
    mini = opt.mini_batch_size or batch
    micro = opt.micro_batch_size or mini
    length = prompt_tokens + ro.max_new_tokens
    notes: list[str] = []
    if engine != "gbmpo" and not cfg.lora.enabled and b < 4:
        # full fine-tuning on TRL and verl: float32 weights (the optimizer's) under bf16
        # autocast / FSDP mixed precision, float32 gradients, no separate master copy
        total = parts["parameters"]
        parts["weights"] = total * 4
        parts["gradients"] = total * 4
        parts["optimizer"] = total * 8
        parts["reference"] = total * 4 if parts["reference"] else 0
    if engine == "trl":  # one replica per process (DDP)
        micro = max(1, micro // world) if opt.micro_batch_size is None else micro
        rows = max(1, batch // world)
        parts["kv_cache"] = _kv_cache_bytes(model_config, rows, length, b)
    elif engine == "verl":
        shard = ("weights", "gradients", "optimizer", "reference")
        for name in shard:  # FSDP: each GPU holds 1/world of the parameters and their state
            parts[name] = (parts[name] or 0) // world
        micro = opt.micro_batch_size or 0
        parts["kv_cache"] = None
    reserve = 0
    capacity = device_bytes or ONE_DEVICE_REFERENCE_BYTES
    vllm = engine == "verl" or (engine == "trl" and ro.generator == "vllm"
                                and ro.vllm_mode == "colocate")  # fmt: skip
    if vllm:
        util = ro.vllm_gpu_memory_utilization if engine == "trl" else _verl_gpu_util()
        reserve = int(util * capacity)
        parts["kv_cache"] = None
    state = _decode_state(cfg, model_config, prompt_tokens, b) if engine == "gbmpo" else None
    if state is not None and "rollout" in state["prefill"]:
        parts["kv_cache"] = state["prefill"]["rollout"]  # the static step's KV cache is its slot's
    static = sum(int(parts[k] or 0) for k in ("weights", "reference", "gradients", "optimizer"))
    kv = int(parts["kv_cache"] or 0)

    def kept(mode: str | None) -> int:  # what the static decoder holds through the update
        if state is None or mode != "keep":
            return 0
        return state["held"] + state["held_pool"] + state["merged"]

    def generation(mode: str | None) -> int:  # a generation phase's bytes besides the kept ones
        if state is None:
            return kv
        if mode != "release":
            return max([kv, *state["prefill"].values()])
        return max([kv, *(state["phase_slots"][p] + state["phase_pool"][p] + state["merged"]
                          + state["prefill"][p] for p in state["phase_slots"])])  # fmt: skip

    def activations(rows: int) -> int:
        # TRL's GRPOConfig and verl checkpoint the gradient by default; the own engine does not,
        # and applies the LM head chunk by chunk (gbmpo.rollout.logprobs)
        return activation_bytes(model_config, rows, length, ro.max_new_tokens, b,
                                checkpointing=engine != "gbmpo", fused_head=engine == "gbmpo",
                                head_trained=not cfg.lora.enabled)  # fmt: skip

    def peak_of(act: int, mode: str | None = None) -> int:
        if vllm:
            return static + reserve + act
        return static + kept(mode) + max(act, generation(mode))

    planned, mode = False, None
    if state is not None and state["phase_slots"]:
        mode = ro.decode_buffers
        if mode == "auto":
            mode = _decode_buffers_choice(cfg, mini, micro, capacity, device_bytes, activations,
                                          peak_of)  # fmt: skip
    if engine == "verl" and not micro:
        # use_dynamic_bsz: micro-batches packed to ppo_max_token_len_per_gpu tokens, padding
        # removed, logits of every token; gradient checkpointing (verl's default)
        tokens = min(VERL_MAX_TOKENS_PER_GPU, max(1, mini // world) * length)
        act = activation_bytes(model_config, 1, tokens, tokens, b, checkpointing=True)
        micro, length = 1, tokens
    else:
        if engine == "gbmpo" and opt.micro_batch_size is None and device_bytes is not None:
            micro = planned_micro_batch(mini, lambda m: peak_of(activations(m), mode),
                                        device_bytes)  # fmt: skip
            planned = True
        act = activations(micro)
    peak = peak_of(act, mode)
    inference = None
    if engine == "gbmpo":  # neither the update nor a generation runs beside these passes
        inference = inference_rows(batch, max(act, generation(mode)), lambda r: inference_bytes(
            model_config, r, length, ro.max_new_tokens, b))
    return {
        "engine": engine,
        "devices": world,
        "micro_batch_rows": micro,
        "micro_batch_planned": planned,
        "inference_rows": inference,
        "sequence_tokens": length,
        "weights": parts["weights"],
        "gradients": parts["gradients"],
        "optimizer": parts["optimizer"],
        "reference": parts["reference"],
        "activations": act,
        "kv_cache": parts["kv_cache"],
        "decode_buffers": _decode_part(state, mode, "held", "phase_slots"),
        "decode_pool": _decode_part(state, mode, "held_pool", "phase_pool"),
        "merged_weights": (state or {}).get("merged") or None,
        "decode_buffers_mode": mode,
        "vllm_reserve": reserve or None,
        "peak": peak,
        "device_bytes": device_bytes,
        "fits": peak <= capacity,
        "notes": notes,
    }


def decode_slots(cfg: TrainConfig, prompt_tokens: int) -> dict[str, tuple[set[Any], int]]:
    """The static decoder's slot keys ``(rows, bucket, steps, sampling)`` that the rollouts and
    the evaluations during training can allocate, by phase (``"rollout"``, ``"eval"``), each
    with the most slots one call of it can hold at once (its prompt chunks, ``MAX_SLOTS`` at
    most). One decoder serves both (:meth:`~gbmpo.rollout.static_decoder.StaticDecoder.for_model`)
    and keys a slot by rows, prompt bucket (a chunk of shorter prompts takes a smaller one,
    down to 64), new tokens and sampling settings: a full chunk and the last, smaller one have
    other rows, so an evaluation (``eval.batch_size`` problems a chunk, up to ``eval.limit`` or
    ``eval.auto_limit``, greedy) can hold up to ``MAX_SLOTS``. Where the limit is unknown, its
    last chunk is counted at ``batch_size - 1`` problems (the most it can have)."""
    # deferred: gbmpo.rollout imports the decoders; the plan's import stays light
    from gbmpo.rollout.static_decoder import MAX_SLOTS, MIN_BUCKET, width_bucket

    ro, ev = cfg.rollout, cfg.eval
    buckets, top = [MIN_BUCKET], width_bucket(prompt_tokens)
    while buckets[-1] < top:
        buckets.append(2 * buckets[-1])

    def keys(per_chunk: int, total: int | None, exact: bool, repeats: int, steps: int,
             sampling: tuple[Any, ...]) -> tuple[set[Any], int]:  # fmt: skip
        rows = {min(per_chunk, total or per_chunk) * repeats}
        last = total % per_chunk if exact and total is not None else per_chunk - 1
        if last and (total is None or total > per_chunk):
            rows.add(last * repeats)
        calls = MAX_SLOTS if total is None else -(-total // per_chunk)
        found = {(r, w, steps, sampling) for r in rows for w in buckets}
        return found, min(MAX_SLOTS, calls, len(found))

    slots: dict[str, tuple[set[Any], int]] = {}
    if uses_static_decoder(cfg):
        sampling = (True, ro.temperature, ro.top_k, ro.top_p)
        slots["rollout"] = keys(ro.batch_size or ro.prompts_per_step, ro.prompts_per_step,
                                True, ro.num_generations, ro.max_new_tokens, sampling)  # fmt: skip
    eval_static = (ro.generator == "gbmpo" and ev.max_new_tokens > 1
                   and (cfg.model.device.startswith("cuda") or cfg.lora.enabled))  # fmt: skip
    if eval_static and (ev.before or ev.every > 0):
        # gbmpo.train.Trainer.evaluate: greedy, or the rollouts' temperature and top-p
        sampling = (False, 1.0, 0, 1.0) if ev.samples == 1 else (True, ro.temperature, 0,
                                                                  ro.top_p)  # fmt: skip
        slots["eval"] = keys(ev.batch_size, ev.limit or ev.auto_limit, ev.limit is not None,
                             ev.samples, ev.max_new_tokens, sampling)  # fmt: skip
    return slots


def _decode_buffers_choice(cfg: TrainConfig, mini: int, micro: int, capacity: int,
                           device_bytes: int | None, activations: Any, peak_of: Any) -> str:
    """``rollout.decode_buffers: auto``: ``keep`` when the plan with the decoder's state kept
    fits ``(1 - PLAN_MARGIN)`` of the device at the micro-batch that releasing it would get
    (so keeping costs no smaller micro-batch), else ``release``; ``keep`` on a device the plan
    has no size of that is not CUDA (the CPU: no graphs, its memory is the machine's)."""
    if device_bytes is None and not cfg.model.device.startswith("cuda"):
        return "keep"
    if cfg.optim.micro_batch_size is None and device_bytes is not None:
        micro = planned_micro_batch(mini, lambda m: peak_of(activations(m), "release"),
                                    device_bytes)  # fmt: skip
    fits = peak_of(activations(micro), "keep") <= (1.0 - PLAN_MARGIN) * capacity
    return "keep" if fits else "release"


def _decode_part(state: dict[str, Any] | None, mode: str | None, kept: str, phases: str
                 ) -> int | None:  # fmt: skip
    """A part of the decoder's state for the plan's line: kept (``keep``), else the largest
    generation phase's."""
    if state is None or mode is None:
        return None
    return (state[kept] if mode == "keep" else max(state[phases].values(), default=0)) or None


def _decode_state(cfg: TrainConfig, model_config: Any, prompt_tokens: int, b: int
                  ) -> dict[str, Any]:  # fmt: skip
    """The own engine's static decoder memory under each ``rollout.decode_buffers`` choice:
    ``held`` (slots alive through the update with ``keep``: the ``MAX_SLOTS`` largest of
    every slot the run can key, :func:`decode_slots`) and ``held_pool`` (their graphs' pool),
    ``merged`` (LoRA), and per generation phase with ``release``: the slots one call can hold
    (``phase_slots``), their pool (``phase_pool``) and the prefill's prompt keys/values."""
    from gbmpo.rollout.static_decoder import MAX_SLOTS  # deferred: the decoders are heavy

    slots = decode_slots(cfg, prompt_tokens)
    graphs = cfg.model.device.startswith("cuda")  # StaticDecoder's graphs default
    size = {key: static_decode_bytes(model_config, key[0], key[1], key[2], b)
            for found, _ in slots.values() for key in found}  # fmt: skip

    def largest(found: set[Any], n: int) -> int:
        return sum(sorted((size[k] for k in found), reverse=True)[:n])

    def pool(found: set[Any]) -> int:  # one pool per decoder, reused by each capture
        if not graphs:
            return 0
        return max((decode_step_bytes(model_config, r, w + t, b, do_sample=s[0],
                                      temperature=s[1], top_k=s[2], top_p=s[3])
                    for r, w, t, s in found), default=0)  # fmt: skip

    ro = cfg.rollout
    prompts = {"rollout": min(ro.batch_size or ro.prompts_per_step, ro.prompts_per_step),
               "eval": cfg.eval.batch_size}  # fmt: skip
    every: set[Any] = set().union(*(found for found, _ in slots.values()))
    return {
        "held": largest(every, MAX_SLOTS),
        "held_pool": pool(every),
        "merged": merged_lora_bytes(model_config, cfg.lora.target_modules, b) if (
            slots and cfg.lora.enabled) else 0,
        "phase_slots": {p: largest(found, n) for p, (found, n) in slots.items()},
        "phase_pool": {p: pool(found) for p, (found, _) in slots.items()},
        "prefill": {p: _kv_cache_bytes(model_config, prompts[p], prompt_tokens, b)
                    for p in slots},
    }  # fmt: skip


#: the share of a device's memory the plan leaves free when it chooses the micro-batch
#: (:func:`planned_micro_batch`): the CUDA context and cuBLAS workspaces (about 1 GiB) and the
#: caching allocator's fragmentation, which the plan does not count (an H200 rehearsal of
#: Qwen3-1.7B's shape peaked at 36.5 GiB against a 37.2 GiB plan: the plan's own error is a few
#: percent, the margin several times that)
PLAN_MARGIN = 0.10


def planned_micro_batch(mini: int, peak: Any, device_bytes: int,
                        margin: float = PLAN_MARGIN) -> int:
    """The largest micro-batch (a divisor of the mini-batch ``mini``, so accumulation stays
    exact) whose planned ``peak(rows)`` bytes fit in ``(1 - margin) * device_bytes``; 1 when
    none does (the plan then says it does not fit)."""
    budget = (1.0 - margin) * device_bytes
    for rows in sorted((d for d in range(1, mini + 1) if mini % d == 0), reverse=True):
        if peak(rows) <= budget:
            return rows
    return 1


def inference_rows(total: int, budget: int, need: Any) -> int:
    """Rows per no-grad log-prob pass (old policy, reference): the most, up to ``total``, whose
    ``need(rows)`` bytes (:func:`inference_bytes`) fit in ``budget``, the bytes the plan gives
    the larger of the training micro-batch's activations and the KV cache (neither is alive
    during those passes); at least 1."""
    lo, hi = 1, max(1, total)
    while lo < hi:  # need() grows with rows: the largest fitting one by bisection
        mid = (lo + hi + 1) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


#: verl's ``actor.ppo_max_token_len_per_gpu`` default (verl 0.9.1 ``actor.yaml``): the tokens
#: of one packed micro-batch with ``use_dynamic_bsz``
VERL_MAX_TOKENS_PER_GPU = 16384


def _verl_gpu_util() -> float:
    """verl's ``actor_rollout_ref.rollout.gpu_memory_utilization`` default (``ppo_trainer.yaml``
    of verl 0.9.1), which gbmpo does not override."""
    return 0.5


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plan_line(plan: dict[str, Any], device: str) -> str:
    """One line: the peak per GPU, its parts (the static decoder's: kept through the update or
    released after each rollout and evaluation) and whether it fits ``device``."""
    names = ("weights", "gradients", "optimizer", "reference", "activations", "kv_cache",
             "decode_buffers", "decode_pool", "merged_weights", "vllm_reserve")  # fmt: skip
    label = {"decode_pool": "graph pool"}
    parts = ", ".join(f"{label.get(n, n.replace('_', ' '))} {_size(plan[n])}" for n in names
                      if plan.get(n))  # fmt: skip
    mode = plan.get("decode_buffers_mode")
    if mode:
        parts += ("; decoder state kept through the update" if mode == "keep" else
                  "; decoder state released after each rollout and evaluation")  # fmt: skip
    capacity = plan.get("device_bytes")
    where = (f"{device} has {_size(capacity)}" if capacity else
             f"{device} absent here: compared with one {_size(ONE_DEVICE_REFERENCE_BYTES)} GPU")
    verdict = "fits" if plan["fits"] else "does NOT fit"
    chosen = f" (planned, {PLAN_MARGIN:.0%} margin)" if plan.get("micro_batch_planned") else ""
    rows = plan.get("inference_rows")
    inference = f"; no-grad passes of {rows} rows" if rows else ""
    return (f"memory plan ({plan['engine']}, per GPU of {plan['devices']}): peak "
            f"{_size(plan['peak'])} ({parts}; micro-batch {plan['micro_batch_rows']}{chosen} x "
            f"{plan['sequence_tokens']} tokens{inference}); {verdict}: {where}")  # fmt: skip
