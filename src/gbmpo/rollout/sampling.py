r"""Sampling: gbmpo's own rollout generator and the batch it returns.

What lives here, and why it is apart from the log-probs (:mod:`gbmpo.rollout.logprobs`):
sampling runs under ``no_grad`` in eval mode, once per generation batch, and its cost is the
decode loop; the log-prob passes run with gradients, several times per batch, and their cost
is the forward and backward. The two share only the model.

* :class:`Rollout`: the batch (prompts, completions, masks, texts, lengths), with
  :meth:`Rollout.to` and :meth:`Rollout.select`.
* :func:`generate` samples ``num_return_sequences`` completions per prompt (temperature, top-p,
  top-k, at most ``max_new_tokens``, stop at EOS, prompts left-padded). Rows are ordered prompt
  by prompt: rows ``g*G .. g*G+G-1`` are the ``G`` completions of prompt ``g``, the layout
  :func:`gbmpo.objectives.group_advantages` expects. The completion mask covers every token up
  to **and including** the first EOS (:func:`completion_mask_from_ids`); a completion that
  never emits EOS is truncated and fully masked in.
* Two generators (``rollout.generator``): ``"gbmpo"`` (default) prefills each prompt once
  (:func:`_prefill`), expands its KV cache to its ``G`` rows and decodes with a plain loop
  (:func:`_decode`, sampling with :func:`filter_logits` and :func:`sample_from_logits`) whose
  forwards, for Llama-shaped models (Qwen3, Qwen2, Llama), run through
  :class:`~gbmpo.rollout.decoder.LeanDecoder` (prefill through
  :meth:`~gbmpo.rollout.lean_forward.LeanForward.prompt_cache`) or through the static-shape step
  of :class:`~gbmpo.rollout.static_decoder.StaticDecoder` (``decode_step``; a CUDA graph on a
  GPU, LoRA adapters merged; :func:`static_by_default` picks); ``"hf"`` calls transformers'
  ``generate``. Greedy decoding takes the same tokens with both.

Reproducibility: with ``generator_seed`` the sampling runs under :func:`torch.random.fork_rng`
seeded with it, so the same seed gives the same completions and the caller's global RNG state
is left untouched. Without it the global torch RNG is used (and advanced).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gbmpo.rollout.decoder import LeanDecoder, lean_decoder_unsupported_reason
from gbmpo.rollout.draw import filter_logits, sample_from_logits, sampled_logprobs
from gbmpo.rollout.lean_forward import LeanForward
from gbmpo.rollout.logprobs import _accepts_logits_to_keep
from gbmpo.rollout.static_decoder import StaticDecoder

__all__ = [
    "DECODE_BUFFERS",
    "DECODE_STEPS",
    "GENERATORS",
    "Rollout",
    "completion_mask_from_ids",
    "eos_token_ids",
    "filter_logits",
    "generate",
    "sampled_logprobs",
    "sample_from_logits",
]


@dataclass
class Rollout:
    """The output of :func:`generate` (``N = len(prompts) * num_return_sequences`` rows).

    ``prompt_ids``/``prompt_mask``: ``[N, P]`` left-padded prompts (each repeated per sample);
    ``completion_ids``/``completion_mask``: ``[N, C]`` completions, right-padded, mask up to and
    including the first EOS; ``texts``: decoded completions without special tokens;
    ``num_tokens``: completion lengths (``completion_mask.sum(1)``); ``truncated``: whether each
    completion hit ``max_new_tokens`` without an EOS; ``sampling_logp``: ``[N, C]`` float32
    log-probs of each completion token under the distribution the sampler drew it from
    (temperature, top-k, top-p applied; 0 on padding), when :func:`generate` was asked for them
    (``return_logprobs=True``), else ``None``.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    texts: list[str]
    num_tokens: list[int]
    truncated: list[bool] = field(default_factory=list)
    sampling_logp: Tensor | None = None

    def __len__(self) -> int:
        return int(self.completion_ids.shape[0])

    def to(self, device: torch.device | str) -> Rollout:
        """This rollout with its tensors on ``device`` (texts and lengths stay Python values)."""
        return Rollout(
            prompt_ids=self.prompt_ids.to(device),
            prompt_mask=self.prompt_mask.to(device),
            completion_ids=self.completion_ids.to(device),
            completion_mask=self.completion_mask.to(device),
            texts=self.texts,
            num_tokens=self.num_tokens,
            truncated=self.truncated,
            sampling_logp=None if self.sampling_logp is None else self.sampling_logp.to(device),
        )

    def select(self, rows: Tensor | Sequence[int] | slice, *,
               index: Tensor | None = None) -> Rollout:
        """A new :class:`Rollout` holding only ``rows`` (index tensor, list or slice);
        ``index``: the same rows as a long tensor already on the rollout's device (then nothing
        is copied to the device here)."""
        if isinstance(rows, slice):
            idx = list(range(len(self)))[rows]
        elif isinstance(rows, Tensor):
            idx = [int(i) for i in rows.tolist()]
        else:
            idx = [int(i) for i in rows]
        if index is None:
            index = torch.tensor(idx, dtype=torch.long, device=self.completion_ids.device)
        return Rollout(
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            completion_ids=self.completion_ids[index],
            completion_mask=self.completion_mask[index],
            texts=[self.texts[i] for i in idx],
            num_tokens=[self.num_tokens[i] for i in idx],
            truncated=[self.truncated[i] for i in idx] if self.truncated else [],
            sampling_logp=None if self.sampling_logp is None else self.sampling_logp[index],
        )


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the generation config's EOS ids."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        candidates.append(getattr(gen_cfg, "eos_token_id", None))
    for c in candidates:
        if c is None:
            continue
        for i in c if isinstance(c, Iterable) else [c]:
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation config defines an EOS")
    return ids


