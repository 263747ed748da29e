r"""The log-softmax of the selected token from logits already made, chunk by chunk.

:func:`selective_log_softmax` (a custom autograd function, :class:`_SelectiveLogSoftmax`),
:func:`selective_log_softmax_and_entropy` and :func:`token_entropy` take logits already made (a
softcapped or scaled head, the full-vocabulary paths of other callers), work chunk by chunk and
never build a ``[B, T, V]`` log-softmax; the backward writes the gradient straight into one
``[B, T, V]`` tensor. :mod:`gbmpo.rollout.logprobs` re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from gbmpo.objectives.tensors import compute_dtype

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "token_entropy",
]

#: default number of rows (token positions) per chunk in :func:`selective_log_softmax`
DEFAULT_CHUNK_ROWS = 1024

#: at most this many logits per chunk of :func:`selective_log_softmax` (16 MB of float32), so the
#: chunk temporaries stay small even with a 150k-token vocabulary
_CHUNK_ELEMENTS = 1 << 22


def _row_blocks(logits: Tensor) -> list[tuple[int, Tensor]]:
    """``(first flat row, [rows, V] view)`` blocks covering ``logits`` [..., V] without a copy
    when possible (a [B, T, V] slice such as ``logits[:, :-1]`` is not viewable as [B*T, V],
    but each ``logits[b]`` is)."""
    vocab = logits.shape[-1]
    try:
        return [(0, logits.view(-1, vocab))]
    except RuntimeError:
        pass
    if logits.dim() == 3:
        t = logits.shape[1]
        return [(b * t, logits[b]) for b in range(logits.shape[0])]
    return [(0, logits.reshape(-1, vocab))]


def _chunks_of(logits: Tensor, chunk_rows: int) -> Iterable[tuple[int, Tensor]]:
    """``(first flat row, [c, V] view)`` chunks of at most ``chunk_rows`` rows and about
    :data:`_CHUNK_ELEMENTS` elements."""
    step = max(1, min(chunk_rows, _CHUNK_ELEMENTS // max(logits.shape[-1], 1)))
    for offset, block in _row_blocks(logits):
        for s in range(0, block.shape[0], step):
            yield offset + s, block[s : s + step]


def _selected_logp(
    logits: Tensor, index: Tensor, chunk_rows: int, out_dtype: torch.dtype,
    entropy: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""(z_i - logsumexp(z) [N], flat index [N], logsumexp(z) [N]) chunk by chunk; with
    ``entropy`` ``[N]`` also writes :math:`H = \operatorname{lse}(z) - \sum_v
    e^{z_v - \operatorname{lse}(z)} z_v` into it from the same chunk and log-sum-exp (what
    :func:`token_entropy` computes, without a second pass over the logits)."""
    flat_index = index.reshape(-1)
    out = torch.empty(flat_index.shape[0], dtype=out_dtype, device=logits.device)
    lse = torch.empty_like(out)
    for s, z in _chunks_of(logits, chunk_rows):
        e = s + z.shape[0]
        zc = z.to(out_dtype)
        torch.logsumexp(zc, dim=-1, out=lse[s:e])
        out[s:e] = zc.gather(-1, flat_index[s:e].unsqueeze(-1)).squeeze(-1) - lse[s:e]
        if entropy is not None:
            probs = torch.sub(zc, lse[s:e].unsqueeze(-1)).exp_()
            entropy[s:e] = lse[s:e] - probs.mul_(zc).sum(-1)
    return out, flat_index, lse


