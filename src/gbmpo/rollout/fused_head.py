r"""The LM head fused into the log-softmax chunks: :func:`linear_selective_log_softmax`.

It takes the final hidden states and the LM head instead of logits: the head is applied chunk by
chunk of token rows and recomputed in the backward (:class:`_LinearSelectiveLogSoftmax`), so
neither the ``[B, T, V]`` logits nor their gradient ever exist (as TRL's fused LM head).
:func:`gbmpo.rollout.logprobs.completion_logprobs` uses it wherever the model's logits are a
plain linear head's; :mod:`gbmpo.rollout.logprobs` re-exports it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from gbmpo.objectives.tensors import compute_dtype
from gbmpo.rollout.log_softmax import DEFAULT_CHUNK_ROWS

__all__ = ["fused_chunk_rows", "linear_selective_log_softmax"]

#: at most this many logits per chunk of the fused LM head (:func:`linear_selective_log_softmax`,
#: 256 MB of float32): the chunk's projection ``[c, H] x [H, V]`` needs a few hundred rows to be
#: a compute-bound product (441 rows at Qwen3's 151,936-token vocabulary), while the chunk's
#: logits, their float32 copy and its gradient stay well under the ``[B, T, V]`` tensors saved
_FUSED_CHUNK_ELEMENTS = 1 << 26


def _fused_step(vocab: int, chunk_rows: int) -> int:
    """Rows per chunk of the fused head: at most ``chunk_rows`` and
    :data:`_FUSED_CHUNK_ELEMENTS` logits."""
    return max(1, min(chunk_rows, _FUSED_CHUNK_ELEMENTS // max(vocab, 1)))


def _head_logits(h: Tensor, weight: Tensor, bias: Tensor | None, scale: float,
                 out_dtype: torch.dtype) -> Tensor:
    """``(h W^T + b) * scale`` of one chunk ``[c, V]`` in ``out_dtype``: the product in the
    head's dtype (as the model's own head computes it), the scale after the cast."""
    z = F.linear(h.to(weight.dtype), weight, bias).to(out_dtype)
    return z if scale == 1.0 else z.mul_(scale)


def _addmm_acc(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in a wider dtype than 16-bit ``a``, ``b``, without
    rounding each chunk's product to 16 bits first (``out_dtype`` on CUDA; a float32 copy
    elsewhere)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _fused_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, scale: float, step: int,
    out_dtype: torch.dtype, entropy: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(z_i - lse(z) [N], lse(z) [N]) chunk by chunk, z = (h W^T + b) * scale; with
    ``entropy`` [N] also the entropy of each row written into it."""
    n = hidden.shape[0]
    out = torch.empty(n, dtype=out_dtype, device=hidden.device)
    lse = torch.empty_like(out)
    for s in range(0, n, step):
        e = min(n, s + step)
        z = _head_logits(hidden[s:e], weight, bias, scale, out_dtype)
        torch.logsumexp(z, dim=-1, out=lse[s:e])
        out[s:e] = z.gather(-1, index[s:e].unsqueeze(-1)).squeeze(-1) - lse[s:e]
        if entropy is not None:
            probs = torch.sub(z, lse[s:e].unsqueeze(-1)).exp_()
            entropy[s:e] = lse[s:e] - probs.mul_(z).sum(-1)
            del probs
        del z  # freed before the next chunk's logits are made
    return out, lse


class _LinearSelectiveLogSoftmax(torch.autograd.Function):
    r"""z = (h W^T + b)/T per chunk of rows, z_i - lse(z); the backward recomputes each
    chunk's z. Hand-written backward for memory: the weight's gradient accumulates into one
    buffer (autograd through per-chunk checkpoints would make a ``[V, H]`` temporary per
    chunk), and nothing vocabulary-sized outlives its chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor,
        scale: float, step: int, out_dtype: torch.dtype, entropy: Tensor | None = None,
    ) -> Tensor:
        out, lse = _fused_forward(hidden, weight, bias, index, scale, step, out_dtype, entropy)
        ctx.save_for_backward(hidden, weight, bias, index, lse)
        ctx.scale, ctx.step = scale, step
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, index, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dt = lse.dtype
        g = grad_out.reshape(-1).to(dt)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=dt, device=weight.device) if need_b else None
        n, step = hidden.shape[0], ctx.step
        for s in range(0, n, step):
            e = min(n, s + step)
            z = _head_logits(hidden[s:e], weight, bias, ctx.scale, dt)
            gs = g[s:e].unsqueeze(-1)
            # dL/dz = g (1_i - softmax(z)); dz/d(h W^T + b) = scale
            gz = z.sub_(lse[s:e].unsqueeze(-1)).exp_().mul_(gs.neg())
            gz.scatter_add_(-1, index[s:e].unsqueeze(-1), gs)
            if ctx.scale != 1.0:
                gz.mul_(ctx.scale)
            gz_w = gz.to(weight.dtype)
            if dh is not None:
                dh[s:e] = gz_w @ weight
            if dw is not None:
                _addmm_acc(dw, gz_w.t(), hidden[s:e].to(weight.dtype))
            if db is not None:
                db.add_(gz.sum(dim=0))
            del z, gz, gz_w  # freed before the next chunk's logits are made
        return (dh, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None, None)


def linear_selective_log_softmax(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, *,
    temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS, with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    r""":func:`selective_log_softmax` of the logits :math:`z = (h W^\top + b)/T` without ever
    holding them whole: :math:`\log\pi(i\mid h) = z_i - \operatorname{logsumexp}_v z_v`.

    ``hidden`` ``[..., H]`` (the body's final, normalised hidden states), ``weight`` ``[V, H]``
    and ``bias`` ``[V]`` (the LM head), ``index`` ``[...]``. The head is applied to chunks of at
    most ``chunk_rows`` rows and about 64M logits and recomputed in the backward (as TRL's
    ``ChunkedLogProbFunction``): the peak is a few chunk-sized tensors. Gradients flow into
    ``hidden``, ``weight`` and ``bias`` (the weight's summed in float32 for 16-bit weights).
    ``with_entropy``: also :math:`H = \operatorname{lse}(z) - \sum_v \operatorname{softmax}(z)_v
    z_v` (no gradient, float32). Returns float32 (float64 for float64 inputs).
    """
    if hidden.shape[:-1] != index.shape:
        raise ValueError(f"index shape {tuple(index.shape)} must equal hidden shape without the "
                         f"hidden dimension {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[-1]}], got {tuple(weight.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out_dtype = compute_dtype(hidden, weight)
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_index = index.reshape(-1).to(device=hidden.device, dtype=torch.long)
    entropy = (torch.empty(flat.shape[0], dtype=out_dtype, device=hidden.device)
               if with_entropy else None)
    step = _fused_step(weight.shape[0], chunk_rows)
    args = (flat, weight, bias, flat_index, 1.0 / temperature, step, out_dtype, entropy)
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if grad:
        out: Tensor = _LinearSelectiveLogSoftmax.apply(*args)
    else:
        with torch.no_grad():
            out = _fused_forward(*args)[0]
    out = out.reshape(index.shape)
    return out, (None if entropy is None else entropy.reshape(index.shape).float())


def fused_chunk_rows(vocab: int) -> int:
    """Rows per chunk of a fused LM head over a ``vocab``-token vocabulary (about 64M logits
    per chunk, :data:`_FUSED_CHUNK_ELEMENTS`; at most :data:`DEFAULT_CHUNK_ROWS`)."""
    return _fused_step(vocab, DEFAULT_CHUNK_ROWS)
