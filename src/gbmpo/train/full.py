r"""The own trainer's exact regularizer terms (``objective.regularizer.estimator: full``).

A term with ``estimator: full`` needs the whole next-token distributions of the policy and of
the reference at every completion position, not only the sampled tokens' log-probs
(:mod:`gbmpo.objectives.estimators`). The cheapest correct way here:

* **in the loss**: per micro-batch, the policy's forward returns its completion logits
  ``[b, C, V]`` (the forward computes them anyway for the log-probs; the sampled-token path
  reduces them to ``logp`` at once); the log-probs are taken from them as usual, the reference's
  logits come from one no-grad forward of the same micro-batch, and
  :func:`~gbmpo.objectives.estimators.full_divergence` sums the divergence over the vocabulary
  in chunks of token rows, storing its gradient for the policy logits during the forward (one
  buffer the size of the micro-batch's logits). The reference's logits are freed once the
  divergence is computed, so the peak per micro-batch is the sampled path's plus one
  logits-sized tensor (measured by ``benchmarks/estimator_cost.py``), bounded by
  ``optim.micro_batch_size``; time is one extra no-grad reference forward per micro-batch and
  epoch (the reference's logits are not kept across micro-batches: ``N x C x V`` floats);
* **in the reward**: the penalty :math:`\beta \sum_t D^{\text{full}}_t(\pi_{old}\,\|\,\pi_{ref})`
  of each sequence, from no-grad forwards of the rollout policy and the reference, micro-batch by
  micro-batch, detached (as the sampled-token in-reward penalty).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gbmpo.objectives.estimators import full_divergence, full_potential
from gbmpo.rollout.logprobs import (
    completion_logits,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
)
from gbmpo.rollout.sampling import Rollout
from gbmpo.train.batching import _chunks

if TYPE_CHECKING:
    from gbmpo.train.trainer import Trainer

__all__ = ["full_terms", "logprobs_and_full", "no_grad_logits", "sequence_full", "token_full"]


def full_terms(terms: Any) -> list[Any]:
    """The terms of ``terms`` (:class:`~gbmpo.objectives.spec.BuiltTerm`) with
    ``estimator: full``."""
    return [t for t in terms if getattr(t, "estimator", "sample") == "full"]


def _logits(tr: Trainer, model: Any, batch: Rollout) -> Tensor:
    ro = tr.config.rollout
    return completion_logits(
        model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
        temperature=ro.temperature, share_prompts=ro.share_prompts, lean=ro.lean_forward,
    )  # fmt: skip


@torch.no_grad()
def no_grad_logits(tr: Trainer, batch: Rollout, *, reference: bool) -> Tensor:
    """The completion logits ``[b, C, V]`` of the rollout policy (current weights) or of the
    reference (frozen copy / adapters disabled), eval mode, no grad (as
    :func:`gbmpo.train.step.no_grad_logprobs`)."""
    if reference and tr.ref_model is not None:
        return _logits(tr, tr.ref_model, batch)
    ctx = tr.model.disable_adapter() if reference else contextlib.nullcontext()
    was_training = tr.model.training
    tr.model.eval()
    try:
        with ctx:
            return _logits(tr, tr.model, batch)
    finally:
        tr.model.train(was_training)


def logprobs_and_full(
    tr: Trainer, batch: Rollout, mask: Tensor, terms: list[Any], *, with_entropy: bool
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    r"""For one micro-batch: the policy's sampled-token log-probs (with grad), its entropies
    (with ``with_entropy``) and, per ``full`` term, the exact per-token divergence
    :math:`\sum_v D_h(\pi_\theta(v|h_t), \pi_{ref}(v|h_t))` ``[b, C]`` (with grad into the
    policy logits), from one policy forward and one no-grad reference forward."""
    logits = _logits(tr, tr.model, batch)
    targets = batch.completion_ids.to(logits.device)
    entropy = None
    if with_entropy:
        logp, entropy = selective_log_softmax_and_entropy(logits, targets)
    else:
        logp = selective_log_softmax(logits, targets)
    ref_logits = no_grad_logits(tr, batch, reference=True)
    full_values = {
        t.name: full_divergence(logits, ref_logits, full_potential(t.name, t.regularizer), mask)
        for t in terms
    }
    return logp, entropy, full_values


@torch.no_grad()
def token_full(
    tr: Trainer, batch: Rollout | None, terms: list[Any], mask: Tensor, *, where: str = "advantage"
) -> dict[str, Tensor]:
    r"""Per ``full`` term, the per-token exact divergence :math:`D^{\text{full}}_{i,t}(\pi_{old}
    \,\|\,\pi_{ref})` ``[N, C]`` of the rollout ``batch`` (detached, 0 where masked),
    micro-batch by micro-batch (the ``placement: advantage`` penalty; ``where`` names the
    placement in the error for a missing batch)."""
    if batch is None:
        raise ValueError(f"an in-{where} term with estimator 'full' needs the rollout batch")
    parts: dict[str, list[Tensor]] = {t.name: [] for t in terms}
    for rows in _chunks(len(batch), tr.micro_batch):
        sub = batch.select(rows)
        old = no_grad_logits(tr, sub, reference=False)
        ref = no_grad_logits(tr, sub, reference=True)
        m = mask[rows]
        for t in terms:
            form = full_potential(t.name, t.regularizer)
            parts[t.name].append(full_divergence(old, ref, form, m))
    return {name: torch.cat(p) for name, p in parts.items()}


@torch.no_grad()
def sequence_full(
    tr: Trainer, batch: Rollout | None, terms: list[Any], mask: Tensor
) -> dict[str, Tensor]:
    r"""Per ``full`` term, :math:`S_i = \sum_t m_{i,t} D^{\text{full}}_{i,t}(\pi_{old}\,\|\,
    \pi_{ref})` ``[N]`` of the rollout ``batch`` (detached): :func:`token_full` summed over
    the tokens (the ``placement: reward`` penalty)."""
    per_token = token_full(tr, batch, terms, mask, where="reward")
    return {name: d.sum(dim=-1) for name, d in per_token.items()}
