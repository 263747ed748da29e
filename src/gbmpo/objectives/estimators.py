r"""``objective.regularizer.estimator``: the sampled-token estimate or the exact divergence.

* ``sample`` (default): the regularizer's per-token formula on the sampled token's log-probs
  (:mod:`gbmpo.objectives.regularizers`), a Monte-Carlo estimate along the trajectory;
* ``full``: the divergence between the whole next-token distributions at each completion
  position, summed over the vocabulary V
  (docs/methods.md, "Sampled-token and full-vocabulary divergences"), which the regularizer
  declares itself (:attr:`Regularizer.full <gbmpo.objectives.regularizers.Regularizer>`):

  .. math::
      D^{\text{full}}_{i,t} = \sum_{v\in V} D_h\big(\pi_\theta(v\mid h_{i,t}),\,
      \pi_{\text{ref}}(v\mid h_{i,t})\big)

  for a separable potential h (a Bregman form), or any function of the two log-softmax rows
  (a :class:`~gbmpo.objectives.full_vocab.RowDivergence`, e.g. the f-divergences). The KL
  estimators ``kl_k1``, ``kl_k2``, ``kl_k3``, ``kl_k3_is``, ``kl_k1_st``, ``kl_k3_st`` all become
  the exact :math:`\mathrm{KL}(\pi_\theta\,\|\,\pi_{\text{ref}}) = \sum_v p_v \log(p_v/q_v)`
  (h = negative entropy; Schulman 2020 for what the sampled forms estimate); ``prob_l2``
  becomes :math:`\sum_v (p_v - q_v)^2` (h = y², GBMPO arXiv 2602.04380, without a factor ½, as
  the sampled (p_x - q_x)² term); ``neural_mirror`` becomes :math:`\sum_v D_h(p_v, q_v)` with the
  map's h; ``fkl``, ``js``, ``chi2``, ``hellinger``, ``tv``, ``alpha``, ``kl_chi2`` become their
  f-divergence summed over the vocabulary (:mod:`gbmpo.objectives.f_divergences`). Computed by
  :func:`gbmpo.objectives.full_vocab.full_vocab_bregman` in chunks of token rows (its memory
  bound), gradient into the policy logits only. :func:`full_vocab_divergence` evaluates any of
  them by name from two logits tensors.

Regularizers without a full-vocabulary form are refused with ``full``: ``log_l2`` (a squared
log-ratio, no Bregman potential over probabilities) and the ``rpg_*`` forms (their anchor may
be the rollout policy, whose logits are gone once the policy moves); a plugin regularizer
declares its own (``Regularizer(..., full=...)``). ``full`` needs the reference's logits, so the
term's anchor must be ``ref``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gbmpo.objectives.full_vocab import RowDivergence, full_vocab_bregman
from gbmpo.objectives.potentials import Potential
from gbmpo.objectives.regularizers import REGULARIZERS, get_regularizer

__all__ = [
    "ESTIMATORS",
    "FullValues",
    "check_estimator",
    "full_divergence",
    "full_chunk_rows",
    "full_forms",
    "full_potential",
    "full_vocab_divergence",
]

#: ``regularizer.estimator`` values
ESTIMATORS: tuple[str, ...] = ("sample", "full")

def full_forms() -> dict[str, str]:
    """Registered regularizer name -> the exact full-vocabulary divergence its ``full``
    estimator computes, for every regularizer that declares one (built with its default
    parameters; plugins included)."""
    out: dict[str, str] = {}
    for name in REGULARIZERS.names():
        try:
            reg = get_regularizer(name)
        except Exception:  # noqa: BLE001 - a plugin needing parameters: not listed here
            continue
        if getattr(reg, "full", None) is not None:
            out[name] = str(reg.full_description or reg.full)
    return out


#: at most this many logits per chunk of rows (16 MB of float32), as the log-prob pass
_CHUNK_ELEMENTS = 1 << 22


def check_estimator(
    name: str, estimator: str, anchor: str, params: dict[str, Any], regularizer: Any = None
) -> None:
    """Raise ``ValueError`` for an estimator the term cannot use: an unknown value, ``full`` for
    a regularizer that declares no full-vocabulary form (listing those with one), ``full`` with
    anchor ``old``, or a ``clamp`` with ``full`` (the exact value has nothing to clip).
    ``regularizer``: the built regularizer (default: ``name`` built with ``params``)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be 'sample' or 'full', got {estimator!r}")
    if estimator == "sample":
        return
    if regularizer is None:
        regularizer = get_regularizer(name, **params)
    if getattr(regularizer, "full", None) is None:
        raise ValueError(
            f"estimator 'full' is not available for regularizer {name!r} (it declares no "
            f"full-vocabulary form); regularizers with one: {', '.join(full_forms())}"
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


def full_potential(name: str, regularizer: Any) -> Potential | RowDivergence:
    """The exact form (a potential h, or a :class:`RowDivergence`) that the regularizer
    declares (``regularizer.full``; ``regularizer`` None: ``name`` built with its defaults);
    ``ValueError`` naming the regularizers with one if it declares none."""
    if regularizer is None:
        regularizer = get_regularizer(name)
    form = getattr(regularizer, "full", None)
    if form is None:
        raise ValueError(
            f"regularizer {name!r} has no full-vocabulary form; regularizers with one: "
            f"{', '.join(full_forms())}"
        )
    return form  # type: ignore[no-any-return]


def full_chunk_rows(vocab: int) -> int:
    """Token rows per chunk of the exact divergence: about 4M logits per chunk."""
    return max(1, _CHUNK_ELEMENTS // max(vocab, 1))


def full_divergence(
    policy_logits: Tensor, ref_logits: Tensor, potential: Potential | RowDivergence,
    mask: Tensor,
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


def full_vocab_divergence(
    name: str,
    logits: Tensor,
    ref_logits: Tensor,
    *,
    mask: Tensor | None = None,
    **params: Any,
) -> Tensor:
    r"""The exact divergence of the regularizer ``name`` between the whole next-token
    distributions, per position: ``[B, T]`` from logits ``[B, T, V]``
    (:math:`\sum_v` over the vocabulary of what its ``estimator: full`` computes; e.g.
    ``full_vocab_divergence("js", logits, ref_logits)``, ``("alpha", ..., alpha=0.3)``).

    ``params`` are the regularizer's (``alpha``, ``weight``, ``mirror``); ``mask`` [B, T] zeroes
    positions (value and gradient). Chunked as the ``full`` estimator (about 4M logits per chunk;
    gradient into ``logits`` only, stored during the forward). Float32 math (float64 stays).
    ``ValueError`` for a regularizer without a full-vocabulary form (listing those with one)."""
    reg = get_regularizer(name, **params)
    form = full_potential(name, reg)
    if logits.shape != ref_logits.shape or logits.dim() < 2:
        raise ValueError(
            f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} must have "
            "the same shape [..., V]"
        )
    keep = (
        torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)
        if mask is None else mask
    )
    return full_divergence(logits, ref_logits, form, keep)


def __getattr__(attr: str) -> Any:
    # FULL_FORMS: the registered regularizers with a full form (computed: plugins declare their
    # own), kept under its former name
    if attr == "FULL_FORMS":
        return full_forms()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


class FullValues:
    """Per-token divergence values computed beforehand (by :func:`full_divergence`), in the
    regularizer call form ``(*, logp, old_logp, anchor_logp, mask) -> [B, T]``, so that
    :func:`gbmpo.objectives.compute_policy_loss` adds, aggregates and logs them like a
    sampled-token term (``needs_ref`` False: the reference entered through its logits)."""

    needs_ref = False

    def __init__(self, name: str, values: Tensor) -> None:
        self.name = name
        self.values = values

    def __repr__(self) -> str:
        return f"FullValues({self.name!r})"

    def __call__(
        self,
        *,
        logp: Tensor,
        old_logp: Tensor | None = None,
        anchor_logp: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        if tuple(self.values.shape) != tuple(logp.shape):
            raise ValueError(
                f"exact {self.name!r} values have shape {tuple(self.values.shape)}, logp "
                f"{tuple(logp.shape)}"
            )
        return self.values
