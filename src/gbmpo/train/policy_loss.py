"""The own trainer's policy loss of one micro-batch (:func:`policy_loss`): the objective's
terms placed in the loss, each with its anchor's log-probs, handed to
:func:`gbmpo.objectives.compute_policy_loss` with the mini-batch's normalisers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from gbmpo.objectives.loss import compute_policy_loss_packed, loss_terms, unpack_metrics

if TYPE_CHECKING:
    from gbmpo.train.trainer import Trainer

__all__ = ["policy_loss", "policy_loss_packed"]


def policy_loss(
    tr: Trainer,
    logp: Tensor,
    old: Tensor | None,
    anchors: dict[str, Tensor | None],
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    num_tokens: float,
    *,
    full_values: dict[str, Tensor] | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The configured objective (:func:`gbmpo.objectives.compute_policy_loss`) of one
    micro-batch, normalised as its mini-batch: the surrogate plus the terms placed in the loss
    (:func:`gbmpo.objectives.loss.loss_terms`), each with its anchor's log-probs (``anchors``:
    ``ref`` / ``old``); ``full_values``: the per-token values of the terms with ``estimator:
    full``, by name, used instead of their sampled-token formulas; ``token_weights``: constants
    multiplying the surrogate per token, the rollout correction."""
    loss, packed, layout = policy_loss_packed(
        tr, logp, old, anchors, advantages, mask, num_sequences, num_tokens,
        full_values=full_values, token_weights=token_weights,
    )  # fmt: skip
    return loss, unpack_metrics(packed.tolist(), layout)


def policy_loss_packed(
    tr: Trainer,
    logp: Tensor,
    old: Tensor | None,
    anchors: dict[str, Tensor | None],
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    num_tokens: float,
    *,
    full_values: dict[str, Tensor] | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Any]:
    """:func:`policy_loss` with its metrics left on the device: ``(loss, packed, layout)``
    (:func:`gbmpo.objectives.loss.compute_policy_loss_packed`), so that the micro-batch loop
    reads nothing back."""
    o = tr.objective
    return compute_policy_loss_packed(
        logp=logp, old_logp=old, advantages=advantages, mask=mask, surrogate=o.surrogate,
        terms=loss_terms(o.terms, anchors, full_values), aggregation=o.aggregation,
        max_len=tr.config.rollout.max_new_tokens, num_sequences=num_sequences,
        num_tokens=num_tokens, token_weights=token_weights,
    )  # fmt: skip
