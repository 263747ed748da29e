r"""Log-probs of the sampled tokens: :func:`completion_logprobs` and the log-softmax under it.

What lives here, and why it is apart from sampling (:mod:`gbmpo.rollout.sampling`): these are
the passes the loss differentiates (policy, old policy, reference), run several times per
generation batch, where the cost is the forward, the ``[B, C, V]`` logits and the backward.

* :func:`completion_logprobs` returns
  :math:`\log\pi(o_t\mid h_t) = z_{o_t} - \operatorname{logsumexp}_v z_v` per completion token.
  It picks a forward implementation once (:func:`logits_forward`) and asks it, through the one
  small interface :class:`CompletionLogits`, for the logits that predict the completion
  tokens: in one forward over ``[prompt | completion]`` rows, or, when rows share a prompt,
  with each distinct prompt forwarded once. Two implementations: the lean forward
  (:class:`~gbmpo.rollout.lean_forward.LeanForward`, Llama-shaped models) and the model's own
  transformers forward (any causal LM).
* :func:`linear_selective_log_softmax` (:class:`_LinearSelectiveLogSoftmax`) takes the final
  hidden states and the LM head instead of logits: the head is applied chunk by chunk of token
  rows and recomputed in the backward, so neither the ``[B, T, V]`` logits nor their gradient
  ever exist (as TRL's fused LM head). :func:`completion_logprobs` uses it wherever the model's
  logits are a plain linear head's (:func:`_body_and_head`; the lean forward always).
* :func:`selective_log_softmax` (a custom autograd function, :class:`_SelectiveLogSoftmax`),
  :func:`selective_log_softmax_and_entropy` and :func:`token_entropy` take logits already made
  (a softcapped or scaled head, the full-vocabulary paths of other callers), work chunk by
  chunk and never build a ``[B, T, V]`` log-softmax; the backward writes the gradient straight
  into one ``[B, T, V]`` tensor.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from gbmpo.objectives.tensors import compute_dtype
from gbmpo.rollout.lean_forward import LeanForward

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "CompletionLogits",
    "completion_hidden",
    "completion_logits",
    "completion_logprobs",
    "fused_chunk_rows",
    "linear_selective_log_softmax",
    "logits_forward",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "token_entropy",
]

#: default number of rows (token positions) per chunk in :func:`selective_log_softmax`
DEFAULT_CHUNK_ROWS = 1024

# --------------------------------------------------------------------- selective log-softmax

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


# ------------------------------------------------------- the LM head fused into the chunks

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

    ``hidden`` ``[..., H]`` (the model body's final, normalised hidden states), ``weight``
    ``[V, H]`` and ``bias`` ``[V]`` (the LM head), ``index`` ``[...]``. The head is applied to
    chunks of at most ``chunk_rows`` rows and about 64M logits; the backward recomputes each
    chunk's logits (as TRL's ``ChunkedLogProbFunction``), so the peak is a few chunk-sized
    tensors instead of the ``[..., V]`` logits and their gradient. Gradients flow into
    ``hidden``, ``weight`` and ``bias`` (the weight's summed over the chunks in float32 for
    16-bit weights). With ``with_entropy`` also the entropy :math:`H = \operatorname{lse}(z) -
    \sum_v \operatorname{softmax}(z)_v z_v` (no gradient, float32). Returns float32 (float64 for
    float64 inputs).
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


# ------------------------------------------------------ the logits of the completion tokens


class CompletionLogits(Protocol):
    """A forward implementation for :func:`completion_logprobs`: the logits that predict each
    completion token (at the last prompt position and at completion positions ``0..C-2``; the
    last completion token is never fed), returned as pieces ``[B, n_i, V]`` along the
    completion axis with :math:`\\sum_i n_i = C`; or, where :attr:`head` is not ``None``, the
    final hidden states ``[B, n_i, H]`` those logits are :math:`h W^\\top + b` of, for a caller
    that applies the head chunk by chunk (:func:`linear_selective_log_softmax`)."""

    #: the LM head ``(weight [V, H], bias [V] or None)`` when the ``*_hidden`` methods apply
    #: (the logits are exactly ``F.linear(hidden, *head)``), else ``None``
    head: tuple[Tensor, Tensor | None] | None

    def sequence_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        """One forward over ``[prompt | completion[:, :-1]]`` per row."""
        ...

    def shared_prompt_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        """Each distinct prompt (``first`` ``[U]``: a row holding it; ``inverse`` ``[B]``: the
        distinct prompt of each row, from :func:`_distinct_prompts`) forwarded once, its
        keys/values gathered to its rows (gradients summed over them), the completions run on
        top; ``None`` when this model cannot share a prompt (the caller then uses
        :meth:`sequence_logits`)."""
        ...

    def sequence_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        """:meth:`sequence_logits` before the LM head (only where :attr:`head` is set)."""
        ...

    def shared_prompt_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        """:meth:`shared_prompt_logits` before the LM head (only where :attr:`head` is set)."""
        ...


class _LeanLogits:
    """:class:`CompletionLogits` through :class:`~gbmpo.rollout.lean_forward.LeanForward`."""

    def __init__(self, forward: LeanForward) -> None:
        self.forward = forward
        self.head = forward.lm_head

    def sequence_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        return [F.linear(h, *self.head) for h in self.sequence_hidden(
            prompt_ids, prompt_mask, completion_ids, completion_mask)]

    def shared_prompt_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        return [F.linear(h, *self.head) for h in self.shared_prompt_hidden(
            prompt_ids, prompt_mask, completion_ids, completion_mask, first, inverse)]

    def sequence_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        attention = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
        ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)
        return [self.forward.sequence_hidden(ids, attention, completion_ids.shape[1])]

    def shared_prompt_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor]:
        return [self.forward.shared_prompt_hidden(
            prompt_ids, prompt_mask, first, inverse, completion_ids, completion_mask
        )]


#: config fields by which a transformers model transforms its head's output (softcapping,
#: scaling; the list TRL's ``add_fused_lm_head`` reads): a model setting one keeps its own
#: forward, whose logits are then not ``F.linear(hidden, *head)``
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                     "lm_head_multiplier", "logits_scaling")


def _body_and_head(model: Any) -> tuple[Any, tuple[Tensor, Tensor | None] | None]:
    """``(decoder body, (head weight, bias))`` of a transformers ``*ForCausalLM`` (under a PEFT
    wrapper too) whose logits are its plain linear head applied to the body's last hidden state;
    ``(None, None)`` otherwise (remote code, multimodal configs, a transformed or adapted
    head), which keeps the model's own forward."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    cls = type(base)
    config = getattr(base, "config", None)
    if (not cls.__module__.startswith("transformers.") or not cls.__name__.endswith("ForCausalLM")
            or config is None or not hasattr(config, "get_text_config")
            or config.get_text_config() is not config
            or any(getattr(config, name, None) is not None for name in _LOGIT_TRANSFORMS)):
        return None, None
    head = base.get_output_embeddings()
    body = getattr(base, getattr(base, "base_model_prefix", "") or "", None)
    if type(head) is not torch.nn.Linear or body is None or body is base:
        return None, None
    return body, (head.weight, head.bias)


