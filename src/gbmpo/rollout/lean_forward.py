r"""A lean differentiable forward for the completion log-prob passes of Llama-shaped causal LMs.

The trainer's policy (with gradient), old-policy and reference passes each run the model over
``[prompt | completion]`` rows. At small sizes a transformers forward is mostly per-call and
per-op Python overhead: mask construction, cache objects, module wrappers, hooks and output
dataclasses per layer (the pyinstrument profile in ``benchmarks/RESULTS.md`` §3 had the
log-prob forwards and the backward at 63% of a 0.15M-parameter training step).

:class:`LeanForward` computes the same hidden states with plain tensor functions on the model's
**own** ``nn.Parameter`` objects, so autograd accumulates into the very ``.grad`` tensors the
optimizer steps and the training step is the same computation (the same arithmetic as
transformers' ``sdpa`` path, in the same order, up to float rounding):

.. math::

    x \leftarrow x + W_o\,\mathrm{sdpa}\big(\mathrm{rope}(n_q(W_q h)),\,
        \mathrm{rope}(n_k(W_k h)),\, W_v h;\ M\big),\quad h=\mathrm{rms}_1(x)

    x \leftarrow x + W_d\big(\mathrm{silu}(W_g h)\odot W_u h\big),\quad h=\mathrm{rms}_2(x)

with the mask :math:`M` (causal and the padding mask, as an additive 0/-inf tensor) built
once per pass and reused by every layer, grouped-query attention done by folding the ``H/KV``
query heads of a key/value head into its query sequence (no key repetition), and the final
:math:`\mathrm{rms}_f` and LM head applied only at the ``C`` positions that predict completion
tokens.

Prompt sharing (the layout :func:`gbmpo.rollout.logprobs.completion_logprobs` uses when the ``G``
completions of a group share a prompt): the ``U`` distinct prompts run once, their per-layer
keys/values are gathered to the ``B`` rows (``index_select``; its backward sums each prompt's
gradient over its rows) and the completion tokens attend to ``[prompt keys | own keys]``.

The last layer computes queries, attention output and MLP only at the positions whose output
is used (the ``C`` kept positions; with prompt sharing, each prompt's last position): the other
positions contribute their keys and values only, so this removes work without changing a value
(1-2% of a training step at 9.6M parameters). The rotary embedding swaps the head halves with
one ``roll`` against a sign-folded sin table (:func:`~gbmpo.rollout.decoder._rotate_swap`, the
same bits as the rotate-half formula, fewer calls forward and backward).

Padding: left-padded prompt positions attend to themselves only (so no softmax row is empty and
nothing becomes NaN); no real position attends to a padded one, so padded positions influence
neither values nor gradients. Positions after a completion's EOS are computed like
transformers does (they see the prompt and the completion up to the EOS) and masked by the
caller.

:meth:`LeanForward.for_model` returns ``None`` (the caller keeps transformers' forward) for what
:func:`~gbmpo.rollout.decoder.lean_decoder_unsupported_reason` refuses (other architectures,
adapters or quantised layers, sliding windows, length-dependent rope) and, in addition, for a
model in training mode with attention dropout, or with gradient checkpointing enabled (whose
memory trade the caller asked for).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gbmpo.rollout.decoder import (
    _Layer,
    _LlamaWeights,
    _rms,
    _rotate_swap,
    _signed_sin,
    lean_decoder_unsupported_reason,
)

__all__ = ["LeanForward", "lean_forward_unsupported_reason"]


def lean_forward_unsupported_reason(model: Any) -> str | None:
    """Why :class:`LeanForward` cannot run ``model`` exactly now, or ``None`` when it can."""
    reason = lean_decoder_unsupported_reason(model)
    if reason is not None:
        return reason
    config = model.config
    if model.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return "attention dropout in training mode"
    checkpointing = getattr(type(model), "is_activation_checkpointing", None)  # transformers 5
    if checkpointing is None:
        checkpointing = getattr(type(model), "is_gradient_checkpointing", None)
    if isinstance(checkpointing, property) and checkpointing.fget is not None:
        if checkpointing.fget(model):
            return "gradient checkpointing is enabled"
    elif getattr(model, "gradient_checkpointing", False):
        return "gradient checkpointing is enabled"
    return None


class LeanForward(_LlamaWeights):
    """Hidden states and selected-position logits of a Llama-shaped model, differentiable
    through its own parameters (see the module docstring).

    Build it per call with :meth:`for_model` (cheap: it only collects references to the
    parameters, so it always sees the model's current weights and mode)."""

    def __init__(self, model: Any, *, _checked: bool = False) -> None:
        reason = None if _checked else lean_forward_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanForward cannot run this model: {reason}")
        super().__init__(model)

    @classmethod
    def for_model(cls, model: Any) -> LeanForward | None:
        """A forward for ``model``, or ``None`` when it is not supported (see
        :func:`lean_forward_unsupported_reason`)."""
        if lean_forward_unsupported_reason(model) is not None:
            return None
        return cls(model, _checked=True)  # checked once per call, not twice

    # ------------------------------------------------------------------ building blocks

    def _rope_table(self, like: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """cos and signed sin (:func:`~gbmpo.rollout.decoder._signed_sin`) ``[length,
        head_dim]`` for positions ``0..length-1`` from the model's own rotary module (the same
        per-position values it computes for any position ids)."""
        positions = torch.arange(length, device=like.device)[None]
        cos, sin = self._rotary(like, positions)
        return cos[0], _signed_sin(sin[0])

    @staticmethod
    def _self_masks(real: Tensor) -> Tensor:
        """``[R, S, S]`` causal mask over the keys ``real`` ``[R, S]`` marks, as transformers
        builds it; a query with no allowed key (a left-padding position) attends to itself
        instead, so no softmax row is empty (NaN) and no real query sees it."""
        width = real.shape[-1]
        causal = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()
        allowed = causal & real[:, None, :]
        empty = ~allowed.any(-1, keepdim=True)
        return allowed | (empty & torch.eye(width, dtype=torch.bool, device=real.device))

    def _pack_mask(self, allowed: Tensor, dtype: torch.dtype) -> Tensor:
        """``[R, T, S]`` allowed-key mask -> additive ``[R, 1, groups*T, S]`` mask of ``dtype``
        (0 where allowed, ``-inf`` elsewhere) for the folded query heads (see
        :meth:`_attend`).

        ``scaled_dot_product_attention`` turns a boolean mask into exactly this tensor (``where``
        in the query's dtype) on every call; built once per pass, every layer reuses it, so
        the conversion runs once instead of once per layer (the same values, so the same
        attention and gradients, tested)."""
        groups = self.num_heads // self.num_kv_heads
        mask = allowed.unsqueeze(1)
        mask = mask if groups == 1 else mask.repeat(1, 1, groups, 1)
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, -math.inf
        )

    def _qkv(self, layer: _Layer, h: Tensor, cos: Tensor, sin: Tensor,
             queries: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries ``[R, KV, groups*Tq, d]`` (the query heads of a key/value head folded
        into its sequence), rotated keys and values ``[R, KV, T, d]``; the queries only for the
        last ``queries`` positions (``Tq``; all ``T`` when ``None``)."""
        rows, length = h.shape[:2]
        d, n_kv = self.head_dim, self.num_kv_heads
        groups = self.num_heads // n_kv
        t_q = length if queries is None else queries
        q = F.linear(h[:, length - t_q :], *layer.q).view(rows, t_q, self.num_heads, d)
        k = F.linear(h, *layer.k).view(rows, length, n_kv, d)
        v = F.linear(h, *layer.v).view(rows, length, n_kv, d)
        if layer.q_norm is not None:
            q = _rms(q, *layer.q_norm)
        if layer.k_norm is not None:
            k = _rms(k, *layer.k_norm)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [R, T, 1, d]
        q = _rotate_swap(q, cos[:, length - t_q :], sin[:, length - t_q :])
        k = _rotate_swap(k, cos, sin)
        # head h = kv * groups + g (transformers' repeat_kv order) -> [R, KV, groups*Tq, d]
        q = q.view(rows, t_q, n_kv, groups, d).permute(0, 2, 3, 1, 4)
        q = q.reshape(rows, n_kv, groups * t_q, d)
        return q, k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, layer: _Layer, x: Tensor, q: Tensor, k: Tensor, v: Tensor,
                mask: Tensor) -> Tensor:
        """Attention output projected and added to the residual ``x`` ``[R, T, hidden]``, then
        the MLP block."""
        rows, length = x.shape[:2]
        n_kv, d = self.num_kv_heads, self.head_dim
        groups = self.num_heads // n_kv
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        # [R, KV, groups*T, d] -> [R, T, H*d] with head h = kv * groups + g
        out = out.view(rows, n_kv, groups, length, d).permute(0, 3, 1, 2, 4)
        x = x + F.linear(out.reshape(rows, length, self.num_heads * d), *layer.o)
        h = _rms(x, layer.ln2, layer.ln2_eps)
        return x + F.linear(layer.act(F.linear(h, *layer.gate)) * F.linear(h, *layer.up),
                            *layer.down)

    def _final(self, hidden: Tensor) -> Tensor:
        """The final norm: what the LM head (:attr:`lm_head`) multiplies."""
        return _rms(hidden, *self.final_norm)

    def _logits(self, hidden: Tensor) -> Tensor:
        return F.linear(self._final(hidden), *self.lm_head)

    # ------------------------------------------------------------------ the two layouts

    def sequence_logits(self, ids: Tensor, mask: Tensor, keep: int) -> Tensor:
        """Logits ``[R, keep, V]`` at the last ``keep`` positions of the left-padded rows
        ``ids`` ``[R, S]`` (``mask`` marks real tokens; position ids from its cumulative sum,
        as in generation): the single forward of :func:`~gbmpo.rollout.logprobs.completion_logprobs`
        with ``logits_to_keep=keep``."""
        return F.linear(self.sequence_hidden(ids, mask, keep), *self.lm_head)

    def sequence_hidden(self, ids: Tensor, mask: Tensor, keep: int) -> Tensor:
        """The final-normed hidden states ``[R, keep, hidden]`` that :meth:`sequence_logits`
        multiplies by the LM head (:attr:`lm_head`), for a caller that applies the head in
        chunks."""
        rows, width = ids.shape
        real = mask.bool()
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        x = F.embedding(ids, self.embed)
        cos_t, sin_t = self._rope_table(x, width)
        cos, sin = cos_t[positions], sin_t[positions]
        allowed = self._self_masks(real)
        att = self._pack_mask(allowed, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer.ln1, layer.ln1_eps)
            if i == last:  # only the kept positions' outputs are used after the last layer
                q, k, v = self._qkv(layer, h, cos, sin, queries=keep)
                att_keep = self._pack_mask(allowed[:, width - keep :], x.dtype)
                return self._final(self._attend(layer, x[:, width - keep :], q, k, v, att_keep))
            q, k, v = self._qkv(layer, h, cos, sin)
            x = self._attend(layer, x, q, k, v, att)
        return self._final(x[:, width - keep :])  # no layers

    def prompt_cache(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, list[tuple[Tensor,
                                                                                Tensor]]]:
        """The prefill of a decode: logits ``[R, V]`` at the last position of the left-padded
        prompts ``ids`` ``[R, P]`` (``mask`` marks real tokens; position ids from its cumulative
        sum, as in generation) and every layer's rotated keys and values ``[R, KV, P, d]`` (for
        :meth:`gbmpo.rollout.decoder.LeanDecoder.start_repeated`). Call under ``no_grad``."""
        width = ids.shape[1]
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        x = F.embedding(ids, self.embed)
        cos_t, sin_t = self._rope_table(x, width)
        cos, sin = cos_t[positions], sin_t[positions]
        allowed = self._self_masks(mask.bool())
        att = self._pack_mask(allowed, x.dtype)
        keys_values = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer.ln1, layer.ln1_eps)
            q, k, v = self._qkv(layer, h, cos, sin, queries=1 if i == last else None)
            keys_values.append((k, v))
            if i == last:  # only the last position's output is used
                last_mask = self._pack_mask(allowed[:, -1:], x.dtype)
                x = self._attend(layer, x[:, -1:], q, k, v, last_mask)
            else:
                x = self._attend(layer, x, q, k, v, att)
        return self._logits(x[:, -1]), keys_values

    def shared_prompt_logits(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        first: Tensor,
        inverse: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> Tensor:
        """Logits ``[B, C, V]`` predicting each completion token (at the last prompt position
        and completion positions ``0..C-2``) with each distinct prompt forwarded once.

        ``first`` ``[U]``: a row holding each distinct prompt; ``inverse`` ``[B]``: the
        distinct prompt of each row (as :func:`gbmpo.rollout.logprobs._distinct_prompts`)."""
        return F.linear(self.shared_prompt_hidden(prompt_ids, prompt_mask, first, inverse,
                                                  completion_ids, completion_mask),
                        *self.lm_head)

    def shared_prompt_hidden(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        first: Tensor,
        inverse: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> Tensor:
        """The final-normed hidden states ``[B, C, hidden]`` that :meth:`shared_prompt_logits`
        multiplies by the LM head."""
        ids_u, mask_u = prompt_ids[first], prompt_mask[first]
        n_u, width = ids_u.shape
        rows, c = completion_ids.shape
        device = ids_u.device
        real_u = mask_u.bool()
        pos_u = (mask_u.long().cumsum(-1) - 1).clamp_min(0)
        x_u = F.embedding(ids_u, self.embed)
        cos_t, sin_t = self._rope_table(x_u, width + c)
        allowed_u = self._self_masks(real_u)
        att_u = self._pack_mask(allowed_u, x_u.dtype)
        cos_u, sin_u = cos_t[pos_u], sin_t[pos_u]

        t = c - 1  # completion tokens fed (the last one is never an input)
        if t > 0:
            start = real_u.sum(-1)[inverse]  # [B] real prompt tokens per row
            pos_c = start[:, None] + torch.arange(t, device=device)[None]
            cos_c, sin_c = cos_t[pos_c], sin_t[pos_c]
            x_c = F.embedding(completion_ids[:, :-1], self.embed)
            causal_c = torch.ones(t, t, dtype=torch.bool, device=device).tril()
            seen = torch.cat(
                [prompt_mask.bool()[:, None, :].expand(rows, t, width),
                 causal_c & completion_mask[:, :-1].bool()[:, None, :]],
                dim=-1,
            )
            att_c = self._pack_mask(seen, x_c.dtype)
        last_layer = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # after the last layer only the last prompt position's output is used (the
            # completions need every prompt position's keys and values, not its output)
            only_last = i == last_layer
            q, k, v = self._qkv(layer, _rms(x_u, layer.ln1, layer.ln1_eps), cos_u, sin_u,
                                queries=1 if only_last else None)
            if t > 0:
                qc, kc, vc = self._qkv(layer, _rms(x_c, layer.ln1, layer.ln1_eps), cos_c, sin_c)
                keys = torch.cat([k.index_select(0, inverse), kc], dim=2)
                values = torch.cat([v.index_select(0, inverse), vc], dim=2)
                x_c = self._attend(layer, x_c, qc, keys, values, att_c)
            if only_last:
                x_u = self._attend(layer, x_u[:, -1:], q, k, v,
                                   self._pack_mask(allowed_u[:, -1:], x_u.dtype))
            else:
                x_u = self._attend(layer, x_u, q, k, v, att_u)
        last = x_u[:, -1].index_select(0, inverse).unsqueeze(1)  # [B, 1, hidden]
        hidden = torch.cat([last, x_c], dim=1) if t > 0 else last
        return self._final(hidden)
