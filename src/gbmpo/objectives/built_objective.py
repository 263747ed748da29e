"""What an objective spec names, built: :class:`BuiltObjective` and its :class:`BuiltTerm` s.

Made by :meth:`gbmpo.objectives.spec.ObjectiveSpec.build` (which checks the spec) and used as
is by every engine; :mod:`gbmpo.objectives.spec` re-exports both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gbmpo.objectives.drift_control import DriftControl
from gbmpo.objectives.spec_values import SpecError

__all__ = ["BuiltObjective", "BuiltTerm", "SourceSpec"]


class SourceSpec(Protocol):
    """What is read back from the spec a :class:`BuiltObjective` was built from (an
    :class:`gbmpo.objectives.spec.ObjectiveSpec`, which builds it, hence no import of it here)."""

    #: the surrogate's spec (``name``, ``params``)
    surrogate: Any
    monitor_regularizers: bool

    @property
    def regularizer_label(self) -> str: ...


@dataclass(frozen=True)
class BuiltTerm:
    """One built regularizer term: ``coef * D`` per token in the loss (``placement == "loss"``),
    ``coef * sum_t D(pi_old || pi_ref)`` off each sequence's reward (``"reward"``) or
    ``coef * sum_{s >= t} D_s(pi_old || pi_ref)`` off each token's normalised advantage
    (``"advantage"``)."""

    name: str
    #: ``(*, logp, old_logp, anchor_logp, mask) -> per-token divergence``
    regularizer: Any
    coef: float
    #: ``ref`` (frozen reference) or ``old`` (the rollout policy)
    anchor: str
    #: ``loss``, ``reward`` or ``advantage``
    placement: str = "loss"
    #: ``sample`` (the formula on the sampled token) or ``full`` (the exact divergence over the
    #: vocabulary, :mod:`gbmpo.objectives.estimators`)
    estimator: str = "sample"
    #: the controller of a controlled coefficient (``coef`` is then the current value, set by
    #: the engine with :meth:`BuiltObjective.with_coefs`), else ``None``
    control: DriftControl | None = None

    @property
    def active(self) -> bool:
        """Whether the term changes the objective (a regularizer other than ``none`` with a
        nonzero coefficient)."""
        return self.name != "none" and self.coef != 0

    @property
    def needs_ref(self) -> bool:
        """Whether the term needs the reference policy's log-probs."""
        return bool(getattr(self.regularizer, "needs_ref", True)) and self.anchor == "ref"


@dataclass(frozen=True)
class BuiltObjective:
    """What an :class:`ObjectiveSpec` names, built once and used as is by every engine (the own
    trainer, ``GBMPOTrainer`` and the verl plugin): the advantage function, the surrogate, the
    regularizer terms (one regularizer is a list of one), the aggregation mode's name and the
    regularizers monitored as ``reg/<name>``."""

    #: the :class:`gbmpo.objectives.spec.ObjectiveSpec` this was built from
    spec: SourceSpec
    #: ``(rewards [N], group_size) -> advantages [N]`` from ``ADVANTAGES``
    advantage: Any
    #: ``(logp, old_logp, advantages, mask) -> (per-token loss, diagnostics)``
    surrogate: Any
    #: every regularizer term, each with its regularizer object, coefficient, anchor, placement
    #: and estimator; a single ``regularizer:`` mapping is a tuple of one
    terms: tuple[BuiltTerm, ...]
    aggregation: str
    #: the regularizers logged as ``reg/<name>`` = D(pi_old || pi_ref): the optimised ones (the
    #: same objects) and, with ``monitor_regularizers``, every registered one but ``none``
    monitors: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.terms or not all(isinstance(t, BuiltTerm) for t in self.terms):
            raise SpecError(
                f"BuiltObjective.terms must be a non-empty tuple of BuiltTerm, got {self.terms!r}"
            )
        object.__setattr__(self, "terms", tuple(self.terms))

    @property
    def loss_terms(self) -> tuple[BuiltTerm, ...]:
        """The terms added to the loss per token (placement ``loss``)."""
        return tuple(t for t in self.terms if t.placement == "loss")

    @property
    def reward_terms(self) -> tuple[BuiltTerm, ...]:
        """The active terms subtracted from the reward (placement ``reward``, nonzero coef)."""
        return tuple(t for t in self.terms if t.placement == "reward" and t.active)

    @property
    def advantage_terms(self) -> tuple[BuiltTerm, ...]:
        """The active terms whose future penalty is subtracted from the normalised advantages
        (placement ``advantage``, nonzero coef)."""
        return tuple(t for t in self.terms if t.placement == "advantage" and t.active)

    @property
    def full_loss_terms(self) -> tuple[BuiltTerm, ...]:
        """The terms placed in the loss with ``estimator: full`` (the exact divergence over the
        vocabulary, from the policy's and the reference's logits of each micro-batch)."""
        return tuple(t for t in self.loss_terms if t.estimator == "full")

    @property
    def needs_ref(self) -> bool:
        """Whether the reference policy's log-probs are needed: a term is anchored on it, a
        controller reads a divergence from it, or every regularizer is monitored against it."""
        return (any(t.needs_ref or t.control is not None for t in self.terms)
                or self.spec.monitor_regularizers)

    @property
    def controlled(self) -> tuple[BuiltTerm, ...]:
        """The terms whose coefficient is controlled (``control`` set)."""
        return tuple(t for t in self.terms if t.control is not None)

    def with_coefs(self, coefs: Mapping[str, float]) -> BuiltObjective:
        """This objective with the coefficients of the terms named in ``coefs`` replaced (the
        engines' step from a controller's state to the objective of the next step)."""
        terms = tuple(replace(t, coef=float(coefs[t.name])) if t.name in coefs else t
                      for t in self.terms)  # fmt: skip
        return replace(self, terms=terms)

    @property
    def anchored_on_ref(self) -> bool:
        """Whether an optimised term needs the reference's log-probs (a nonzero coefficient on
        a regularizer anchored on the frozen reference): TRL's ``beta != 0``."""
        return any(t.active and t.needs_ref for t in self.terms)