def completion_mask_from_ids(completion_ids: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """``[N, C]`` long mask: 1 up to and including the first EOS of each row, 0 after it.

    A row without EOS is all ones (a truncated completion). Equation:
    :math:`m_t = \\mathbb 1[t \\le t^*]`, with :math:`t^*` the first EOS position (``C - 1`` if
    there is none).
    """
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completion_ids == e
    n, c = completion_ids.shape
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full((n,), c - 1))
    positions = torch.arange(c).unsqueeze(0).expand(n, c)
    return (positions <= first.unsqueeze(1)).long()


def _check_sampling(
    num_return_sequences: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int
) -> None:
    if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
        raise ValueError(
            f"num_return_sequences must be a positive int, got {num_return_sequences!r}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")


#: the rollout generators (samplers) of :func:`generate`: ``rollout.generator``'s values on
#: the own engine
GENERATORS = ("gbmpo", "hf")
#: the decode steps of the ``"gbmpo"`` generator (``rollout.decode_step``): ``static``
#: (:class:`~gbmpo.rollout.static_decoder.StaticDecoder`, a CUDA graph on a GPU), ``lean``
#: (:class:`~gbmpo.rollout.decoder.LeanDecoder`), ``auto`` (:func:`static_by_default`)
DECODE_STEPS = ("auto", "static", "lean")
#: what the trainer does with the static decode step's buffers between rollouts
#: (``rollout.decode_buffers``): ``keep``, ``release``
#: (:meth:`~gbmpo.rollout.static_decoder.StaticDecoder.release`), ``auto`` (the memory plan's
#: choice, :func:`gbmpo.train.memory.memory_plan`)
DECODE_BUFFERS = ("auto", "keep", "release")


def static_by_default(model: Any) -> bool:
    """Whether ``decode_step: auto`` takes the static step for ``model``: on CUDA (the step is
    replayed as a CUDA graph, no host work per token), and on the CPU for a model the lean
    decoder does not run (LoRA adapters: the static step merges them, which beats the
    model's own peft forward there); on the CPU the lean decoder is faster for plain models
    (``benchmarks/decode_step.py`` runs both; ``benchmarks/RESULTS.md``)."""
    device = next(model.parameters()).device
    return device.type == "cuda" or lean_decoder_unsupported_reason(model) is not None


