r"""A static-shape decode step for Llama-shaped causal LMs, LoRA included (CUDA graphs on a GPU).

:class:`~gbmpo.rollout.decoder.LeanDecoder` slices its key/value buffers by a Python column, so
every token has new shapes, and its loop reads ``done.all()`` on the host each token: on a GPU a
step is then bound by the host (kernel launches and a synchronisation per token), not by reading
the weights. :class:`StaticDecoder` does one whole decode step with shapes fixed for the whole
completion, so that it can be captured once as a CUDA graph and replayed per token:

* key/value buffers ``[rows, KV, W + T, d]`` for the prompt bucket ``W`` (:func:`width_bucket`:
  the prompt's keys are right-aligned in it, the extra columns are padding) and the ``T`` new
  tokens; the write column, the positions and the step index are device tensors that the step
  advances itself (``index_copy_``/``index_fill_`` at a tensor index);
* attention over the whole buffer under an additive ``0/-inf`` mask whose column of the new
  token is opened when it is written (an unwritten column weighs :math:`e^{-\infty}=0`; the
  buffers start at zero, so it adds exactly 0);
* the token drawn inside the step (:func:`gbmpo.rollout.draw.filter_logits`: temperature,
  top-k, top-p; :func:`~gbmpo.rollout.draw.sample_from_logits`) from uniform numbers drawn up
  front, ``[T, rows]``, the same numbers the lean loop uses, so both draw the same tokens;
* the stop test (every row has emitted an EOS) read on the host every ``check_every`` steps
  only (steps past the end only write padding, trimmed away after the loop).

The arithmetic of a step is :class:`~gbmpo.rollout.decoder.LeanDecoder`'s (the same functions in
the same order); only the attention runs over the masked full width, so the logits agree with
the lean decoder's up to float rounding of sums of different length (tested: 1e-12 in float64).

LoRA (peft ``LoraModel`` of one active plain adapter): ``lora="merge"`` (default) decodes with
a copy of each adapted weight, :math:`W + sBA` (formed in float32 at least, rounded once to the
weight's dtype, refreshed in place at each :meth:`StaticDecoder.run`: a graph stays valid);
``lora="inline"`` applies the two small products in the step as peft's forward does
(:math:`Wx + s\,B(Ax)`, in the adapters' dtype), reading no copy. In bfloat16 either mode's
log-probs are as far from the trainer's (peft's unmerged forward) as the lean decoder's are for
a plain model, several times farther than peft's own decode; merging adds little to that
(``benchmarks/rollout_mismatch.py``; ``benchmarks/RESULTS.md`` section 25).

On CUDA (``graphs=True``, the default there) the step is captured as a ``torch.cuda.CUDAGraph``
once per :class:`_Slot` (rows, prompt bucket, completion length and sampling settings) and
replayed (should a capture fail, the step runs eagerly, with a warning); slots are kept per
decoder (:data:`MAX_SLOTS`, least recently used dropped), decoders per model
(:meth:`StaticDecoder.for_model`). :meth:`StaticDecoder.release` frees them (slots, graphs,
their memory pool, the merged copies' storage) until the next :meth:`StaticDecoder.run`, for
the trainer to give their memory to the update (``rollout.decode_buffers``). Weights updated
in place (the optimizer's step, the merge refresh) keep a graph valid; when a weight tensor
is replaced (another storage), the decoder is rebuilt. Inference only: everything runs under
``torch.inference_mode``.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gbmpo.rollout.decoder import (
    _joint_qk_norm,
    _LlamaWeights,
    _norm_qk,
    _rms,
    _rotate_swap,
    _signed_sin,
    _softmax,
    lean_decoder_unsupported_reason,
)
from gbmpo.rollout.draw import filter_logits, sample_from_logits, sampled_logprobs

__all__ = [
    "LORA_MODES",
    "MAX_SLOTS",
    "StaticDecoder",
    "release_static_decoder",
    "static_decoder_unsupported_reason",
    "width_bucket",
]

#: how the static step applies LoRA adapters (see the module docstring)
LORA_MODES = ("merge", "inline")
#: captured slots (graphs and their buffers) kept per decoder; each holds its key/value buffers
#: (rows x layers x 2 x KV x (W + T) x d elements), so a run with prompts in many buckets keeps
#: only the most recent few
MAX_SLOTS = 4
#: the smallest prompt bucket (see :func:`width_bucket`)
MIN_BUCKET = 64
_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                ("mlp", "down_proj"))  # fmt: skip


def width_bucket(width: int) -> int:
    """The key/value width reserved for a prompt of ``width`` tokens: the smallest
    ``64 * 2**k >= width``. A graph is captured per bucket, so a run whose prompt widths vary
    captures a few graphs (one per power of two), at the price of attending to at most twice
    the prompt's columns (masked), which is small against reading the weights."""
    if width < 1:
        raise ValueError(f"a prompt needs at least one column, got width {width}")
    bucket = MIN_BUCKET
    while bucket < width:
        bucket *= 2
    return bucket


