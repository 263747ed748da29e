r"""``objective.regularizer.estimator``: the sampled-token estimate or the exact divergence.

* ``sample`` (default): the regularizer's per-token formula on the sampled token's log-probs
  (:mod:`gbmpo.objectives.regularizers`), a Monte-Carlo estimate along the trajectory;
* ``full``: the divergence between the whole next-token distributions at each completion
  position, summed over the vocabulary V
  (docs/methods.md, "Sampled-token and full-vocabulary divergences"):

  .. math::
      D^{\text{full}}_{i,t} = \sum_{v\in V} D_h\big(\pi_\theta(v\mid h_{i,t}),\,
      \pi_{\text{ref}}(v\mid h_{i,t})\big)

  with the potential h of the regularizer's family (:data:`FULL_FORMS`): the KL estimators
  ``kl_k1``, ``kl_k2``, ``kl_k3``, ``kl_k3_is`` all become the exact
  :math:`\mathrm{KL}(\pi_\theta\,\|\,\pi_{\text{ref}}) = \sum_v p_v \log(p_v/q_v)` (h = negative
  entropy; Schulman 2020 for what the sampled forms estimate); ``prob_l2`` becomes
  :math:`\sum_v (p_v - q_v)^2` (h = y², GBMPO arXiv 2602.04380, without a factor ½, as the
  sampled (p_x - q_x)² term); ``neural_mirror`` becomes :math:`\sum_v D_h(p_v, q_v)` with the
  map's h. Computed by :func:`gbmpo.objectives.full_vocab.full_vocab_bregman` in chunks of
  token rows (its memory bound), gradient into the policy logits only.

The other regularizers have no full-vocabulary form here and are refused with ``full``:
``log_l2`` (a squared log-ratio, no Bregman potential over probabilities) and the ``rpg_*``
forms (their anchor may be the rollout policy, whose logits are gone once the policy moves).
``full`` needs the reference's logits, so the term's anchor must be ``ref``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.full_vocab import full_vocab_bregman
from gbmpo.objectives.potentials import NegEntropy, Potential, Square, as_potential

__all__ = [
    "ESTIMATORS",
    "FULL_FORMS",
    "ExactValues",
    "check_estimator",
    "exact_divergence",
    "full_chunk_rows",
    "full_potential",
]

#: ``regularizer.estimator`` values
ESTIMATORS: tuple[str, ...] = ("sample", "full")

_KL = "KL(pi_theta || pi_ref) = sum_v p_v log(p_v / q_v)"

#: regularizer name -> the full-vocabulary divergence its ``full`` estimator computes
FULL_FORMS: dict[str, str] = {
    "kl_k1": _KL,
    "kl_k2": _KL,
    "kl_k3": _KL,
    "kl_k3_is": _KL,
    "prob_l2": "sum_v (p_v - q_v)^2",
    "neural_mirror": "sum_v D_h(p_v, q_v) with the map's h",
}

#: at most this many logits per chunk of rows (16 MB of float32), as the log-prob pass
_CHUNK_ELEMENTS = 1 << 22


def check_estimator(name: str, estimator: str, anchor: str, params: dict[str, Any]) -> None:
    """Raise ``ValueError`` for an estimator the term cannot use: an unknown value, ``full`` for
    a regularizer without a full-vocabulary form (listing those with one), ``full`` with anchor
    ``old``, or a ``clamp`` with ``full`` (the exact value has nothing to clip)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be 'sample' or 'full', got {estimator!r}")
    if estimator == "sample":
        return
    if name not in FULL_FORMS:
        raise ValueError(
            f"estimator 'full' is not available for regularizer {name!r} (no full-vocabulary "
            f"form); regularizers with one: {', '.join(FULL_FORMS)}"
        )
    if anchor != "ref":
        raise ValueError(
            f"estimator 'full' needs the frozen reference's logits: anchor must be 'ref', got "
            f"{anchor!r}"
        )
    if params.get("clamp") is not None:
        raise ValueError(
            f"estimator 'full' computes the exact divergence, which has nothing to clamp; drop "
            f"params.clamp={params['clamp']!r}"
        )


def full_potential(name: str, regularizer: Any) -> Potential:
    """The potential h whose full-vocabulary Bregman divergence the ``full`` estimator of the
    regularizer ``name`` computes (:data:`FULL_FORMS`): negative entropy for the KL family, y²
    for ``prob_l2``, the map itself for ``neural_mirror``."""
    if name in ("kl_k1", "kl_k2", "kl_k3", "kl_k3_is"):
        return NegEntropy()
    if name == "prob_l2":
        return Square()
    if name == "neural_mirror":
        return as_potential(regularizer.params["mirror"])
    raise ValueError(
        f"regularizer {name!r} has no full-vocabulary form; regularizers with one: "
        f"{', '.join(FULL_FORMS)}"
    )


def full_chunk_rows(vocab: int) -> int:
    """Token rows per chunk of the exact divergence: about 4M logits per chunk."""
    return max(1, _CHUNK_ELEMENTS // max(vocab, 1))


def exact_divergence(
    policy_logits: Tensor, ref_logits: Tensor, potential: Potential, mask: Tensor
) -> Tensor:
    r"""Per-position :math:`\sum_v D_h(\mathrm{softmax}(z_\theta)_v,
    \mathrm{softmax}(z_{\text{ref}})_v)` ``[B, T]`` from logits ``[B, T, V]``, 0 at masked
    positions; gradient into ``policy_logits`` only (the reference's are detached). Memory:
    :func:`~gbmpo.objectives.full_vocab.full_vocab_bregman`'s bound, one gradient buffer the
    size of the logits plus a chunk of :func:`full_chunk_rows` rows."""
    return full_vocab_bregman(
        policy_logits,
        ref_logits.detach(),
        potential,
        chunk_size=full_chunk_rows(policy_logits.shape[-1]),
        mask=mask.to(torch.bool),
    )


class ExactValues:
    """Per-token divergence values computed beforehand (by :func:`exact_divergence`), in the
    regularizer call form ``(*, logp, old_logp, ref_logp, mask) -> [B, T]``, so that
    :func:`gbmpo.objectives.compute_policy_loss` adds, aggregates and logs them like a
    sampled-token term (``needs_ref`` False: the reference entered through its logits)."""

    needs_ref = False

    def __init__(self, name: str, values: Tensor) -> None:
        self.name = name
        self.values = values

    def __repr__(self) -> str:
        return f"ExactValues({self.name!r})"

    def __call__(
        self,
        *,
        logp: Tensor,
        old_logp: Tensor | None = None,
        ref_logp: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        if tuple(self.values.shape) != tuple(logp.shape):
            raise ValueError(
                f"exact {self.name!r} values have shape {tuple(self.values.shape)}, logp "
                f"{tuple(logp.shape)}"
            )
        return self.values
