r"""The own trainer's exact regularizer terms (``objective.regularizer.estimator: full``).

A term with ``estimator: full`` needs the whole next-token distributions of the policy and of
the reference at every completion position, not only the sampled tokens' log-probs
(:mod:`gbmpo.objectives.estimators`). The cheapest correct way here:

* **in the loss**: per micro-batch, the policy's forward stops at its final hidden states
  ``[b, C, H]`` and the reference's no-grad forward of the same micro-batch likewise; the
  log-probs (:func:`~gbmpo.rollout.logprobs.linear_selective_log_softmax`) and each term's
  divergence (:func:`~gbmpo.objectives.full_vocab.full_vocab_bregman_from_hidden`) apply the
  LM heads chunk by chunk and recompute them in the backward, so no ``[b, C, V]`` tensor
  exists (peak: a few ``[c, V]`` chunks). A model whose logits are not a plain linear head's
  (:func:`~gbmpo.rollout.logprobs.completion_hidden` returns ``None``) takes the logits path:
  the completion logits ``[b, C, V]`` of both models and
  :func:`~gbmpo.objectives.estimators.full_divergence`, which stores its gradient for the
  policy logits during the forward (one buffer the size of the micro-batch's logits; measured
  by ``benchmarks/estimator_cost.py``). Either way time is one extra no-grad reference forward
  per micro-batch and epoch (nothing reference-sized is kept across micro-batches);
* **in the reward**: the penalty :math:`\beta \sum_t D^{\text{full}}_t(\pi_{old}\,\|\,\pi_{ref})`
  of each sequence, from no-grad forwards of the rollout policy and the reference, micro-batch by
  micro-batch, detached (as the sampled-token in-reward penalty).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.estimators import full_divergence, full_potential
from gbmpo.objectives.full_vocab import full_vocab_bregman_from_hidden
from gbmpo.rollout.logprobs import (
    completion_hidden,
    completion_logits,
    fused_chunk_rows,
    linear_selective_log_softmax,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
)
from gbmpo.rollout.sampling import Rollout
from gbmpo.train.batching import _chunks
from gbmpo.train.policy import PolicyModels

__all__ = ["full_terms", "logprobs_and_full", "no_grad_logits", "sequence_full", "token_full"]


def full_terms(terms: Any) -> list[Any]:
    """The terms of ``terms`` (:class:`~gbmpo.objectives.spec.BuiltTerm`) with
    ``estimator: full``."""
    return [t for t in terms if getattr(t, "estimator", "sample") == "full"]


def _logits(models: PolicyModels, model: Any, batch: Rollout) -> Tensor:
    ro = models.rollout
    return completion_logits(
        model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
        temperature=ro.temperature, share_prompts=ro.share_prompts, lean=ro.lean_forward,
    )  # fmt: skip


#: hidden states ``[b, C, H]`` and their LM head ``(weight, bias)``
_Hidden = tuple[Tensor, tuple[Tensor, Tensor | None]]


def _hidden(models: PolicyModels, model: Any, batch: Rollout) -> _Hidden | None:
    ro = models.rollout
    return completion_hidden(
        model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
        share_prompts=ro.share_prompts, lean=ro.lean_forward,
    )  # fmt: skip


@torch.no_grad()
def no_grad_logits(models: PolicyModels, batch: Rollout, *, reference: bool) -> Tensor:
    """The completion logits ``[b, C, V]`` of the rollout policy (current weights) or of the
    reference (frozen copy / adapters disabled), eval mode, no grad (as
    :func:`gbmpo.train.step.no_grad_logprobs`)."""
    with models.scoring(reference=reference) as model:
        return _logits(models, model, batch)


def _full_from_hidden(temperature: float, policy: _Hidden, ref: _Hidden, terms: list[Any],
                      mask: Tensor) -> dict[str, Tensor]:
    r"""Per term, :math:`\sum_v D(\pi(\cdot|h_t), \pi_{ref}(\cdot|h_t))` ``[b, C]`` from the
    two models' hidden states, their heads applied chunk by chunk (the temperature folded into
    the hidden states and biases: :math:`(hW^\top+b)/T = (h/T)W^\top + b/T`)."""
    inv_t = 1.0 / temperature

    def scaled(side: _Hidden) -> tuple[Tensor, Tensor, Tensor | None]:
        h, (w, b) = side
        if inv_t == 1.0:
            return h, w, b
        return h * inv_t, w, (None if b is None else b * inv_t)

    h, w, b = scaled(policy)
    rh, rw, rb = scaled(ref)
    step = fused_chunk_rows(w.shape[0])
    return {
        t.name: full_vocab_bregman_from_hidden(
            h, w, full_potential(t.name, t.regularizer), ref_hidden=rh, ref_lm_head_weight=rw,
            lm_head_bias=b, ref_lm_head_bias=rb, chunk_size=step, mask=mask.to(torch.bool),
        )
        for t in terms
    }


def logprobs_and_full(
    models: PolicyModels, batch: Rollout, mask: Tensor, terms: list[Any], *, with_entropy: bool
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    r"""For one micro-batch: the policy's sampled-token log-probs (with grad), its entropies
    (with ``with_entropy``) and, per ``full`` term, the exact per-token divergence
    :math:`\sum_v D_h(\pi_\theta(v|h_t), \pi_{ref}(v|h_t))` ``[b, C]`` (with grad into the
    policy logits), from one policy forward and one no-grad reference forward."""
    temperature = models.rollout.temperature
    policy = _hidden(models, models.model, batch)
    if policy is not None:
        with torch.no_grad(), models.scoring(reference=True) as ref_model:
            ref = _hidden(models, ref_model, batch)
        if ref is not None:  # the heads applied chunk by chunk: no [b, C, V] tensor
            hidden, head = policy
            logp, entropy = linear_selective_log_softmax(
                hidden, *head, batch.completion_ids.to(hidden.device),
                temperature=temperature, with_entropy=with_entropy,
            )
            return logp, entropy, _full_from_hidden(temperature, policy, ref, terms, mask)
    logits = _logits(models, models.model, batch)
    targets = batch.completion_ids.to(logits.device)
    entropy = None
    if with_entropy:
        logp, entropy = selective_log_softmax_and_entropy(logits, targets)
    else:
        logp = selective_log_softmax(logits, targets)
    ref_logits = no_grad_logits(models, batch, reference=True)
    full_values = {
        t.name: full_divergence(logits, ref_logits, full_potential(t.name, t.regularizer), mask)
        for t in terms
    }
    return logp, entropy, full_values


@torch.no_grad()
def token_full(
    models: PolicyModels, batch: Rollout | None, terms: list[Any], mask: Tensor,
    rows_per_pass: int, *, where: str = "advantage",
) -> dict[str, Tensor]:
    r"""Per ``full`` term, the per-token exact divergence :math:`D^{\text{full}}_{i,t}(\pi_{old}
    \,\|\,\pi_{ref})` ``[N, C]`` of the rollout ``batch`` (detached, 0 where masked), in
    passes of ``rows_per_pass`` rows (the micro-batch; the ``placement: advantage`` penalty;
    ``where`` names the placement in the error for a missing batch)."""
    if batch is None:
        raise ValueError(f"an in-{where} term with estimator 'full' needs the rollout batch")
    parts: dict[str, list[Tensor]] = {t.name: [] for t in terms}
    temperature = models.rollout.temperature
    for rows in _chunks(len(batch), rows_per_pass):
        sub = batch.select(rows)
        m = mask[rows]
        with models.scoring(reference=False) as model:
            old_h = _hidden(models, model, sub)
        with models.scoring(reference=True) as model:
            ref_h = None if old_h is None else _hidden(models, model, sub)
        if old_h is not None and ref_h is not None:  # no [b, C, V] tensor
            for name, d in _full_from_hidden(temperature, old_h, ref_h, terms, m).items():
                parts[name].append(d)
            continue
        old = no_grad_logits(models, sub, reference=False)
        ref = no_grad_logits(models, sub, reference=True)
        for t in terms:
            form = full_potential(t.name, t.regularizer)
            parts[t.name].append(full_divergence(old, ref, form, m))
    return {name: torch.cat(p) for name, p in parts.items()}


@torch.no_grad()
def sequence_full(
    models: PolicyModels, batch: Rollout | None, terms: list[Any], mask: Tensor,
    rows_per_pass: int,
) -> dict[str, Tensor]:
    r"""Per ``full`` term, :math:`S_i = \sum_t m_{i,t} D^{\text{full}}_{i,t}(\pi_{old}\,\|\,
    \pi_{ref})` ``[N]`` of the rollout ``batch`` (detached): :func:`token_full` summed over
    the tokens (the ``placement: reward`` penalty)."""
    per_token = token_full(models, batch, terms, mask, rows_per_pass, where="reward")
    return {name: d.sum(dim=-1) for name, d in per_token.items()}
