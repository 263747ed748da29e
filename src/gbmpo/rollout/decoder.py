r"""A lean one-token decode step for Llama-shaped causal LMs (Qwen3, Qwen2, Llama).

At small model sizes a decode step is dominated by Python overhead, not arithmetic: each
transformers forward builds masks, position embeddings and cache objects and goes through
several module wrappers per layer, and the arithmetic is a small part of a call (the profile is
in ``benchmarks/RESULTS.md`` section 3).

:class:`LeanDecoder` runs the same computation on the model's own weights with plain tensor
functions, for one new token per row, against preallocated key/value buffers:

.. math::

    x \leftarrow x + W_o\,\mathrm{attn}\big(\mathrm{rope}(n_q(W_q h)),\,
        [K;\mathrm{rope}(n_k(W_k h))],\,[V; W_v h]\big),\quad h=\mathrm{rms}_1(x)

    x \leftarrow x + W_d\big(\mathrm{silu}(W_g h)\odot W_u h\big),\quad h=\mathrm{rms}_2(x)

with :math:`\mathrm{rms}(x)=w\odot x/\sqrt{\overline{x^2}+\epsilon}` (computed in float32, as
transformers does), the optional per-head ``q_norm``/``k_norm`` of Qwen3 (:math:`n_q, n_k`), the
model's own rotary table, and the logits :math:`W_{\text{lm}}\,\mathrm{rms}_f(x)`. Grouped-query
attention for a single query position needs no key repetition: the ``H`` query heads are viewed
as ``KV`` groups of ``H/KV`` queries against the group's keys.

At small sizes a decode step costs per tensor call, so the query and key heads are normalised
and rotated as one ``[rows, H+KV, d]`` tensor (the per-head norm and the rotation act per head
and per element, so this is exactly the separate computation, in half the calls).
Concatenating the q/k/v and gate/up weights into one product each was measured too and did not
help (0.2M: within noise; 9.6M: 0-8% slower decode), so the model's matrices are used as they
are. When many rows share a prompt and its keys/values are large, the prompt part of the
attention reads them once per prompt (:meth:`LeanDecoder.start_repeated`). The rotation swaps
the halves with one ``roll`` against a sin table whose first half is
negated (:func:`_rotate_swap`: the same products and sums as the rotate-half formula, so the
same bits), and the single-query attention is written out as two small products and a softmax
against an additive ``0/-inf`` mask kept in a buffer (shared by the layers): at these sizes the
call overhead of CPU's fused ``scaled_dot_product_attention`` costs more than it saves
(measured in ``benchmarks/RESULTS.md`` section 3.0.1).

:meth:`LeanDecoder.for_model` returns ``None`` (and the caller keeps transformers' forward) for
anything it does not reproduce exactly: other architectures, adapters or quantised layers in
place of plain ``nn.Linear``, sliding-window layers, biases in norms, rope types whose table
depends on the sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LEAN_MODEL_TYPES", "LeanDecoder", "lean_decoder_unsupported_reason"]

#: ``config.model_type`` values whose decoder layer is the Llama shape reproduced here
LEAN_MODEL_TYPES = ("llama", "qwen2", "qwen3")
#: rope types whose cos/sin table does not change with the sequence length
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    r"""RMSNorm :math:`w\odot x/\sqrt{\overline{x^2}+\epsilon}` over the last dim, computed in
    float32 and cast back before the weight (the Llama/Qwen convention).

    For float32 tensors this is ``F.rms_norm``: on CPU ATen composes it from the same
    operations (``pow``, ``mean``, ``add``, ``rsqrt``, two ``mul``), so the values and the
    gradient are the same bits (tested), in one Python call instead of six; in the decode step
    at 0.2M the Python side of the six calls was a third of their time."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight  # e.g. the joint q/k norm
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    r"""Rotary embedding :math:`x\cos + \mathrm{rot}(x)\sin` with
    :math:`\mathrm{rot}([x_1, x_2]) = [-x_2, x_1]` (halves of the head dimension)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


#: the decode step reads each prompt's keys/values once per prompt instead of once per row
#: (LeanDecoder.start_repeated) when the rows' copies would be at least this many bytes per step
#: over all layers: then it is cheaper to read them once; below it the extra products and
#: reshapes cost more than they save (both sides measured in ``benchmarks/RESULTS.md`` 3.0.1)
_SHARED_PROMPT_MIN_BYTES = 1 << 22


def _signed_sin(sin: Tensor) -> Tensor:
    """The sin table with its first half negated, for :func:`_rotate_swap`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate_swap(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    r""":func:`_rotate` with ``signed_sin`` from :func:`_signed_sin`:
    :math:`x\cos + [x_2, x_1]\odot[-\sin_1, \sin_2]`, the same products and sums, so the
    same bits (IEEE negation is exact), with the halves swapped by one ``roll`` instead of
    two slices, a negation and a concatenation (``flip`` was slower than either on CPU for
    tensors of the training passes' size)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim, in float32 at least (half-precision scores are upcast for it
    and cast back, as transformers' eager attention does)."""
    if scores.dtype in (torch.float32, torch.float64):
        return scores.softmax(-1)
    return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)