class _ModelLogits:
    """:class:`CompletionLogits` through the model's own (transformers) forward, for any
    causal LM. Position ids come from the mask's cumulative sum, so left padding does not shift
    positions (as in generation); with ``logits_to_keep`` only the ``C`` needed positions get
    logits. The ``*_hidden`` methods run the decoder body alone (PEFT adapters included: they
    live inside its layers) where :func:`_body_and_head` finds one."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.keep = _accepts_logits_to_keep(model)
        self.body, self.head = _body_and_head(model)

    def _run(self, hidden: bool, keep: int | None, **kwargs: Any) -> tuple[Tensor, Any]:
        """(rows ``[B, n, H]`` of the body with ``hidden``, else logits ``[B, n, V]``; the
        cache) of one forward, ``n = keep`` last positions (all with ``None``)."""
        if hidden:
            out = self.body(**kwargs)
            rows = out.last_hidden_state
        else:
            if self.keep and keep is not None:
                kwargs["logits_to_keep"] = keep
            out = self.model(**kwargs)
            rows = out.logits
        if keep is not None and rows.shape[1] != keep:  # every position came back
            rows = rows[:, -keep:]
        return rows, getattr(out, "past_key_values", None)

    def _sequence(self, hidden: bool, prompt_ids: Tensor, prompt_mask: Tensor,
                  completion_ids: Tensor, completion_mask: Tensor) -> list[Tensor]:
        attention = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
        rows, _ = self._run(
            hidden, completion_ids.shape[1],
            input_ids=torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
            attention_mask=attention,
            position_ids=(attention.long().cumsum(-1) - 1).clamp_min(0),
            use_cache=False,
        )
        return [rows]

    def _shared(self, hidden: bool, prompt_ids: Tensor, prompt_mask: Tensor,
                completion_ids: Tensor, completion_mask: Tensor, first: Tensor,
                inverse: Tensor) -> list[Tensor] | None:
        """Two pieces: ``[B, 1, *]`` at the last prompt position (the prompt's forward, its KV
        cache gathered to the rows by a differentiable index) and ``[B, C-1, *]`` at completion
        positions ``0..C-2`` (the completions run on that cache). ``None`` when the model's
        cache is not a plain dynamic cache (:func:`_shareable`)."""
        mask_u = prompt_mask[first]
        head, cache = self._run(
            hidden, 1, input_ids=prompt_ids[first], attention_mask=mask_u,
            position_ids=(mask_u.long().cumsum(-1) - 1).clamp_min(0), use_cache=True,
        )
        if cache is None or not _shareable(cache):
            return None
        cache.batch_select_indices(inverse)
        head = head[:, -1][inverse].unsqueeze(1)
        c = completion_ids.shape[1]
        if c == 1:
            return [head]
        start = prompt_mask.long().sum(dim=1, keepdim=True)
        rows, _ = self._run(
            hidden, None,
            input_ids=completion_ids[:, :-1],
            attention_mask=torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1),
            position_ids=start + torch.arange(c - 1, device=start.device).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
        )
        return [head, rows]

    def sequence_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        return self._sequence(False, prompt_ids, prompt_mask, completion_ids, completion_mask)

    def shared_prompt_logits(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        return self._shared(False, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            first, inverse)

    def sequence_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> list[Tensor]:
        return self._sequence(True, prompt_ids, prompt_mask, completion_ids, completion_mask)

    def shared_prompt_hidden(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
        completion_mask: Tensor, first: Tensor, inverse: Tensor,
    ) -> list[Tensor] | None:
        return self._shared(True, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            first, inverse)


def logits_forward(model: Any, lean: bool = True) -> CompletionLogits:
    """The forward implementation for ``model``: :class:`~gbmpo.rollout.lean_forward.LeanForward`
    with ``lean`` and a model it supports (the same arithmetic on the model's own parameters
    without transformers' per-call overhead), otherwise the model's own forward."""
    forward = LeanForward.for_model(model) if lean else None
    return _ModelLogits(model) if forward is None else _LeanLogits(forward)


def _accepts_logits_to_keep(model: Any) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (logits only at the last positions;
    also used by the sampling generator's prefill)."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    if "logits_to_keep" in params:
        return True
    # PEFT wrappers forward **kwargs to the base model
    base = getattr(model, "get_base_model", None)
    return bool(base is not None and _accepts_logits_to_keep(base()))


def _distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(row of the first occurrence of each distinct prompt [U], prompt index of each row [B])."""
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(inverse.shape[0], device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), inverse.shape[0], device=inverse.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def _shareable(cache: Any) -> bool:
    """True for a plain dynamic cache (every layer a ``DynamicLayer``): its rows can be
    gathered with gradients and later tokens attend to all of it. Sliding-window, static,
    quantized or custom caches go through the single forward instead."""
    # deferred: transformers is heavy; gbmpo.rollout imports without it
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    return (
        isinstance(cache, DynamicCache)
        and bool(layers)
        and all(type(layer) is DynamicLayer for layer in layers)
    )


def completion_logprobs(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    with_entropy: bool = False,
    share_prompts: bool = True,
    lean: bool = True,
    fused_head: bool = True,
) -> tuple[Tensor, Tensor | None]:
    r"""Per-token :math:`\log\pi_\theta(o_t \mid q, o_{<t})` of the completion tokens.

    The logits that predict completion token :math:`t` sit at the last prompt position
    (:math:`t=0`) and at completion position :math:`t-1`, so the last completion token is
    never fed. Two ways to get them, equal up to float rounding:

    * single forward over ``[prompt | completion[:, :-1]]`` keeping the last ``C`` logits
      (``logits_to_keep``), attention mask = both masks, position ids from the mask's
      cumulative sum so left padding does not shift positions (as in ``generate``);
    * ``share_prompts=True`` and some rows share a prompt (the ``G`` completions of a group):
      each distinct prompt is forwarded once and its KV cache gathered to its rows, then the
      completions run on the cache, so the prompt's share of the forward and backward is done
      once per group instead of ``G`` times. Models whose cache is not a plain dynamic cache
      take the single forward.

    With ``lean`` (default) and a model :class:`~gbmpo.rollout.lean_forward.LeanForward`
    supports (Llama-shaped, no adapters, no dropout in training mode, no gradient
    checkpointing), either layout runs through it: the same arithmetic on the model's own
    parameters (same values and parameter gradients up to float rounding) without
    transformers' per-call and per-op overhead; otherwise, and with ``lean=False``, through the
    model's own forward (:func:`logits_forward`).

    With ``fused_head`` (default) and a plain linear LM head (every lean model; transformers'
    ``*ForCausalLM`` models with or without PEFT adapters, :func:`_body_and_head`), the forward
    stops at the final hidden states and :func:`linear_selective_log_softmax` applies the head
    chunk by chunk, recomputing it in the backward: no ``[B, C, V]`` logits or gradient exist
    (the same values up to float rounding). Otherwise the ``[B, C, V]`` logits are made and
    reduced by :func:`selective_log_softmax`.

    Logits are divided by ``temperature`` (the sampling distribution). Gradients flow when
    grad is enabled.

    Returns ``(logp [B, C] float32, entropy [B, C] or None)``; values at masked positions are
    whatever the model gives and must be masked by the caller.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    b, c = completion_ids.shape
    if c == 0:
        empty = torch.zeros(b, 0, device=device)
        return empty, (empty.clone() if with_entropy else None)

    forward = logits_forward(model, lean)  # picked once: the lean forward or the model's own
    head = forward.head if fused_head else None
    pieces = _pieces(forward, prompt_ids, prompt_mask, completion_ids, completion_mask,
                     share_prompts, hidden=head is not None)
    logps, entropies = [], []
    start = 0
    for piece in pieces:  # [B, n, H or V] predicting completion tokens start .. start+n-1
        targets = completion_ids[:, start : start + piece.shape[1]]
        start += piece.shape[1]
        entropy = None
        if head is not None:
            logp, entropy = linear_selective_log_softmax(
                piece, *head, targets, temperature=temperature, chunk_rows=chunk_rows,
                with_entropy=with_entropy,
            )
        else:
            logits = piece / temperature if temperature != 1.0 else piece
            if with_entropy:  # one pass over the logits for both
                logp, entropy = selective_log_softmax_and_entropy(logits, targets, chunk_rows)
            else:
                logp = selective_log_softmax(logits, targets, chunk_rows)
        logps.append(logp)
        entropies.append(entropy)
    logp = logps[0] if len(logps) == 1 else torch.cat(logps, dim=1)
    if not with_entropy:
        return logp, None
    return logp, entropies[0] if len(entropies) == 1 else torch.cat(entropies, dim=1)


def _pieces(
    forward: CompletionLogits, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
    completion_mask: Tensor, share_prompts: bool, *, hidden: bool = False,
) -> list[Tensor]:
    """The ``[B, n_i, V]`` pieces of logits predicting the completion tokens (inputs on the
    model's device, ``C >= 1``), or with ``hidden`` the final hidden states ``[B, n_i, H]``
    before ``forward.head``, with each shared prompt forwarded once where possible."""
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    b = completion_ids.shape[0]
    pieces: list[Tensor] | None = None
    if share_prompts and b > 1:
        first, inverse = _distinct_prompts(prompt_ids, prompt_mask)
        if first.shape[0] < b:  # rows share a prompt: forward it once for all of them
            shared = forward.shared_prompt_hidden if hidden else forward.shared_prompt_logits
            pieces = shared(*batch, first, inverse)
    if pieces is None:  # every prompt distinct, or a model cache that cannot be shared
        pieces = (forward.sequence_hidden if hidden else forward.sequence_logits)(*batch)
    return pieces


def completion_hidden(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    share_prompts: bool = True,
    lean: bool = True,
) -> tuple[Tensor, tuple[Tensor, Tensor | None]] | None:
    """The final hidden states ``[B, C, H]`` whose LM-head product ``F.linear(hidden, *head)``
    is :func:`completion_logits` (at temperature 1), and that ``head`` ``(weight [V, H], bias)``,
    from the same forward as :func:`completion_logprobs`; ``None`` for a model whose logits are
    not a plain linear head's (:func:`_body_and_head`). For what needs the whole next-token
    distribution in chunks (the exact full-vocabulary divergence, :mod:`gbmpo.train.full`)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    if completion_ids.shape[1] == 0:
        raise ValueError("completion_hidden: the batch has no completion tokens")
    forward = logits_forward(model, lean)
    if forward.head is None:
        return None
    pieces = _pieces(forward, prompt_ids, prompt_mask, completion_ids, completion_mask,
                     share_prompts, hidden=True)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), forward.head


def fused_chunk_rows(vocab: int) -> int:
    """Rows per chunk of a fused LM head over a ``vocab``-token vocabulary (about 64M logits
    per chunk, :data:`_FUSED_CHUNK_ELEMENTS`; at most :data:`DEFAULT_CHUNK_ROWS`)."""
    return _fused_step(vocab, DEFAULT_CHUNK_ROWS)


def completion_logits(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    share_prompts: bool = True,
    lean: bool = True,
) -> Tensor:
    """The logits ``[B, C, V]`` (divided by ``temperature``) that predict each completion token,
    from the same forward as :func:`completion_logprobs` (gradients flow when grad is enabled),
    for what needs the whole next-token distribution (the exact full-vocabulary divergence);
    :func:`selective_log_softmax` of them against ``completion_ids`` is
    :func:`completion_logprobs`'s ``logp``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    if completion_ids.shape[1] == 0:
        raise ValueError("completion_logits: the batch has no completion tokens")
    pieces = _pieces(logits_forward(model, lean), prompt_ids, prompt_mask, completion_ids,
                     completion_mask, share_prompts)
    logits = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    return logits / temperature if temperature != 1.0 else logits
