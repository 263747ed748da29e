"""Full-vocabulary Bregman divergences between whole next-token distributions.

For a separable potential h (see :mod:`gbmpo.objectives.potentials`) and each token position,

    D_full = sum_{v in V} D_h(pi_theta(v | h_t), pi_ref(v | h_t))

(METHODS.md section 3.5; the vocabulary-level reading of GBMPO, arXiv 2602.04380). With
h = negative entropy this is the exact KL(pi_theta || pi_ref), computed from log-softmax directly
(sum_v p_v (log p_v - log q_v); no floor); with h = y^2 it is sum_v (p_v - q_v)^2; any
:class:`NeuralMirrorMap` works as h. It is a different regularizer from the selected-token one
(which estimates it only after reweighting by 1/p).

Memory (N = B*T rows, V vocabulary, C = chunk_size, H hidden size, 4-byte floats):

* :func:`full_vocab_bregman` takes both logit tensors (2 N V elements, owned by the caller).
  Rows are processed C at a time; with grad each chunk is checkpointed, so the saved state is
  just the input logits and the extra peak is ~k C V floats (k ~ 6 for KL / square; for the
  neural mirror map, temporaries of C V 21 floats per activation block). Without chunking the
  temporaries are k N V floats.
* :func:`full_vocab_bregman_from_hidden` takes hidden states [B, T, H] and the LM-head weight
  [V, H] and projects inside each chunk, so no [N, V] tensor ever exists: forward and backward
  peak ~k C V floats plus the inputs; backward recomputes each chunk (about twice the projection
  compute of a plain forward/backward). This is the path for training with large vocabularies
  (FEASIBILITY.md section 6: the checkpointed, projected-in-chunk variant is the one that saves
  memory in backward; chunks of >= 128 rows avoid glibc heap fragmentation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from gbmpo.objectives.potentials import NegEntropy, Potential, as_potential

__all__ = ["bregman_rows", "full_vocab_bregman", "full_vocab_bregman_from_hidden"]


def _float_dtype(*tensors: Tensor | None) -> torch.dtype:
    ts = [t for t in tensors if t is not None]
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def bregman_rows(policy_logits: Tensor, ref_logits: Tensor, potential: Potential) -> Tensor:
    """sum_v D_h(softmax(policy)_v, softmax(ref)_v) over the last dimension (float32 math).

    For :class:`NegEntropy` this is KL(softmax(policy) || softmax(ref)) = sum_v p_v (log p_v -
    log q_v) from log-softmax (exact, equal to ``F.kl_div(log q, log p, log_target=True)``
    summed over v); otherwise h's own elementwise ``bregman`` on the probabilities.
    """
    dt = _float_dtype(policy_logits, ref_logits)
    log_p = torch.log_softmax(policy_logits.to(dt), dim=-1)
    log_q = torch.log_softmax(ref_logits.to(dt), dim=-1)
    if isinstance(potential, NegEntropy):
        # kl_div(input=log q, target=log p, log_target=True) = exp(log p) (log p - log q)
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    return potential.bregman(log_p.exp(), log_q.exp()).sum(-1)


def _check_chunk(chunk_size: int | None) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _check_mask(mask: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    if mask is None:
        return None
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {shape}")
    return mask.to(torch.bool)


def _run_chunks(fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor, step: int) -> Tensor:
    """Apply ``fn`` to matching row chunks of x and y ([N, V] each) and concatenate; each chunk
    is checkpointed when a gradient is being recorded and there is more than one chunk."""
    n_rows = x.shape[0]
    use_ckpt = (
        torch.is_grad_enabled() and (x.requires_grad or y.requires_grad) and step < n_rows
    )
    outs = []
    for start in range(0, n_rows, step):
        args = (x[start : start + step], y[start : start + step])
        outs.append(checkpoint(fn, *args, use_reentrant=False) if use_ckpt else fn(*args))
    if not outs:
        return torch.zeros(0, dtype=_float_dtype(x, y), device=x.device)
    return torch.cat(outs)


def full_vocab_bregman(
    policy_logits: Tensor,
    ref_logits: Tensor,
    potential: str | Potential = "neg_entropy",
    chunk_size: int | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token full-vocabulary Bregman divergence [B, T] from logits [B, T, V].

    D[b, t] = sum_v D_h(softmax(policy_logits[b, t])_v, softmax(ref_logits[b, t])_v)
    (METHODS.md 3.5). ``potential``: a name from POTENTIALS (``neg_entropy`` = exact KL,
    ``square``/``prob_l2``, ``neural_mirror``) or a potential object such as a NeuralMirrorMap.
    ``chunk_size`` rows (token positions) are processed at a time (None: all at once); with
    grad each chunk is checkpointed so that no softmax of the full [B, T, V] is kept for
    backward. Gradients flow into whichever logits require grad (normally only the policy's).
    ``mask`` [B, T] zeroes padded positions. Output float32 (float64 for float64 logits).
    """
    pot = as_potential(potential)
    _check_chunk(chunk_size)
    if policy_logits.shape != ref_logits.shape or policy_logits.dim() < 2:
        raise ValueError(
            f"policy_logits {tuple(policy_logits.shape)} and ref_logits "
            f"{tuple(ref_logits.shape)} must have the same shape [..., V]"
        )
    lead = tuple(policy_logits.shape[:-1])
    keep = _check_mask(mask, lead)
    vocab = policy_logits.shape[-1]
    flat_p = policy_logits.reshape(-1, vocab)
    flat_q = ref_logits.reshape(-1, vocab)

    def fn(x: Tensor, y: Tensor) -> Tensor:
        return bregman_rows(x, y, pot)

    step = max(flat_p.shape[0], 1) if chunk_size is None else chunk_size
    out = _run_chunks(fn, flat_p, flat_q, step).reshape(lead)
    if keep is not None:
        out = torch.where(keep, out, 0.0)
    return out