def _is_rms_norm(module: Any) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and getattr(module, "bias", None) is None
    )


def _is_plain_linear(module: Any) -> bool:
    return type(module) is nn.Linear


def lean_decoder_unsupported_reason(
    model: Any, *, linear_ok: Callable[[Any], bool] = _is_plain_linear
) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` exactly, or ``None`` when it can.

    ``linear_ok``: which modules may stand in a layer's projections (default: a plain
    ``nn.Linear``; :mod:`gbmpo.rollout.static_decoder` also takes peft LoRA layers)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if base is None or type(head) is not nn.Linear:
        return "no plain .model / nn.Linear .lm_head (a wrapped or adapted model)"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "sliding-window layers"
    rope = getattr(base, "rotary_emb", None)
    if rope is None or getattr(rope, "rope_type", "default") not in _STATIC_ROPE:
        return f"rope type {getattr(rope, 'rope_type', None)!r} is not one of {_STATIC_ROPE}"
    if type(getattr(base, "embed_tokens", None)) is not nn.Embedding:
        return "embed_tokens is not a plain nn.Embedding"
    if not _is_rms_norm(getattr(base, "norm", None)):
        return "final norm is not an RMSNorm"
    for i, layer in enumerate(base.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(linear_ok(m) for m in linears):
            return f"layer {i}: a projection is not a plain nn.Linear (adapter or quantised?)"
        norms = [getattr(layer, "input_layernorm", None),
                 getattr(layer, "post_attention_layernorm", None)]
        if not all(_is_rms_norm(n) for n in norms):
            return f"layer {i}: a layer norm is not an RMSNorm"
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name, None)
            if norm is not None and not _is_rms_norm(norm):
                return f"layer {i}: {name} is not an RMSNorm"
    return None


def _norm_qk(qk: Tensor, layer: _Layer, joint: tuple[Tensor, float] | None, n_q: int) -> Tensor:
    """RMSNorm of the query and key heads of ``qk`` ``[rows, n_q + n_kv, d]``: one norm over
    both where :func:`_joint_qk_norm` built one (``joint``), else each side's own (or none)."""
    if joint is not None:
        return _rms(qk, *joint)
    if layer.q_norm is None and layer.k_norm is None:
        return qk
    q, k = qk[:, :n_q], qk[:, n_q:]
    q = q if layer.q_norm is None else _rms(q, *layer.q_norm)
    k = k if layer.k_norm is None else _rms(k, *layer.k_norm)
    return torch.cat([q, k], dim=1)


def _joint_qk_norm(layer: _Layer, n_q: int, n_kv: int, d: int) -> tuple[Tensor, float] | None:
    """The ``[H+KV, d]`` weight of the per-head query and key norms applied as one norm to the
    joint ``[rows, H+KV, d]`` query/key tensor (a copy of the current weights), or ``None``
    when the layer lacks one of them or their epsilons differ."""
    q_norm, k_norm = layer.q_norm, layer.k_norm
    if q_norm is None or k_norm is None or q_norm[1] != k_norm[1]:
        return None
    joint = torch.cat([q_norm[0].detach().expand(n_q, d), k_norm[0].detach().expand(n_kv, d)])
    return joint, q_norm[1]


@dataclass
class _Layer:
    """One decoder layer's weights (views of the model's parameters, no copies)."""

    ln1: Tensor
    ln1_eps: float
    q: tuple[Tensor, Tensor | None]
    k: tuple[Tensor, Tensor | None]
    v: tuple[Tensor, Tensor | None]
    o: tuple[Tensor, Tensor | None]
    q_norm: tuple[Tensor, float] | None
    k_norm: tuple[Tensor, float] | None
    ln2: Tensor
    ln2_eps: float
    gate: tuple[Tensor, Tensor | None]
    up: tuple[Tensor, Tensor | None]
    down: tuple[Tensor, Tensor | None]
    act: Callable[[Tensor], Tensor]


def _wb(linear: nn.Linear) -> tuple[Tensor, Tensor | None]:
    return linear.weight, linear.bias


def _norm(module: Any) -> tuple[Tensor, float] | None:
    return None if module is None else (module.weight, module.variance_epsilon)


class _LlamaWeights:
    """References to a Llama-shaped model's parameters, gathered once per object (no copies:
    the object always sees the model's current weights)."""

    def __init__(self, model: Any) -> None:
        config = model.config
        base = model.model
        self._rotary = base.rotary_emb
        self.embed = base.embed_tokens.weight
        self.final_norm = (base.norm.weight, base.norm.variance_epsilon)
        self.lm_head = _wb(model.lm_head)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.scale = self.head_dim**-0.5
        act_name = getattr(config, "hidden_act", "silu")
        self.layers: list[_Layer] = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln1_eps=layer.input_layernorm.variance_epsilon,
                    q=_wb(attn.q_proj), k=_wb(attn.k_proj), v=_wb(attn.v_proj),
                    o=_wb(attn.o_proj),
                    q_norm=_norm(getattr(attn, "q_norm", None)),
                    k_norm=_norm(getattr(attn, "k_norm", None)),
                    ln2=layer.post_attention_layernorm.weight,
                    ln2_eps=layer.post_attention_layernorm.variance_epsilon,
                    gate=_wb(mlp.gate_proj), up=_wb(mlp.up_proj), down=_wb(mlp.down_proj),
                    act=F.silu if act_name == "silu" else mlp.act_fn,
                )
            )


class LeanDecoder(_LlamaWeights):
    """Decode one token per row with ``model``'s weights and a preallocated KV buffer.

    Use :meth:`for_model` (``None`` when the model is not supported), then :meth:`start` with the
    prefill's KV cache and attention mask, then :meth:`step` once per new token. Inference only
    (call under ``torch.no_grad``)."""

    def __init__(self, model: Any, *, _checked: bool = False) -> None:
        reason = None if _checked else lean_decoder_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        super().__init__(model)
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._mask = torch.empty(0)
        self._cos = self._sin = torch.empty(0)
        self._column = 0
        #: per layer: the ``[H+KV, d]`` q_norm/k_norm weights of the joint query/key norm
        self._qk_norms: list[tuple[Tensor, float] | None] = []
        self._shared = False
        self._groups = (0, 1, 0)
        self._prompt_kv: list[tuple[Tensor, Tensor]] = []

    @classmethod
    def for_model(cls, model: Any) -> LeanDecoder | None:
        """A decoder for ``model``, or ``None`` when it is not supported (see
        :func:`lean_decoder_unsupported_reason`)."""
        if lean_decoder_unsupported_reason(model) is not None:
            return None
        return cls(model, _checked=True)  # checked once per call, not twice

    def start(self, cache: Any, attention_mask: Tensor, max_new_tokens: int) -> None:
        """Copy the prefill ``cache`` (a transformers cache with ``layers[i].keys/values`` of
        shape ``[rows, kv_heads, P, head_dim]``) into buffers with room for ``max_new_tokens``
        more positions; ``attention_mask`` ``[rows, P]`` marks the real prompt tokens."""
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.layers):
            raise ValueError("the prefill cache has no per-layer keys/values to start from")
        self.start_repeated([(layer.keys, layer.values) for layer in layers], attention_mask, 1,
                            max_new_tokens)

    def start_repeated(self, keys_values: list[tuple[Tensor, Tensor]], prompt_mask: Tensor,
                       repeats: int, max_new_tokens: int) -> None:
        """Start from per-layer prompt ``(keys, values)`` ``[U, kv_heads, P, head_dim]`` (e.g.
        :meth:`gbmpo.rollout.lean_forward.LeanForward.prompt_cache`) of ``U`` prompts, each
        the prompt of ``repeats`` consecutive rows (``repeat_interleave`` order), with room for
        ``max_new_tokens`` more positions; ``prompt_mask`` ``[U, P]`` marks the real prompt
        tokens. The prompt's keys/values are copied to each of its rows, or, when those copies
        would be large (:data:`_SHARED_PROMPT_MIN_BYTES`), kept once per prompt and attended to
        with one product per prompt for all its rows' queries (the same attention, summed in
        two parts: prompt and new tokens)."""
        if len(keys_values) != len(self.layers):
            raise ValueError(f"{len(keys_values)} layers of keys/values for a model with "
                             f"{len(self.layers)} layers")
        n_u, width = prompt_mask.shape
        rows, total = n_u * repeats, width + max_new_tokens
        per_row_bytes = sum(k.shape[1] * k.shape[3] * (k.element_size() + v.element_size())
                            for k, v in keys_values) * rows * width
        self._shared = repeats > 1 and per_row_bytes >= _SHARED_PROMPT_MIN_BYTES
        self._groups = (n_u, repeats, width)
        self._keys, self._values, self._prompt_kv = [], [], []
        for keys, values in keys_values:
            if keys.shape[0] != n_u or keys.shape[2] != width:
                raise ValueError(
                    f"cache keys {tuple(keys.shape)} do not match the attention mask "
                    f"{tuple(prompt_mask.shape)}"
                )
            n_kv, d = keys.shape[1], keys.shape[3]
            if self._shared:  # prompt keys/values once per prompt, new ones per row
                self._prompt_kv.append((keys.contiguous(), values.contiguous()))
                self._keys.append(keys.new_empty(rows, n_kv, max_new_tokens, d))
                self._values.append(values.new_empty(rows, n_kv, max_new_tokens, d))
                continue
            k_buf = keys.new_empty(rows, n_kv, total, d)
            v_buf = values.new_empty(rows, n_kv, total, d)
            k_buf.view(n_u, repeats, n_kv, total, d)[:, :, :, :width] = keys.unsqueeze(1)
            v_buf.view(n_u, repeats, n_kv, total, d)[:, :, :, :width] = values.unsqueeze(1)
            self._keys.append(k_buf)
            self._values.append(v_buf)
        attention_mask = prompt_mask.repeat_interleave(repeats, dim=0)
        # additive attention mask: 0 for the real prompt tokens and every new column (a column
        # is only read once it has been written), -inf for left padding
        self._mask = torch.zeros(rows, 1, 1, total, dtype=self._keys[0].dtype,
                                 device=attention_mask.device)
        self._mask[:, 0, 0, :width].masked_fill_(~attention_mask.bool(), -math.inf)
        # cos/sin for every position a row can reach (its real-token count + new tokens); the
        # sin table with its first half negated, for the rotation by a half-swap (_rotate_swap)
        positions = torch.arange(total + 1, device=attention_mask.device)[None]
        cos, sin = self._rotary(self._keys[0][:1, 0, :1], positions)
        self._cos, self._sin = cos[0], _signed_sin(sin[0])
        self._column = width
        # from the current weights (they change between generate calls during training)
        self._qk_norms = [_joint_qk_norm(layer, self.num_heads, self.num_kv_heads,
                                         self.head_dim) for layer in self.layers]  # fmt: skip

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Feed ``tokens`` ``[rows]`` at rotary ``positions`` ``[rows]``; return the next-token
        logits ``[rows, V]``."""
        if self._column >= self._mask.shape[-1]:
            raise RuntimeError("LeanDecoder: more steps than max_new_tokens given to start()")
        rows = tokens.shape[0]
        h_dim, n_q, n_kv = self.head_dim, self.num_heads, self.num_kv_heads
        groups = n_q // n_kv
        col = self._column
        cos = self._cos[positions].unsqueeze(1)  # [rows, 1, head_dim]
        sin = self._sin[positions].unsqueeze(1)
        mask = self._mask[..., : col + 1]  # [rows, 1, 1, col + 1], shared by the layers
        x = F.embedding(tokens, self.embed)  # [rows, hidden]
        layers = zip(self.layers, self._qk_norms, self._keys, self._values, strict=True)
        prompt_kv = list(self._prompt_kv)
        for layer, qk_norm, k_buf, v_buf in layers:
            h = _rms(x, layer.ln1, layer.ln1_eps)
            qk = torch.cat([F.linear(h, *layer.q).view(rows, n_q, h_dim),
                            F.linear(h, *layer.k).view(rows, n_kv, h_dim)], dim=1)
            v = F.linear(h, *layer.v).view(rows, n_kv, h_dim)
            # query and key heads normalised (per head) and rotated as one tensor
            qk = _norm_qk(qk, layer, qk_norm, n_q)
            qk = _rotate_swap(qk, cos, sin)
            # one query position: the H query heads as KV groups of H/KV queries each, softmax
            # attention written out (a few small products: the fused CPU kernel costs more
            # per call at these sizes)
            q = qk[:, :n_q].view(rows, n_kv, groups, h_dim)
            if self._shared:
                out = self._attend_shared(q, qk[:, n_q:], v, k_buf, v_buf, prompt_kv.pop(0),
                                          mask, col)
            else:
                k_buf[:, :, col] = qk[:, n_q:]
                v_buf[:, :, col] = v
                scores = torch.matmul(q, k_buf[:, :, : col + 1].transpose(-1, -2))
                probs = _softmax(torch.add(mask, scores, alpha=self.scale))
                out = torch.matmul(probs, v_buf[:, :, : col + 1])
            x = x + F.linear(out.reshape(rows, n_q * h_dim), *layer.o)
            h = _rms(x, layer.ln2, layer.ln2_eps)
            x = x + F.linear(layer.act(F.linear(h, *layer.gate)) * F.linear(h, *layer.up),
                             *layer.down)
        self._column = col + 1
        return F.linear(_rms(x, *self.final_norm), *self.lm_head)

    def _attend_shared(self, q: Tensor, k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor,
                       prompt_kv: tuple[Tensor, Tensor], mask: Tensor, col: int) -> Tensor:
        """Attention of ``q`` ``[rows, KV, groups, d]`` over its prompt's keys (stored once per
        prompt, read once for its ``repeats`` rows: the queries of a prompt's rows form one
        product) and its own new keys; one softmax over both parts."""
        n_u, reps, width = self._groups
        rows, n_kv, groups, d = q.shape
        j = col - width
        k_new[:, :, j] = k
        v_new[:, :, j] = v
        k_p, v_p = prompt_kv
        q_u = q.view(n_u, reps, n_kv, groups, d).transpose(1, 2).reshape(n_u, n_kv, -1, d)
        s_p = torch.matmul(q_u, k_p.transpose(-1, -2))  # [U, KV, reps*groups, P]
        s_p = s_p.view(n_u, n_kv, reps, groups, width).transpose(1, 2)
        s_n = torch.matmul(q, k_new[:, :, : j + 1].transpose(-1, -2))  # [rows, KV, groups, j+1]
        scores = torch.cat([s_p.reshape(rows, n_kv, groups, width), s_n], dim=-1)
        probs = _softmax(torch.add(mask, scores, alpha=self.scale))
        p_u = probs[..., :width].reshape(n_u, reps, n_kv, groups, width).transpose(1, 2)
        out_p = torch.matmul(p_u.reshape(n_u, n_kv, reps * groups, width), v_p)
        out_p = out_p.view(n_u, n_kv, reps, groups, d).transpose(1, 2).reshape(q.shape)
        return out_p + torch.matmul(probs[..., width:], v_new[:, :, : j + 1])