def _prefill(model: Any, ids: Tensor, mask: Tensor, repeats: int) -> tuple[Any, Tensor]:
    """Forward the prompts once with a KV cache; return (cache, last logits), both expanded to
    ``repeats`` rows per prompt (``repeat_interleave`` order)."""
    kwargs: dict[str, Any] = {
        "attention_mask": mask,
        "position_ids": (mask.long().cumsum(-1) - 1).clamp_min(0),
        "use_cache": True,
    }
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=ids, **kwargs)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError(
            f"{type(model).__name__} returned no KV cache with use_cache=True; the 'gbmpo' "
            "rollout generator needs one (set rollout.generator: hf to use transformers' generate)"
        )
    last = out.logits[:, -1]
    if repeats > 1:
        if hasattr(cache, "batch_repeat_interleave"):
            cache.batch_repeat_interleave(repeats)
            last = last.repeat_interleave(repeats, dim=0)
        else:  # a cache that cannot be expanded: prefill every row
            return _prefill(
                model, ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0), 1
            )
    return cache, last


def _decode(
    model: Any,
    ids: Tensor,
    mask: Tensor,
    *,
    repeats: int,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    eos_ids: Sequence[int],
    pad_id: int,
    lean: bool = True,
    decode_step: str = "auto",
    logprobs: list[Tensor] | None = None,
) -> Tensor:
    """The 'gbmpo' generator: prefill each prompt once, expand its KV cache to its ``repeats``
    rows, then decode one token per row per forward until every row has emitted an EOS or
    ``max_new_tokens`` tokens (finished rows filled with ``pad_id``); the ``[rows, steps]``
    completion ids. With ``lean`` the prefill
    (:meth:`~gbmpo.rollout.lean_forward.LeanForward.prompt_cache`) and the decode forwards
    (:class:`~gbmpo.rollout.decoder.LeanDecoder`) run lean where supported, the keys and values
    copied straight into the decoder's buffers. ``logprobs`` receives, per step, the ``[rows]``
    log-prob of the drawn token (:func:`sampled_logprobs`; 0 for finished rows). The uniform
    numbers are drawn up front (``[steps, rows]``; on the CPU the same as one draw per step), so
    that ``decode_step`` ``static`` (:func:`_decode_static`) and ``lean`` draw the same tokens."""
    rows = ids.shape[0] * repeats
    uniforms = (torch.rand(max_new_tokens, rows, dtype=torch.float64, device=ids.device)
                if do_sample else None)  # fmt: skip
    static = None
    if lean and max_new_tokens > 1 and (
        decode_step == "static" or (decode_step == "auto" and static_by_default(model))
    ):
        static = StaticDecoder.for_model(model)
    if static is not None:
        return _decode_static(static, model, ids, mask, repeats=repeats,
                              max_new_tokens=max_new_tokens, do_sample=do_sample,
                              temperature=temperature, top_p=top_p, top_k=top_k,
                              eos_ids=eos_ids, pad_id=pad_id, uniforms=uniforms,
                              logprobs=logprobs)  # fmt: skip
    decoder = LeanDecoder.for_model(model) if lean and max_new_tokens > 1 else None
    prefill = LeanForward.for_model(model) if decoder is not None else None
    att = mask.repeat_interleave(repeats, dim=0)
    position = att.sum(dim=-1, keepdim=True)
    cache: Any = None
    if decoder is not None and prefill is not None:
        # the prompts' keys/values go straight into the decoder's buffers, G rows per prompt
        logits, keys_values = prefill.prompt_cache(ids, mask)
        logits = logits.repeat_interleave(repeats, dim=0) if repeats > 1 else logits
        decoder.start_repeated(keys_values, mask, repeats, max_new_tokens - 1)
    else:
        cache, logits = _prefill(model, ids, mask, repeats)
        if decoder is not None:
            decoder.start(cache, att, max_new_tokens - 1)
            cache = None
    eos = torch.tensor(list(eos_ids), device=ids.device)
    done = torch.zeros(att.shape[0], dtype=torch.bool, device=ids.device)
    tokens: list[Tensor] = []
    for t in range(max_new_tokens):
        if do_sample:
            z = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
            assert uniforms is not None
            tok = sample_from_logits(z, uniforms[t])
            if logprobs is not None:
                logprobs.append(sampled_logprobs(z, tok).masked_fill(done, 0.0))
        else:
            tok = logits.argmax(dim=-1)
        tok = tok.masked_fill(done, pad_id)
        tokens.append(tok)
        done |= torch.isin(tok, eos)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        if decoder is not None:
            logits = decoder.step(tok, position[:, 0])
            position = position + 1
            continue
        att = torch.cat([att, att.new_ones(att.shape[0], 1)], dim=1)
        out = model(
            input_ids=tok.unsqueeze(1),
            attention_mask=att,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1]
        position = position + 1
    return torch.stack(tokens, dim=1)


