r"""The full policy loss: (weighted) surrogate + the regularizer terms per token, then
aggregation.

.. math::
    \mathcal L = \mathrm{agg}\big(\omega_{i,t}\,\ell^{\text{surr}}_{i,t}
    + \textstyle\sum_k \lambda_k\,D^{(k)}_{i,t},\ m\big)

(GBMPO adds the regularizer per token before aggregation, as TRL does with its KL term;
docs/methods.md, sections "Aggregation" and "GBMPO regularizers"). The optional token weights
:math:`\omega` (default 1) multiply the surrogate only, as TRL 1.16 applies its vLLM
importance-sampling ratio, off-policy mask and high-entropy mask before adding
:math:`\beta\,\mathrm{KL}`. Surrogates come from :mod:`gbmpo.objectives.surrogates`, regularizers
from :mod:`gbmpo.objectives.regularizers`, aggregation modes from :mod:`gbmpo.objectives.aggregate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gbmpo.objectives.aggregate import check_max_len, normalisers
from gbmpo.objectives.estimators import FullValues
from gbmpo.objectives.regularizers import Regularizer, get_regularizer
from gbmpo.objectives.surrogates import Surrogate, get_surrogate
from gbmpo.objectives.tensors import compute_dtype, float_mask, masked_mean

if TYPE_CHECKING:
    from gbmpo.objectives.spec import BuiltTerm

__all__ = [
    "LossTerm",
    "compiled_policy_loss",
    "compute_policy_loss",
    "compute_policy_loss_packed",
    "loss_terms",
    "reward_penalty",
    "sequence_divergence",
    "unpack_metrics",
]

#: what a loss term evaluates: a :class:`~gbmpo.objectives.regularizers.Regularizer`, or any
#: callable with its call signature (per-token values ``[B, T]``; attribute ``needs_ref``)
RegularizerLike = Regularizer | Callable[..., Tensor]


@dataclass(frozen=True)
class LossTerm:
    """One regularizer term of a sum: ``coef * regularizer(logp=, old_logp=, anchor_logp=,
    mask=)`` per token, with its own anchor log-probs (``None`` where the regularizer needs
    none). Engines build them from the built objective with :func:`loss_terms`."""

    name: str
    #: a regularizer object, any callable with its call signature, or a registered name
    regularizer: RegularizerLike | str
    #: a number, or a 0-dim floating tensor (a controlled coefficient: a compiled loss reads
    #: it as an input, so it does not compile again when the value moves)
    coef: float | Tensor
    anchor_logp: Tensor | None = None


def loss_terms(
    terms: Sequence[BuiltTerm],
    anchors: Mapping[str, Tensor | None],
    full_values: Mapping[str, Tensor] | None = None,
) -> list[LossTerm]:
    """The :class:`LossTerm` of each built term placed in the loss (``placement: loss``), as
    built, with its anchor's log-probs: the one step from a built objective's terms
    (:class:`~gbmpo.objectives.spec.BuiltTerm`, whose ``coef`` the spec parsed) to the
    :func:`compute_policy_loss` that multiplies them, shared by every engine.

    ``anchors``: the log-probs of each anchor (``ref``: the frozen reference, ``None`` where not
    computed; ``old``: the rollout policy); ``full_values``: the per-token values of the terms
    with ``estimator: full`` by name (:class:`~gbmpo.objectives.estimators.FullValues`, used
    instead of the sampled-token formula). A switched-off term (coefficient 0) whose anchor
    log-probs were not computed is left out; an active one is a ``ValueError`` naming it. A
    controlled coefficient (``t.control``) is passed as a 0-dim float64 tensor."""
    full_values = full_values or {}
    out: list[LossTerm] = []
    for t in terms:
        if t.placement != "loss":
            continue
        coef = t.coef if t.control is None else torch.tensor(t.coef, dtype=torch.float64)
        if t.name in full_values:
            out.append(LossTerm(t.name, FullValues(t.name, full_values[t.name]), coef))
            continue
        if t.anchor not in anchors:
            raise ValueError(f"term {t.name!r} is anchored on {t.anchor!r}: no such anchor given")
        anchor_logp = anchors[t.anchor]
        if anchor_logp is None and t.needs_ref:
            if t.active:
                raise ValueError(
                    f"term {t.name!r} is anchored on {t.anchor!r}, whose log-probs were not "
                    "computed"
                )
            continue
        out.append(LossTerm(t.name, t.regularizer, coef, anchor_logp))
    return out


def sequence_divergence(
    regularizer: RegularizerLike, *, rollout_logp: Tensor, ref_logp: Tensor | None, mask: Tensor
) -> Tensor:
    r"""Per-sequence divergence of the rollout, detached:
    :math:`S_i = \sum_t m_{i,t}\, D_{i,t}(\pi_{old}\,\|\,\pi_{ref})` (``[B]``), the
    regularizer evaluated with :math:`\log\pi_\theta = \log\pi_{old}` on the sampled tokens.

    For ``kl_k1`` (:math:`D = \log\pi_{old} - \log\pi_{ref}`), :math:`S_i` is the sequence
    log-ratio, whose expectation is :math:`\mathrm{KL}(\pi_{old}\,\|\,\pi_{ref})` of the whole
    sequence; used as a reward penalty it gives the exact gradient of
    :math:`\mathbb E[r] - \beta\,\mathrm{KL}` (docs/methods.md, "Where the divergence goes";
    verl's ``algorithm.use_kl_in_reward``; Ziegler et al. 2019, arXiv 1909.08593).
    """
    with torch.no_grad():
        old = rollout_logp.detach()
        ref = None if ref_logp is None else ref_logp.detach()
        values = regularizer(logp=old, old_logp=old, anchor_logp=ref, mask=mask)
        m = mask.to(torch.bool)
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        return torch.where(m, values, zero).sum(dim=-1)


def reward_penalty(rewards: Tensor, penalties: Sequence[tuple[float, Tensor]]) -> Tensor:
    r"""Rewards with the in-reward divergence penalties subtracted, before advantages:

    .. math::
        \tilde r_i = r_i - \sum_k \beta_k\, S^{(k)}_i,
        \qquad S^{(k)}_i = \sum_t m_{i,t}\, D^{(k)}_{i,t}(\pi_{old}\,\|\,\pi_{ref})

    ``penalties`` holds ``(beta_k, S^(k))`` pairs (``S`` from :func:`sequence_divergence`). The
    outcome reward sits at the last token, so this per-sequence sum equals verl's token-level
    ``token_level_scores - beta * kld`` summed over the sequence (``apply_kl_penalty``). Returns
    ``rewards``' dtype.
    """
    out = rewards
    for beta, seq in penalties:
        out = out - beta * seq.to(rewards.dtype)
    return out


def _resolve_regularizer(regularizer: str | RegularizerLike) -> RegularizerLike:
    if callable(regularizer):
        return regularizer
    if isinstance(regularizer, str):
        return get_regularizer(regularizer)
    raise TypeError(f"regularizer must be a name or a callable, got {regularizer!r}")


def _resolve_surrogate(surrogate: str | Surrogate) -> Surrogate:
    if isinstance(surrogate, str):
        return get_surrogate(surrogate)
    if callable(surrogate):
        return surrogate
    raise TypeError(f"surrogate must be a name or a callable, got {surrogate!r}")


def _valid_weights(weights: Tensor, mask: Tensor, pg: Tensor) -> Tensor:
    """``weights`` ([B, T] or [B, 1]) as ``pg``'s dtype, broadcast to [B, T], 0 where masked."""
    if not isinstance(weights, Tensor):
        raise TypeError(f"token_weights must be a Tensor or None, got {type(weights).__name__}")
    b, t = pg.shape
    if weights.dim() != 2 or weights.shape[0] != b or weights.shape[1] not in (1, t):
        raise ValueError(
            f"token_weights must be [B, T]=[{b}, {t}] or [B, 1]=[{b}, 1], got shape "
            f"{tuple(weights.shape)}"
        )
    if weights.is_complex():
        raise ValueError("token_weights must be real, got a complex tensor")
    w = weights.to(device=pg.device, dtype=pg.dtype).expand(b, t)
    return torch.where(mask.to(torch.bool), w, torch.zeros((), dtype=pg.dtype, device=pg.device))


def compute_policy_loss(
    *,
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    surrogate: str | Surrogate,
    terms: Sequence[LossTerm] = (),
    aggregation: str = "dr_grpo",
    max_len: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r""":math:`\mathcal L = \mathrm{agg}(\omega\,\ell^{\text{surr}} + \sum_k \lambda_k D^{(k)}, m)`
    (docs/methods.md, "Aggregation"); :math:`\omega` (``token_weights``, default 1) scales the
    surrogate only, as TRL 1.16 applies its importance ratio and masks before adding its KL.

    ``logp`` / ``old_logp`` ``[B, T]`` (``None``: on-policy), ``advantages`` ``[B]`` or
    ``[B, T]``, ``mask`` {0, 1}; ``terms`` :class:`LossTerm` s (a zero coefficient reports the
    term without adding it); ``aggregation`` and its normalisers as
    :func:`~gbmpo.objectives.aggregate`; ``token_weights`` ``[B, T]`` or ``[B, 1]`` constants,
    ignored where masked.
    Returns the scalar loss (float32; float64 for float64 ``logp``) and float metrics (the
    surrogate's diagnostics, ``pg_loss``, ``reg_loss[/<name>]``, ``reg_value[/<name>]``, ``loss``).
    """
    loss, packed, layout = _policy_loss(
        logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, surrogate=surrogate,
        terms=terms, aggregation=aggregation, max_len=max_len, num_sequences=num_sequences,
        num_tokens=num_tokens, token_weights=token_weights,
    )  # fmt: skip
    return loss, _metric_dict(packed.tolist(), layout)


def compute_policy_loss_packed(**kwargs: Any) -> tuple[Tensor, Tensor, Any]:
    """:func:`compute_policy_loss` (the same keyword arguments) with its metrics left on the
    device: ``(loss, packed float64 metrics, layout)``; :func:`unpack_metrics` of
    ``packed.tolist()`` and ``layout`` is its metrics dict. For a caller that reads the metrics
    of several micro-batches back at once, after its loop (nothing in the loop waits on the
    host for them)."""
    return _policy_loss(**kwargs)


def unpack_metrics(values: list[float], layout: Any) -> dict[str, float]:
    """The metrics dict of :func:`compute_policy_loss` from the values of a
    :func:`compute_policy_loss_packed` tensor and its layout."""
    return _metric_dict(values, layout)


#: signature of :func:`compute_policy_loss` (keyword arguments)
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]


def compiled_policy_loss(**compile_options: Any) -> PolicyLossFn:
    """:func:`compute_policy_loss` (same arguments and results) with its tensor work compiled
    by ``torch.compile(**compile_options)`` into one graph, forward and backward: the same loss
    and gradient up to the compiler's rounding (a fused kernel may reorder a sum).

    The checks that read values (the {0, 1} mask, ``max_len``) run eagerly before the graph and
    the metrics are read back after it in one transfer. Each new surrogate, term list or shape
    may compile again (seconds; one cache of ``torch._dynamo.config.recompile_limit`` graphs per
    process, eager beyond it): build it once and reuse it,
    ``policy_loss = compiled_policy_loss(); loss, metrics = policy_loss(logp=..., ...)``.
    """
    core = torch.compile(_policy_loss, **compile_options)

    def policy_loss(
        *,
        logp: Tensor,
        old_logp: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        surrogate: str | Surrogate,
        terms: Sequence[LossTerm] = (),
        aggregation: str = "dr_grpo",
        max_len: int | None = None,
        num_sequences: int | None = None,
        num_tokens: float | None = None,
        token_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        if logp.dim() == 2:  # the checks that read values, before the graph
            mask = float_mask(mask, logp.shape, compute_dtype(logp))
            if isinstance(max_len, int) and not isinstance(max_len, bool):
                check_max_len(mask.sum(-1), max_len)
        loss, packed, layout = core(
            logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
            surrogate=surrogate, terms=terms, aggregation=aggregation, max_len=max_len,
            num_sequences=num_sequences, num_tokens=num_tokens, token_weights=token_weights,
        )  # fmt: skip
        return loss, _metric_dict(packed.tolist(), layout)

    policy_loss.__doc__ = compiled_policy_loss.__doc__
    return policy_loss


#: the metrics' layout: the surrogate's diagnostic names, the term names, which terms are in the
#: loss (a nonzero coefficient)
_Layout = tuple[tuple[str, ...], tuple[str, ...], tuple[bool, ...]]


def _in_loss(coef: float | Tensor) -> bool:
    """Whether a term adds to the loss: a nonzero number, or a tensor (a controlled coefficient,
    kept in ``[min, max]`` with ``min > 0``: never zero, and never read back to the host)."""
    return isinstance(coef, Tensor) or coef != 0


def _policy_loss(
    *,
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    surrogate: str | Surrogate,
    terms: Sequence[LossTerm],
    aggregation: str,
    max_len: int | None,
    num_sequences: int | None,
    num_tokens: float | None,
    token_weights: Tensor | None,
) -> tuple[Tensor, Tensor, _Layout]:
    """:func:`compute_policy_loss` up to its metrics, kept as one float64 tensor (their
    :func:`_metric_dict` layout alongside): the part :func:`compiled_policy_loss` compiles."""
    surr = _resolve_surrogate(surrogate)
    if isinstance(terms, LossTerm) or not all(isinstance(t, LossTerm) for t in terms):
        raise TypeError(f"terms must be a sequence of LossTerm, got {terms!r}")
    if old_logp is None:
        old_logp = logp.detach()
    if logp.dim() == 2:
        # checked once here; the surrogate, the regularizers and the aggregation skip the check
        # of this same tensor
        mask = float_mask(mask, logp.shape, compute_dtype(logp))
    resolved = [(term, _check_term(term)) for term in terms]
    pg, diag = surr(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if token_weights is not None:
        pg = pg * _valid_weights(token_weights, mask, pg)
    norm = normalisers(pg, mask, aggregation, max_len, num_sequences=num_sequences,
                       num_tokens=num_tokens)  # fmt: skip
    per_token = pg
    values: list[Tensor] = []
    reg_parts: list[Tensor | None] = []
    for term, reg in resolved:
        with torch.set_grad_enabled(torch.is_grad_enabled() and _in_loss(term.coef)):
            v = reg(logp=logp, old_logp=old_logp, anchor_logp=term.anchor_logp, mask=mask)
        if tuple(v.shape) != tuple(pg.shape):
            raise ValueError(
                f"regularizer returned shape {tuple(v.shape)}, expected {tuple(pg.shape)}"
            )
        values.append(v)
        part = None
        if _in_loss(term.coef):
            per_token = per_token + term.coef * v.to(pg.dtype)
            with torch.no_grad():  # each term on its own: a small one is not lost to rounding
                part = norm.apply(term.coef * v.detach().to(pg.dtype))
        reg_parts.append(part)
    loss = norm.apply(per_token)
    with torch.no_grad():
        scalars = [*diag.values(), norm.apply(pg.detach())]
        scalars += [masked_mean(v, mask) for v in values]
        scalars += [p for p in reg_parts if p is not None]
        scalars.append(loss.detach())
        packed = torch.stack([t.to(torch.float64) for t in scalars])
    layout = (tuple(diag), tuple(t.name for t in terms), tuple(p is not None for p in reg_parts))
    return loss, packed, layout


def _check_term(term: LossTerm) -> RegularizerLike:
    """The term's regularizer, resolved, after checking its coefficient and anchor."""
    if isinstance(term.coef, Tensor):
        if term.coef.dim() != 0 or not term.coef.is_floating_point():
            raise ValueError(f"term {term.name!r}: a tensor coef must be a 0-dim float, got "
                             f"{term.coef.dtype} of shape {tuple(term.coef.shape)}")
    elif isinstance(term.coef, bool) or not isinstance(term.coef, (int, float)) \
            or not math.isfinite(term.coef):  # fmt: skip
        raise ValueError(f"term {term.name!r}: coef must be a finite number, got {term.coef!r}")
    r = _resolve_regularizer(term.regularizer)
    needs_ref = bool(getattr(r, "needs_ref", True))
    if needs_ref and term.anchor_logp is None:
        raise ValueError(
            f"term {term.name!r}: regularizer {r!r} needs anchor log-probs but "
            "anchor_logp is None"
        )
    return r


def _metric_dict(floats: list[float], layout: _Layout) -> dict[str, float]:
    """The metrics dict of :func:`compute_policy_loss` from :func:`_policy_loss`' values; sums
    in python floats, in term order."""
    diag_keys, names, in_loss = layout
    it = iter(floats)
    metrics = {k: next(it) for k in diag_keys}
    metrics["pg_loss"] = next(it)
    term_values = [next(it) for _ in names]
    term_losses = [next(it) if part else 0.0 for part in in_loss]
    metrics["reg_loss"] = _sum_in_order(term_losses)
    metrics["reg_value"] = _sum_in_order(term_values)
    for name, value, term_loss in zip(names, term_values, term_losses, strict=True):
        metrics[f"reg_loss/{name}"] = term_loss
        metrics[f"reg_value/{name}"] = value
    metrics["loss"] = next(it)
    return metrics


def _sum_in_order(xs: list[float]) -> float:
    """``0.0 + x_1 + x_2 + ...`` in python floats, in order (as the metrics always summed)."""
    out = 0.0
    for x in xs:
        out += x
    return out