class _SelectiveLogSoftmax(torch.autograd.Function):
    r"""z_i - logsumexp(z) per row; the backward writes
    :math:`\partial L/\partial z = g\,(\mathbb 1_i - \operatorname{softmax}(z))` chunk by chunk into
    the one gradient tensor (autograd through row slices would allocate a full-size zero tensor
    per chunk)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, index: Tensor, chunk_rows: int, out_dtype: torch.dtype,
        entropy: Tensor | None = None,
    ) -> Tensor:
        out, flat_index, lse = _selected_logp(logits, index, chunk_rows, out_dtype, entropy)
        ctx.save_for_backward(logits, flat_index, lse)
        ctx.chunk_rows = chunk_rows
        return out.reshape(index.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None, None]:
        logits, flat_index, lse = ctx.saved_tensors
        g = grad_out.reshape(-1).to(lse.dtype)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        for s, z in _chunks_of(logits, ctx.chunk_rows):
            e = s + z.shape[0]
            gs = g[s:e].unsqueeze(-1)
            target = flat_grad[s:e]
            buf = target if target.dtype == lse.dtype else torch.empty_like(z, dtype=lse.dtype)
            torch.sub(z.to(lse.dtype), lse[s:e].unsqueeze(-1), out=buf).exp_().mul_(gs.neg())
            buf.scatter_add_(-1, flat_index[s:e].unsqueeze(-1), gs)
            if buf is not target:
                target.copy_(buf)
        return grad, None, None, None, None


def selective_log_softmax(
    logits: Tensor, index: Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> Tensor:
    r"""Log-probability of the selected token, :math:`z_{i} - \log\sum_v e^{z_v}`, per row.

    ``logits`` ``[..., V]``, ``index`` ``[...]`` (long). The rows are processed in chunks of at
    most ``chunk_rows`` rows and about 4M logits (16 MB of float32), so a full ``[..., V]``
    log-softmax (or float32 copy) is never built, and a ``[B, T, V]`` slice of a larger logits
    tensor is read in place. Differentiable w.r.t. ``logits``: the forward saves the input and
    one log-sum-exp per row; the backward writes
    :math:`g\,(\mathbb 1_i - \operatorname{softmax}(z))` straight into the gradient (one
    ``[..., V]`` tensor, nothing else vocabulary-sized). Returns float32 (float64 for float64
    logits).
    """
    return _selective_log_softmax(logits, index, chunk_rows, with_entropy=False)[0]


def selective_log_softmax_and_entropy(
    logits: Tensor, index: Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[Tensor, Tensor]:
    r""":func:`selective_log_softmax` (differentiable) and :func:`token_entropy` (float32,
    no gradient) of the same logits in one pass over them: the entropy reuses each chunk's
    log-sum-exp, :math:`H = \operatorname{lse}(z) - \sum_v e^{z_v-\operatorname{lse}(z)} z_v`
    (the same quantity as :func:`token_entropy`, equal up to float rounding)."""
    logp, entropy = _selective_log_softmax(logits, index, chunk_rows, with_entropy=True)
    assert entropy is not None
    return logp, entropy


def _selective_log_softmax(
    logits: Tensor, index: Tensor, chunk_rows: int, *, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Both paths of :func:`selective_log_softmax` (the entropy only with ``with_entropy``)."""
    if logits.shape[:-1] != index.shape:
        raise ValueError(
            f"index shape {tuple(index.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    out_dtype = compute_dtype(logits)
    if index.numel() == 0:
        zeros = torch.zeros(index.shape, dtype=out_dtype, device=logits.device)
        return zeros, (zeros.float() if with_entropy else None)
    index = index.to(device=logits.device, dtype=torch.long)
    entropy = (
        torch.empty(index.numel(), dtype=out_dtype, device=logits.device)
        if with_entropy else None
    )
    if torch.is_grad_enabled() and logits.requires_grad:
        out: Tensor = _SelectiveLogSoftmax.apply(logits, index, chunk_rows, out_dtype, entropy)
    else:
        with torch.no_grad():
            out = _selected_logp(logits, index, chunk_rows, out_dtype, entropy)[0]
        out = out.reshape(index.shape)
    if entropy is None:
        return out, None
    return out, entropy.reshape(index.shape).float()


@torch.no_grad()
def token_entropy(logits: Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Tensor:
    r"""Entropy of the next-token distribution, :math:`H = \operatorname{lse}(z) - \sum_v
    \operatorname{softmax}(z)_v z_v`, per row, in chunks, without gradient. Returns float32."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for s in range(0, flat.shape[0], chunk_rows):
        z = flat[s : s + chunk_rows].float()
        lse = torch.logsumexp(z, dim=-1)
        parts.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
    if not parts:
        return torch.zeros(logits.shape[:-1], device=logits.device)
    return torch.cat(parts).reshape(logits.shape[:-1])
