r"""The own trainer's regularizer terms placed outside the loss (step 5 of
:meth:`gbmpo.train.Trainer.train_step`): ``placement: reward`` subtracts each term's detached
per-sequence penalty :math:`\beta_k \sum_t D^{(k)}_t(\pi_{old}\,\|\,\pi_{ref})` from the rewards
before the advantages; ``placement: advantage`` subtracts its future penalty
:math:`\beta_k \sum_{s \ge t} D^{(k)}_s` from each token's advantage after the normalisation
(FRPO). A term with ``estimator: full`` takes the exact divergence from the logits
(:mod:`gbmpo.train.full`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.loss import reward_penalty, sequence_divergence
from gbmpo.objectives.placement import advantage_penalty
from gbmpo.rollout.sampling import Rollout
from gbmpo.train.full import full_terms, sequence_full, token_full
from gbmpo.train.policy import PolicyModels

__all__ = ["in_advantage_penalties", "in_reward_penalties"]


def in_reward_penalties(
    terms: list[Any], rewards: Tensor, rollout_logp: Tensor, ref_logp: Tensor | None,
    mask: Tensor, models: PolicyModels, batch: Rollout | None, rows_per_pass: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The rewards minus the penalties of ``terms`` (the objective's ``reward_terms``;
    :func:`gbmpo.objectives.loss.reward_penalty`) and each term's per-sequence penalty
    ``beta_k * sum_t D_k(pi_old || pi_ref)`` ([N], by name); a term with ``estimator: full``
    takes the exact divergence from the logits of ``batch`` under ``models``, in passes of
    ``rows_per_pass`` rows (:func:`gbmpo.train.full.sequence_full`)."""
    full = full_terms(terms)  # estimator full: the exact divergence from the logits
    full_values = sequence_full(models, batch, full, mask, rows_per_pass) if full else {}
    penalties: dict[str, Tensor] = {}
    for term in terms:
        seq = full_values.get(term.name)
        if seq is None:
            seq = sequence_divergence(
                term.regularizer, rollout_logp=rollout_logp, ref_logp=ref_logp, mask=mask
            )
        penalties[term.name] = term.coef * seq.to(rewards.dtype)
    shaped = reward_penalty(rewards, [(1.0, p) for p in penalties.values()])
    return shaped, penalties


def in_advantage_penalties(
    terms: list[Any], advantages: Tensor, rollout_logp: Tensor, ref_logp: Tensor | None,
    mask: Tensor, models: PolicyModels, batch: Rollout | None, rows_per_pass: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token advantages minus each ``placement: advantage`` term's future penalty
    ``beta_k * sum_{s >= t} D_k,s(pi_old || pi_ref)`` (``terms``: the objective's
    ``advantage_terms``; :func:`gbmpo.objectives.placement.advantage_penalty`, after the
    normalisation), and each term's per-sequence penalty ``beta_k * sum_t D_k,t`` ([N], by
    name); a term with ``estimator: full`` takes the exact per-token divergence from the
    logits of ``batch`` under ``models``, in passes of ``rows_per_pass`` rows."""
    full = full_terms(terms)
    full_values = token_full(models, batch, full, mask, rows_per_pass) if full else {}
    pairs: list[tuple[float, Tensor]] = []
    totals: dict[str, Tensor] = {}
    m = mask.to(torch.bool)
    for term in terms:
        values = full_values.get(term.name)
        if values is None:
            with torch.no_grad():
                old = rollout_logp.detach()
                values = term.regularizer(logp=old, old_logp=old, anchor_logp=ref_logp, mask=mask)
        values = torch.where(m, values, torch.zeros((), dtype=values.dtype,
                                                    device=values.device))
        pairs.append((term.coef, values))
        totals[term.name] = term.coef * values.sum(-1)
    return advantage_penalty(advantages, pairs, mask), totals