def _decode_static(static: StaticDecoder, model: Any, ids: Tensor, mask: Tensor, *,
                   repeats: int, max_new_tokens: int, do_sample: bool, temperature: float,
                   top_p: float, top_k: int, eos_ids: Sequence[int], pad_id: int,
                   uniforms: Tensor | None, logprobs: list[Tensor] | None) -> Tensor:  # fmt: skip
    """:func:`_decode` with the static-shape step: the prompts prefilled once each (through
    :meth:`~gbmpo.rollout.lean_forward.LeanForward.prompt_cache` where it runs the model, else
    the model's own forward, e.g. peft's with LoRA), then
    :meth:`~gbmpo.rollout.static_decoder.StaticDecoder.run`."""
    prefill = LeanForward.for_model(model)
    if prefill is not None:
        logits, keys_values = prefill.prompt_cache(ids, mask)
    else:
        cache, logits = _prefill(model, ids, mask, 1)
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise RuntimeError("the prefill cache has no per-layer keys/values for the static "
                               "decode step (set rollout.decode_step: lean)")  # fmt: skip
        keys_values = [(layer.keys, layer.values) for layer in layers]
    tokens, logp = static.run(keys_values, mask, logits, repeats=repeats,
                              max_new_tokens=max_new_tokens, do_sample=do_sample,
                              temperature=temperature, top_k=top_k, top_p=top_p,
                              eos_ids=eos_ids, pad_id=pad_id, uniforms=uniforms)  # fmt: skip
    if logprobs is not None and logp is not None:
        logprobs.extend(logp.unbind(1))
    return tokens


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    num_return_sequences: int = 1,
    max_new_tokens: int = 256,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator_seed: int | None = None,
    batch_size: int | None = None,
    generator: str = "gbmpo",
    lean_decoder: bool = True,
    return_logprobs: bool = False,
    decode_step: str = "auto",
) -> Rollout:
    """Sample (or, with ``do_sample=False``, greedily decode) completions of ``prompts``.

    Args:
        model, tokenizer: a causal LM (eval mode for the call) and its tokenizer (left padding).
        prompts: already-templated prompt texts (at least one).
        num_return_sequences: completions per prompt ``G``; output rows are grouped by prompt.
        max_new_tokens: completion budget ``L_max``.
        do_sample: sample from ``softmax(z / temperature)`` restricted by ``top_k`` (0 = off) and
            ``top_p`` (1 = off); ``False`` is greedy decoding (sampling knobs ignored).
        generator_seed: seed for the sampling RNG (under ``fork_rng``). The same seed and
            ``batch_size`` give the same samples.
        batch_size: prompts per forward batch (``None``: all at once).
        generator: ``"gbmpo"``: one prefill per prompt, its KV cache expanded to ``G`` rows,
            then :func:`filter_logits` and :func:`sample_from_logits`; ``"hf"``: transformers'
            ``generate``. Same distribution, different samples for one seed.
        lean_decoder: ``"gbmpo"`` only: decode through :class:`~gbmpo.rollout.decoder.LeanDecoder`
            where it supports the model (the same logits); ``False``: the model's own forward.
        decode_step: with ``lean_decoder``, :data:`DECODE_STEPS`: ``"static"``
            (:class:`~gbmpo.rollout.static_decoder.StaticDecoder`: a CUDA graph, LoRA merged),
            ``"lean"`` or ``"auto"`` (:func:`static_by_default`); the same tokens per seed.
        return_logprobs: also the sampler's log-prob of every completion token
            (:attr:`Rollout.sampling_logp`); needs ``do_sample``.

    Returns:
        a :class:`Rollout` with its tensors on the CPU, padded to common widths across chunks.
    """
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("generate needs a non-empty list of prompt strings")
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("every prompt must be a str")
    _check_sampling(num_return_sequences, max_new_tokens, temperature, top_p, top_k)
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    if decode_step not in DECODE_STEPS:
        raise ValueError(
            f"unknown decode step {decode_step!r}; valid decode steps: {', '.join(DECODE_STEPS)}"
        )
    if generator not in GENERATORS:
        raise ValueError(
            f"unknown rollout generator {generator!r}; valid generators: {', '.join(GENERATORS)}"
        )
    if return_logprobs and not do_sample:
        raise ValueError("return_logprobs needs do_sample=True (greedy decoding has no sampler "
                         "distribution to score)")  # fmt: skip
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to EOS)")
    device = next(model.parameters()).device

    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = old_side
    prompt_ids: Tensor = enc["input_ids"]
    prompt_mask: Tensor = enc["attention_mask"]

    gen_kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "num_return_sequences": num_return_sequences,
        "do_sample": do_sample,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "use_cache": True,
    }
    if do_sample:
        # explicit values so that a model's own generation defaults (e.g. top_k=20) do not leak in
        gen_kwargs.update(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            repetition_penalty=1.0,
        )
    chunk = batch_size or len(prompts)
    was_training = model.training
    model.eval()
    pieces: list[Tensor] = []
    logp_pieces: list[Tensor] = []
    if return_logprobs and generator == "hf":
        gen_kwargs.update(output_scores=True, return_dict_in_generate=True)
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            if generator_seed is not None:
                torch.manual_seed(int(generator_seed))
            for start in range(0, len(prompts), chunk):
                ids = prompt_ids[start : start + chunk].to(device)
                att = prompt_mask[start : start + chunk].to(device)
                if generator == "hf":
                    out = model.generate(input_ids=ids, attention_mask=att, **gen_kwargs)
                    if return_logprobs:  # scores: the processed logits of every step
                        new = out.sequences[:, ids.shape[1] :]
                        steps = [sampled_logprobs(sc, new[:, t]) for t, sc in
                                 enumerate(out.scores)]  # fmt: skip
                        logp_pieces.append(torch.stack(steps, dim=1).cpu())
                        out = out.sequences
                    pieces.append(out[:, ids.shape[1] :].cpu())
                    continue
                steps_logp: list[Tensor] | None = [] if return_logprobs else None
                # inference mode: the same kernels and values as no_grad without autograd's
                # per-op bookkeeping (version counters, view tracking), which at small sizes is
                # a visible part of a decode step; what it returns is only read below, outside
                # it, by ops that make ordinary tensors (stack, pad, cat)
                with torch.inference_mode():
                    completion = _decode(
                        model, ids, att, repeats=num_return_sequences,
                        max_new_tokens=max_new_tokens, do_sample=do_sample,
                        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                        eos_ids=eos_ids, pad_id=int(pad_id), lean=lean_decoder,
                        decode_step=decode_step, logprobs=steps_logp,
                    )
                pieces.append(completion.cpu())
                if steps_logp is not None:
                    logp_pieces.append(torch.stack(steps_logp, dim=1).cpu())
    finally:
        model.train(was_training)

    width = max(max(p.shape[1] for p in pieces), 1)
    completion_ids = torch.cat(
        [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad_id) for p in pieces]
    )
    completion_mask = completion_mask_from_ids(completion_ids, eos_ids)
    sampling_logp = None
    if return_logprobs:
        joined = torch.cat(
            [torch.nn.functional.pad(p.float(), (0, width - p.shape[1])) for p in logp_pieces]
        )  # 0 on padding (and after the first EOS, where hf scores a pad at -inf)
        sampling_logp = torch.where(completion_mask.bool(), joined, torch.zeros(()))
    # generate stops a row at its EOS or at L_max, so a chunk narrower than ``width`` only holds
    # rows that ended with EOS: the pad columns added above fall after it and are masked out.
    has_eos = torch.zeros(completion_ids.shape[0], dtype=torch.bool)
    for e in eos_ids:
        has_eos |= (completion_ids == e).any(dim=1)
    lengths = completion_mask.sum(dim=1)
    texts = tokenizer.batch_decode(
        [row[: int(n)] for row, n in zip(completion_ids, lengths, strict=True)],
        skip_special_tokens=True,
    )
    g = num_return_sequences
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(g, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(g, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        texts=list(texts),
        num_tokens=[int(n) for n in lengths],
        truncated=[not bool(h) for h in has_eos],
        sampling_logp=sampling_logp,
    )