def _lora_adapter(module: Any) -> str | None:
    """The adapter a peft LoRA ``Linear`` applies in its forward now (``None``: none applies,
    its forward is its base layer's); raises ``ValueError`` for what the step does not
    reproduce."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return None
    if len(active) > 1:
        raise ValueError("more than one active LoRA adapter")
    name = active[0]
    if getattr(module, "lora_variant", {}).get(name) is not None:
        raise ValueError("a LoRA variant (e.g. DoRA)")
    if getattr(module, "lora_bias", {}).get(name, False):
        raise ValueError("a LoRA bias")
    if getattr(module, "fan_in_fan_out", False):
        raise ValueError("fan_in_fan_out LoRA weights")
    if type(module.lora_A[name]) is not nn.Linear or type(module.lora_B[name]) is not nn.Linear:
        raise ValueError("LoRA factors that are not plain nn.Linear")
    return name


def _is_lora_linear(module: Any) -> bool:
    return (type(module).__module__.startswith("peft.")
            and type(getattr(module, "base_layer", None)) is nn.Linear
            and hasattr(module, "lora_A") and hasattr(module, "active_adapters"))  # fmt: skip


def _linear_ok(module: Any) -> bool:
    return type(module) is nn.Linear or _is_lora_linear(module)


def _unwrap(model: Any) -> Any:
    """The transformers model inside a peft ``PeftModel`` (or ``model`` itself)."""
    if type(model).__module__.startswith("peft.") and callable(
        getattr(model, "get_base_model", None)
    ):
        return model.get_base_model()
    return model


def static_decoder_unsupported_reason(model: Any) -> str | None:
    """Why :class:`StaticDecoder` cannot run ``model`` (a transformers model or a peft model
    around one), or ``None`` when it can: what
    :func:`~gbmpo.rollout.decoder.lean_decoder_unsupported_reason` refuses, except that peft
    LoRA layers of one active plain adapter may stand for a projection."""
    inner = _unwrap(model)
    reason = lean_decoder_unsupported_reason(inner, linear_ok=_linear_ok)
    if reason is not None:
        return reason
    for i, layer in enumerate(inner.model.layers):
        for part, name in _PROJECTIONS:
            module = getattr(getattr(layer, part), name)
            if _is_lora_linear(module):
                try:
                    _lora_adapter(module)
                except ValueError as err:
                    return f"layer {i} {name}: {err}"
    return None


@dataclass
class _Proj:
    """One projection of the step: :math:`Wx+b`, plus :math:`s\\,B(Ax)` for an inline LoRA
    adapter (computed in the adapters' dtype and cast back, as peft's ``Linear.forward``)."""

    weight: Tensor
    bias: Tensor | None = None
    lora_a: Tensor | None = None
    lora_b: Tensor | None = None
    scale: float = 1.0

    def __call__(self, h: Tensor) -> Tensor:
        y = F.linear(h, self.weight, self.bias)
        if self.lora_a is None or self.lora_b is None:
            return y
        delta = F.linear(F.linear(h.to(self.lora_a.dtype), self.lora_a), self.lora_b)
        return (y + delta * self.scale).to(y.dtype)


@dataclass
class _Merge:
    """A merged weight: ``out`` holds :math:`W + sBA` of the current ``base``, ``a``, ``b``."""

    out: Tensor
    base: Tensor
    a: Tensor
    b: Tensor
    scale: float

    def refresh(self) -> None:
        """:math:`W + sBA` in float32 (float64 for float64 weights), rounded once to ``out``."""
        dtype = torch.promote_types(self.base.dtype, torch.float32)
        merged = torch.addmm(self.base.to(dtype), self.b.to(dtype), self.a.to(dtype),
                             alpha=self.scale)  # fmt: skip
        self.out.copy_(merged)


@dataclass(frozen=True)
class _Settings:
    """What a captured step depends on besides the weights: the sampling settings."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos: tuple[int, ...]
    pad_id: int


