r"""Loss aggregation: per-token losses ``[B, T]`` and a completion mask -> one scalar.

The normaliser is a named, separate step (verl's ``loss_agg_mode``, TRL's ``loss_type``;
docs/methods.md, section "Aggregation"). Modes (registry :data:`AGGREGATIONS`), with :math:`m` the
mask and :math:`\ell` the per-token loss:

=======================  ====================================================================
``grpo``                 :math:`\frac1B\sum_i\frac{\sum_t m_{i,t}\ell_{i,t}}{\sum_t m_{i,t}}`
                         (sequence-mean of token-means; GRPO, verl ``seq-mean-token-mean``)
``bnpo``                 :math:`\frac{\sum_{i,t} m\ell}{\sum_{i,t} m}` (token mean; DAPO,
                         verl ``token-mean``, TRL ``bnpo``)
``dr_grpo``              :math:`\frac{\sum_{i,t} m\ell}{B\,L_{\max}}` (Dr. GRPO,
                         arXiv 2503.20783; TRL ``dr_grpo``)
``seq_mean_token_sum``   :math:`\frac1B\sum_i\sum_t m\ell` (verl ``seq-mean-token-sum``)
=======================  ====================================================================

Micro-batching / gradient accumulation: pass the *full-batch* totals as keywords and call
:func:`aggregate` on each micro-batch; the micro-batch losses then **sum** to the full-batch
loss (and their gradients to its gradient), with no further division by the number of
accumulation steps:

* ``num_sequences``: sequences in the full batch (the ``B`` of ``grpo``, ``dr_grpo`` and
  ``seq_mean_token_sum``; default: this call's ``per_token.shape[0]``);
* ``num_tokens``: the denominator :math:`Z` of ``bnpo``, a float used exactly as given
  (default: this call's :math:`\max(1, \sum_{i,t} m_{i,t})`); only :math:`0 < Z < \infty` is
  required. With gradient accumulation on one process it is the full batch's valid-token count
  (so :math:`Z \ge` each micro-batch's count). In data-parallel training, where the gradients of
  :math:`P` processes are *averaged*, it is the accumulation window's global count
  :math:`N` divided by :math:`P`:
  :math:`\frac1P\sum_{p}\sum_{\text{micro}}\sum_{i,t} m\ell / Z = \sum_{\text{all}} m\ell / N`,
  the global token mean, while a process holding more than :math:`N/P` tokens has a local
  count above :math:`Z` (TRL ``dapo``, :func:`gbmpo.integrations.trl.dapo_normalizer`);
* ``max_len``: :math:`L_{\max}` of ``dr_grpo``, normally the generation limit
  (``max_completion_length``). When it is ``None`` it defaults to ``per_token.shape[1]``, the
  padded width of *this* tensor, which changes with padding; so ``dr_grpo`` refuses
  ``num_sequences`` without an explicit ``max_len``.

A mode ignores the normalisers it does not use (they are still validated). Sequences with no
valid token count in ``B`` and contribute 0 (token-mean denominators computed here are clamped
to >= 1, as in TRL / verl; an explicit ``num_tokens`` is not clamped).
Math in float32 (float64 input stays float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gbmpo.objectives.tensors import compute_dtype, is_checked_mask, sync_free
from gbmpo.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "AggregationFn",
    "Normalisers",
    "aggregate",
    "check_max_len",
    "normalisers",
]

#: ``fn(per_token, mask, *, max_len, num_sequences, num_tokens) -> scalar``; inputs validated.
AggregationFn = Callable[..., Tensor]

AGGREGATIONS: Registry[AggregationFn] = Registry("aggregation mode")


@AGGREGATIONS.register("grpo")
def _agg_grpo(
    per_token: Tensor, mask: Tensor, *, max_len: int, num_sequences: int, num_tokens: float
) -> Tensor:
    r""":math:`\frac1B\sum_i \sum_t m_{i,t}\ell_{i,t} / \max(1, \sum_t m_{i,t})` (GRPO,
    Shao et al. 2024, arXiv 2402.03300)."""
    seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    return seq.sum() / num_sequences


@AGGREGATIONS.register("bnpo")
def _agg_bnpo(
    per_token: Tensor, mask: Tensor, *, max_len: int, num_sequences: int, num_tokens: float
) -> Tensor:
    r""":math:`\sum_{i,t} m\ell / Z` with :math:`Z` = ``num_tokens`` (token mean; DAPO,
    arXiv 2503.14476)."""
    return (per_token * mask).sum() / num_tokens


@AGGREGATIONS.register("dr_grpo")
def _agg_dr_grpo(
    per_token: Tensor, mask: Tensor, *, max_len: int, num_sequences: int, num_tokens: float
) -> Tensor:
    r""":math:`\sum_{i,t} m\ell / (B\,L_{\max})` (Dr. GRPO, Liu et al. 2025,
    arXiv 2503.20783)."""
    return (per_token * mask).sum() / (num_sequences * max_len)


@AGGREGATIONS.register("seq_mean_token_sum")
def _agg_seq_mean_token_sum(
    per_token: Tensor, mask: Tensor, *, max_len: int, num_sequences: int, num_tokens: float
) -> Tensor:
    r""":math:`\frac1B\sum_i\sum_t m_{i,t}\ell_{i,t}` (verl ``seq-mean-token-sum``)."""
    return (per_token * mask).sum() / num_sequences


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    max_len: int | None = None,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    r"""Per-token losses ``[B, T]`` aggregated under ``mask`` ({0, 1} or bool) by ``mode``
    (``grpo``, ``bnpo``, ``dr_grpo``, ``seq_mean_token_sum``; equations in the module doc).

    Micro-batching: ``num_sequences`` (>= B) is the full batch's count, ``max_len`` the
    ``dr_grpo`` length :math:`L_{\max}` (default ``T``; no completion may be longer) and
    ``num_tokens`` the ``bnpo`` denominator, used as given (it may be a global count divided by
    the processes, below this mask's count). Returns a 0-dim float32 tensor (float64 for float64
    input); bad shapes, mask values or normalisers raise ValueError / TypeError.
    """
    norm = normalisers(per_token, mask, mode, max_len, num_sequences=num_sequences,
                       num_tokens=num_tokens)
    return norm.apply(per_token)


@dataclass(frozen=True)
class Normalisers:
    r"""An aggregation mode with its checked mask and normalisers for one ``[B, T]`` batch
    (:func:`normalisers`), so that one policy loss aggregates several per-token tensors (the
    loss, ``pg_loss``, each term's ``reg_loss``) with one check of the mask and one count of its
    lengths."""

    mode: str
    fn: AggregationFn
    #: the mask as {0, 1} floats of the compute dtype
    m: Tensor
    #: valid tokens per sequence, ``m.sum(-1)``
    lengths: Tensor
    num_sequences: int
    #: a python float, or a 0-dim tensor off the CPU (:func:`~gbmpo.objectives.tensors.sync_free`)
    num_tokens: float | Tensor
    max_len: int

    def apply(self, per_token: Tensor) -> Tensor:
        """:func:`aggregate` of ``per_token`` (any values where masked, NaN included)."""
        dt = self.m.dtype
        # the multiply, checked by one finite sum, on the CPU; else (or on a non-finite value)
        # the where, formed once
        x = None if sync_free(per_token) else per_token.to(dt) * self.m
        if x is None or not math.isfinite(float(x.detach().sum())):
            zero = torch.zeros((), dtype=dt, device=self.m.device)
            x = torch.where(self.m != 0, per_token.to(dt), zero)
        return self.fn(x, self.m, max_len=self.max_len, num_sequences=self.num_sequences,
                       num_tokens=self.num_tokens)  # fmt: skip


def normalisers(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    max_len: int | None = None,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> Normalisers:
    """The checks and normalisers of :func:`aggregate` (same arguments, same errors) for
    ``per_token``'s shape and dtype, as a :class:`Normalisers` to aggregate with."""
    fn = AGGREGATIONS.get(mode)
    if per_token.dim() != 2:
        raise ValueError(f"per_token must be [B, T], got shape {tuple(per_token.shape)}")
    if tuple(mask.shape) != tuple(per_token.shape):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} != per_token shape {tuple(per_token.shape)}"
        )
    dt = compute_dtype(per_token)
    m = mask.to(dt)
    # m - m * m is 0 only for 0 and 1 (NaN fails); float arithmetic, not a bool where, is the
    # cheap form on CPU
    if mask.dtype != torch.bool and not torch.compiler.is_compiling() \
            and not is_checked_mask(m) and float((m - m * m).abs().sum()) != 0.0:  # fmt: skip
        raise ValueError("mask must contain only 0 and 1")
    b, t = per_token.shape
    if b == 0:
        raise ValueError("per_token has no sequences (B == 0)")
    lengths = m.sum(-1)

    if num_sequences is None:
        n_seq = b
    else:
        if isinstance(num_sequences, bool) or not isinstance(num_sequences, int):
            raise TypeError(f"num_sequences must be an int, got {num_sequences!r}")
        if num_sequences < max(b, 1):
            raise ValueError(
                f"num_sequences={num_sequences} is smaller than this batch's {b} sequences; "
                "it must be the full-batch total"
            )
        n_seq = num_sequences

    if num_tokens is None:
        # a 0-dim tensor where reading it back would synchronise (the same value: an exact
        # integer count, divided by as a float either way)
        n_tok = (lengths.sum().clamp_min(1.0) if sync_free(lengths)
                 else max(1.0, float(lengths.sum())))  # fmt: skip
    else:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, float)):
            raise TypeError(f"num_tokens must be a real number, got {num_tokens!r}")
        # No lower bound from this batch's own count: under data-parallel gradient averaging the
        # per-process normaliser N_global / P can be below one process's local token count.
        if not math.isfinite(num_tokens) or num_tokens <= 0:
            raise ValueError(
                f"num_tokens={num_tokens!r} must be finite and > 0 (the bnpo denominator: the "
                "full-batch token count, or the global count / number of processes)"
            )
        n_tok = float(num_tokens)

    if max_len is None:
        if mode == "dr_grpo" and num_sequences is not None:
            raise ValueError(
                "dr_grpo with num_sequences (micro-batching) needs an explicit max_len: the "
                "default per_token.shape[1] depends on each micro-batch's padding"
            )
        l_max = t
    else:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        if not torch.compiler.is_compiling():  # checked outside the graph there
            check_max_len(lengths, max_len)
        l_max = max_len

    return Normalisers(mode, fn, m, lengths, n_seq, n_tok, l_max)


def check_max_len(lengths: Tensor, max_len: int) -> None:
    """Raise ValueError if a completion (``lengths``: valid tokens per sequence) is longer than
    ``max_len``."""
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_len:
        raise ValueError(
            f"max_len={max_len} is shorter than a completion with {longest} valid tokens"
        )