def full_vocab_bregman_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    potential: str | Potential = "neg_entropy",
    *,
    ref_hidden: Tensor | None = None,
    ref_lm_head_weight: Tensor | None = None,
    ref_logits: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    ref_lm_head_bias: Tensor | None = None,
    chunk_size: int | None = 128,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token full-vocabulary Bregman divergence [B, T] from policy hidden states.

    Policy logits = hidden @ lm_head_weight.T (+ lm_head_bias), computed inside each chunk of
    ``chunk_size`` token rows; each chunk is wrapped in ``torch.utils.checkpoint`` so neither the
    forward nor the backward ever holds a [B*T, V] tensor (see the module docstring). The
    reference side is exactly one of:

    * ``ref_hidden`` [B, T, H] with ``ref_lm_head_weight`` [V, H] (default: ``lm_head_weight``,
      e.g. LoRA with adapters off or a tied head) and ``ref_lm_head_bias``: projected inside the
      chunk without grad (recomputed in backward instead of stored);
    * ``ref_logits`` [B, T, V] precomputed (no grad is taken through them).

    Masked-out rows (``mask`` [B, T] false) are skipped entirely and give 0. Matmuls run in the
    input dtype (like the model's head); softmax and divergence in float32 (float64 stays).
    """
    pot = as_potential(potential)
    _check_chunk(chunk_size)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [..., H], got shape {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, H={hidden.shape[-1]}], got {tuple(lm_head_weight.shape)}"
        )
    vocab = lm_head_weight.shape[0]
    if (ref_hidden is None) == (ref_logits is None):
        raise ValueError("pass exactly one of ref_hidden (with ref_lm_head_weight) or ref_logits")
    lead = tuple(hidden.shape[:-1])
    if ref_hidden is not None:
        ref_w = (lm_head_weight if ref_lm_head_weight is None else ref_lm_head_weight).detach()
        if tuple(ref_hidden.shape[:-1]) != lead or ref_w.dim() != 2 or (
            ref_w.shape != (vocab, ref_hidden.shape[-1])
        ):
            raise ValueError(
                f"ref_hidden {tuple(ref_hidden.shape)} / ref_lm_head_weight "
                f"{tuple(ref_w.shape)} do not match hidden {tuple(hidden.shape)} and V={vocab}"
            )
        ref_rows = ref_hidden.detach().reshape(-1, ref_hidden.shape[-1])
    else:
        assert ref_logits is not None
        if tuple(ref_logits.shape) != (*lead, vocab):
            raise ValueError(
                f"ref_logits has shape {tuple(ref_logits.shape)}, expected {(*lead, vocab)}"
            )
        ref_w = None
        if ref_lm_head_weight is not None or ref_lm_head_bias is not None:
            raise ValueError("ref_lm_head_weight/ref_lm_head_bias are only used with ref_hidden")
        ref_rows = ref_logits.detach().reshape(-1, vocab)
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (vocab,):
        raise ValueError(f"lm_head_bias must be [{vocab}], got {tuple(lm_head_bias.shape)}")
    ref_b = None if ref_lm_head_bias is None else ref_lm_head_bias.detach()
    keep = _check_mask(mask, lead)

    rows = hidden.reshape(-1, hidden.shape[-1])
    n_all = rows.shape[0]
    idx = None
    if keep is not None:
        idx = keep.reshape(-1).nonzero().squeeze(-1)
        rows = rows.index_select(0, idx)
        ref_rows = ref_rows.index_select(0, idx)

    def fn(h: Tensor, r: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        logits = F.linear(h, weight, bias)
        with torch.no_grad():
            ref = r if ref_w is None else F.linear(r, ref_w, ref_b)
        return bregman_rows(logits, ref, pot)

    # weight and bias are passed whole (not chunked) so their gradients accumulate over chunks
    n = rows.shape[0]
    step = max(n, 1) if chunk_size is None else chunk_size
    use_ckpt = torch.is_grad_enabled() and (
        hidden.requires_grad
        or lm_head_weight.requires_grad
        or (lm_head_bias is not None and lm_head_bias.requires_grad)
    )
    outs = []
    for start in range(0, n, step):
        args = (rows[start : start + step], ref_rows[start : start + step])
        if use_ckpt:
            outs.append(checkpoint(fn, *args, lm_head_weight, lm_head_bias, use_reentrant=False))
        else:
            outs.append(fn(*args, lm_head_weight, lm_head_bias))
    dt = _float_dtype(hidden, lm_head_weight)
    vals = torch.cat(outs) if outs else torch.zeros(0, dtype=dt, device=hidden.device)
    if idx is not None:
        full = torch.zeros(n_all, dtype=vals.dtype, device=vals.device)
        vals = full.index_copy(0, idx, vals)
    return vals.reshape(lead)