@dataclass
class _Slot:
    """The state of one static decode: buffers of fixed shape, advanced by the step itself."""

    rows: int
    bucket: int
    steps: int
    settings: _Settings
    keys: list[Tensor]
    values: list[Tensor]
    mask: Tensor  # [rows, 1, 1, W + T] additive 0/-inf
    cos: Tensor  # [W + T + 1, d]
    sin: Tensor  # signed sin (decoder._signed_sin)
    logits: Tensor  # [rows, V] next-token logits
    done: Tensor  # [rows] bool
    positions: Tensor  # [rows] rotary position of the next token fed
    col: Tensor  # [1] the buffer column the next token's key/value go to
    t: Tensor  # [1] the step index (column of tokens/logp, row of uniforms)
    uniforms: Tensor  # [T, rows] float64
    tokens: Tensor  # [rows, T]
    logp: Tensor  # [rows, T] float32
    eos: Tensor  # [n_eos]
    graph: Any = None


class StaticDecoder(_LlamaWeights):
    """A static-shape decode step over ``model``'s weights (see the module docstring).

    Get one with :meth:`for_model` (cached per model), prefill the prompts elsewhere, then
    :meth:`run`."""

    def __init__(self, model: Any, *, lora: str = "merge", graphs: bool | None = None,
                 check_every: int | None = None) -> None:  # fmt: skip
        if lora not in LORA_MODES:
            raise ValueError(f"unknown lora mode {lora!r}; valid: {', '.join(LORA_MODES)}")
        reason = static_decoder_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"StaticDecoder cannot run this model: {reason}")
        inner = _unwrap(model)
        super().__init__(inner)
        self.device = self.embed.device
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}")
        if check_every is None:  # a host read is free on the CPU, a sync on a GPU
            check_every = 1 if self.device.type == "cpu" else 16
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
        self.check_every = check_every
        self.lora = lora
        self._merges: list[_Merge] = []
        self.projs: list[dict[str, _Proj]] = []
        for layer in inner.model.layers:
            projs = {}
            for part, name in _PROJECTIONS:
                projs[name.removesuffix("_proj")] = self._proj(getattr(getattr(layer, part), name))
            self.projs.append(projs)
        self._qk_norms: list[tuple[Tensor, float] | None] = []
        self._slots: OrderedDict[tuple[Any, ...], _Slot] = OrderedDict()
        self._pool: Any = None
        self.signature = _signature(model)

    def _proj(self, module: Any) -> _Proj:
        if type(module) is nn.Linear:
            return _Proj(module.weight, module.bias)
        base, adapter = module.base_layer, _lora_adapter(module)
        if adapter is None:
            return _Proj(base.weight, base.bias)
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        scale = float(module.scaling[adapter])
        if self.lora == "inline":
            return _Proj(base.weight, base.bias, a, b, scale)
        merge = _Merge(torch.zeros_like(base.weight, memory_format=torch.contiguous_format),
                       base.weight, a, b, scale)  # fmt: skip
        self._merges.append(merge)
        return _Proj(merge.out, base.bias)

    # ------------------------------------------------------------------ cache per model

    @classmethod
    def for_model(cls, model: Any, **options: Any) -> StaticDecoder | None:
        """The decoder of ``model`` (built once and kept while the model lives; rebuilt when a
        weight tensor or an adapter's state changed, or when ``options`` (of
        :class:`StaticDecoder`) are given and differ from the kept one's; without options the
        kept one is taken whatever it was built with), or ``None`` when
        :func:`static_decoder_unsupported_reason` refuses it."""
        if static_decoder_unsupported_reason(model) is not None:
            return None
        key = tuple(sorted(options.items()))
        cached = _DECODERS.get(model)
        if (cached is not None and (not options or cached[0] == key)
                and cached[1].signature == _signature(model)):  # fmt: skip
            return cached[1]
        key = key if options or cached is None else cached[0]  # a rebuild keeps the options
        options = dict(key)
        with torch.inference_mode():
            decoder = cls(model, **options)
        _DECODERS[model] = (key, decoder)
        return decoder

    def release(self) -> None:
        """Free what the decoder keeps between decodes: every slot (its buffers and captured
        graph), the graphs' memory pool and the storage of the merged LoRA copies. The next
        :meth:`run` allocates them again (and captures again on CUDA): the same tokens."""
        self._slots.clear()
        self._pool = None
        for merge in self._merges:  # the tensor stays (the step's projections read it)
            merge.out.untyped_storage().resize_(0)

    def _reallocate(self) -> None:
        """Give the merged copies their storage back after :meth:`release` (filled by the
        refresh that follows)."""
        for merge in self._merges:
            out = merge.out
            if out.untyped_storage().nbytes() == 0 and out.numel():
                out.untyped_storage().resize_(out.numel() * out.element_size())

    # ------------------------------------------------------------------ the step

    def _forward(self, s: _Slot, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` ``[rows]`` at ``s.positions`` into column ``s.col``; return the
        next-token logits ``[rows, V]`` (LeanDecoder.step's arithmetic, attention over the
        whole masked buffer)."""
        rows = tokens.shape[0]
        h_dim, n_q, n_kv = self.head_dim, self.num_heads, self.num_kv_heads
        groups = n_q // n_kv
        cos = s.cos.index_select(0, s.positions).unsqueeze(1)  # [rows, 1, head_dim]
        sin = s.sin.index_select(0, s.positions).unsqueeze(1)
        s.mask.index_fill_(-1, s.col, 0.0)  # the new token's column is read from now on
        x = F.embedding(tokens, self.embed)
        layers = zip(self.layers, self.projs, self._qk_norms, s.keys, s.values, strict=True)
        for layer, proj, qk_norm, k_buf, v_buf in layers:
            h = _rms(x, layer.ln1, layer.ln1_eps)
            qk = torch.cat([proj["q"](h).view(rows, n_q, h_dim),
                            proj["k"](h).view(rows, n_kv, h_dim)], dim=1)  # fmt: skip
            v = proj["v"](h).view(rows, n_kv, h_dim)
            qk = _norm_qk(qk, layer, qk_norm, n_q)
            qk = _rotate_swap(qk, cos, sin)
            k_buf.index_copy_(2, s.col, qk[:, n_q:].unsqueeze(2))
            v_buf.index_copy_(2, s.col, v.unsqueeze(2))
            q = qk[:, :n_q].view(rows, n_kv, groups, h_dim)
            scores = torch.matmul(q, k_buf.transpose(-1, -2))  # [rows, KV, groups, W + T]
            probs = _softmax(torch.add(s.mask, scores, alpha=self.scale))
            out = torch.matmul(probs, v_buf)
            x = x + proj["o"](out.reshape(rows, n_q * h_dim))
            h = _rms(x, layer.ln2, layer.ln2_eps)
            x = x + proj["down"](layer.act(proj["gate"](h)) * proj["up"](h))
        return F.linear(_rms(x, *self.final_norm), *self.lm_head)

    def _step(self, s: _Slot) -> None:
        """Draw token ``t`` from ``s.logits``, record it, then feed it: one decode step with
        no host read (what a CUDA graph captures)."""
        cfg = s.settings
        if cfg.do_sample:
            z = filter_logits(s.logits, temperature=cfg.temperature, top_k=cfg.top_k,
                              top_p=cfg.top_p)  # fmt: skip
            tok = sample_from_logits(z, s.uniforms.index_select(0, s.t)[0])
            logp = sampled_logprobs(z, tok).masked_fill(s.done, 0.0)
            s.logp.index_copy_(1, s.t, logp.unsqueeze(1))
        else:
            tok = s.logits.argmax(dim=-1)
        tok = tok.masked_fill(s.done, cfg.pad_id)
        s.tokens.index_copy_(1, s.t, tok.unsqueeze(1))
        s.done.logical_or_((tok.unsqueeze(1) == s.eos).any(-1))
        s.logits.copy_(self._forward(s, tok))
        s.positions.add_(1)
        s.col.add_(1)
        s.t.add_(1)

    # ------------------------------------------------------------------ slots

    def _slot(self, rows: int, width: int, steps: int, settings: _Settings, like: Tensor) -> _Slot:
        """The slot for this shape and these settings (allocated, and captured on CUDA, on
        first use; the least recently used is dropped past :data:`MAX_SLOTS`)."""
        bucket = width_bucket(width)
        key = (rows, bucket, steps, settings)
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        while len(self._slots) >= MAX_SLOTS:
            self._slots.popitem(last=False)
        total, dev = bucket + steps, self.device
        kv_dtype = like.dtype
        shape = (rows, self.num_kv_heads, total, self.head_dim)
        positions = torch.arange(total + 1, device=dev)[None]
        cos, sin = self._rotary(torch.empty(1, dtype=kv_dtype, device=dev), positions)
        vocab = self.lm_head[0].shape[0]
        slot = _Slot(
            rows=rows, bucket=bucket, steps=steps, settings=settings,
            keys=[torch.zeros(shape, dtype=kv_dtype, device=dev) for _ in self.layers],
            values=[torch.zeros(shape, dtype=kv_dtype, device=dev) for _ in self.layers],
            mask=torch.full((rows, 1, 1, total), -math.inf, dtype=kv_dtype, device=dev),
            cos=cos[0], sin=_signed_sin(sin[0]),
            logits=torch.zeros(rows, vocab, dtype=self.lm_head[0].dtype, device=dev),
            done=torch.zeros(rows, dtype=torch.bool, device=dev),
            positions=torch.zeros(rows, dtype=torch.long, device=dev),
            col=torch.full((1,), bucket, dtype=torch.long, device=dev),
            t=torch.zeros(1, dtype=torch.long, device=dev),
            uniforms=torch.zeros(steps, rows, dtype=torch.float64, device=dev),
            tokens=torch.zeros(rows, steps, dtype=torch.long, device=dev),
            logp=torch.zeros(rows, steps, dtype=torch.float32, device=dev),
            eos=torch.tensor(settings.eos, dtype=torch.long, device=dev),
        )  # fmt: skip
        if self.graphs:
            try:
                self._capture(slot)
            except RuntimeError as err:  # an op this torch/CUDA cannot capture: run eagerly
                warnings.warn(f"StaticDecoder: CUDA graph capture failed ({err}); the static "
                              "step runs without graphs (slower)", RuntimeWarning,
                              stacklevel=2)  # fmt: skip
                self.graphs = False
                slot.graph = None
        self._slots[key] = slot
        return slot

    def _capture(self, slot: _Slot) -> None:
        """Capture one step of ``slot`` as a CUDA graph: warm-up steps on a side stream (the
        pattern of ``torch.cuda.graphs``' documentation), then the capture; the warm-up's
        writes are overwritten when a decode loads the slot."""
        self._refresh()  # the step reads the merged weights and joint norms
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(slot)
                slot.t.zero_()  # keep the step index inside the buffers
                slot.col.fill_(slot.bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(slot)
        slot.graph = graph

    def _refresh(self) -> None:
        """Re-read what the step copies from the weights: the merged LoRA weights and the joint
        q/k norms (in place where they exist, so a captured graph stays valid)."""
        self._reallocate()
        for merge in self._merges:
            merge.refresh()
        joint = [_joint_qk_norm(layer, self.num_heads, self.num_kv_heads, self.head_dim)
                 for layer in self.layers]  # fmt: skip
        if len(self._qk_norms) != len(joint):
            self._qk_norms = joint
            return
        for old, new in zip(self._qk_norms, joint, strict=True):
            if old is not None and new is not None:
                old[0].copy_(new[0])

    # ------------------------------------------------------------------ a decode

    def run(
        self,
        keys_values: Sequence[tuple[Tensor, Tensor]],
        prompt_mask: Tensor,
        logits: Tensor,
        *,
        repeats: int,
        max_new_tokens: int,
        do_sample: bool,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_ids: Sequence[int],
        pad_id: int,
        uniforms: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Decode ``max_new_tokens`` tokens for ``U * repeats`` rows from the prefill of ``U``
        prompts: per-layer rotated ``(keys, values)`` ``[U, KV, P, d]``, the prompt mask
        ``[U, P]`` (left padding) and the last position's logits ``[U, V]``; rows
        ``u*repeats .. u*repeats+repeats-1`` continue prompt ``u``. ``uniforms`` ``[T, rows]``:
        one number in [0, 1) per step and row (needed with ``do_sample``).

        Returns the tokens ``[rows, C]`` (``pad_id`` after a row's EOS; ``C`` up to the step
        where every row had emitted an EOS, at most ``max_new_tokens``) and, with
        ``do_sample``, the sampler's log-probs ``[rows, C]`` (0 after a row's EOS)."""
        n_u, width = prompt_mask.shape
        rows, steps = n_u * repeats, int(max_new_tokens)
        if do_sample and (uniforms is None or tuple(uniforms.shape) != (steps, rows)):
            raise ValueError(f"sampling needs uniforms of shape {(steps, rows)}")
        if len(keys_values) != len(self.layers):
            raise ValueError(f"{len(keys_values)} layers of keys/values for a model with "
                             f"{len(self.layers)} layers")  # fmt: skip
        settings = _Settings(bool(do_sample), float(temperature), int(top_k), float(top_p),
                             tuple(int(e) for e in eos_ids), int(pad_id))  # fmt: skip
        with torch.inference_mode():
            slot = self._slot(rows, width, steps, settings, keys_values[0][0])
            self._refresh()
            self._load(slot, keys_values, prompt_mask, logits, repeats, uniforms)
            done_steps = 0
            while done_steps < steps:
                for _ in range(min(self.check_every, steps - done_steps)):
                    if slot.graph is not None:
                        slot.graph.replay()
                    else:
                        self._step(slot)
                    done_steps += 1
                if bool(slot.done.all()):  # the one host read, every check_every steps
                    break
            tokens = slot.tokens[:, :done_steps]
            # the lean loop's width: up to the first step after which every row had ended
            ended = (tokens.unsqueeze(-1) == slot.eos).any(-1).cummax(dim=1).values.all(0)
            n = int(ended.int().argmax()) + 1 if bool(ended.any()) else done_steps
            logp = slot.logp[:, :n].clone() if do_sample else None
            return tokens[:, :n].clone(), logp

    def _load(self, s: _Slot, keys_values: Sequence[tuple[Tensor, Tensor]], prompt_mask: Tensor,
              logits: Tensor, repeats: int, uniforms: Tensor | None) -> None:  # fmt: skip
        """Write a decode's start into the slot's buffers (in place: a graph reads them)."""
        n_u, width = prompt_mask.shape
        start = s.bucket - width  # the prompt is right-aligned in its bucket
        for (keys, values), k_buf, v_buf in zip(keys_values, s.keys, s.values, strict=True):
            if keys.shape[0] != n_u or keys.shape[2] != width:
                raise ValueError(f"cache keys {tuple(keys.shape)} do not match the prompt mask "
                                 f"{tuple(prompt_mask.shape)}")  # fmt: skip
            shape = (n_u, repeats, *k_buf.shape[1:])
            k_buf.view(shape)[:, :, :, start : s.bucket] = keys.unsqueeze(1)
            v_buf.view(shape)[:, :, :, start : s.bucket] = values.unsqueeze(1)
        real = prompt_mask.bool().repeat_interleave(repeats, dim=0)
        s.mask.fill_(-math.inf)
        s.mask[:, 0, 0, start : s.bucket].masked_fill_(real, 0.0)
        s.logits.copy_(logits.repeat_interleave(repeats, dim=0) if repeats > 1 else logits)
        s.done.zero_()
        s.positions.copy_(real.sum(-1))
        s.col.fill_(s.bucket)
        s.t.zero_()
        if uniforms is not None:
            s.uniforms.copy_(uniforms)


def release_static_decoder(model: Any) -> bool:
    """:meth:`StaticDecoder.release` of the decoder kept for ``model``
    (:meth:`StaticDecoder.for_model`); ``False`` when none is kept (nothing to free)."""
    cached = _DECODERS.get(model)
    if cached is None:
        return False
    cached[1].release()
    return True


def _signature(model: Any) -> tuple[Any, ...]:
    """What a decoder built for ``model`` depends on besides weight values: the storage of
    every parameter and each LoRA layer's adapter state."""
    ptrs = tuple(p.data_ptr() for p in model.parameters())
    states = tuple((m.merged, m.disable_adapters, tuple(m.active_adapters))
                   for m in model.modules() if _is_lora_linear(m))  # fmt: skip
    return ptrs, states


#: the decoder of each live model (with the options it was built with); a model's entry goes
#: when the model does
_DECODERS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], StaticDecoder]] = (
    weakref.WeakKeyDictionary()
)
