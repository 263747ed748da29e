"""The objective spec: the one way to name a GRPO-family objective, read by every engine.

An objective is advantages -> per-token surrogate + coef * regularizer -> aggregation::

    objective:
      advantage: dr_grpo             # ADVANTAGES: grpo | batch | dr_grpo | rpg
      surrogate:
        name: atr                    # SURROGATES: clip | gspo | atr | rpg_clip | rpg_reinforce
        params: {delta: 0.02}
      regularizer:
        name: prob_l2                # REGULARIZERS: kl_k3, prob_l2, neural_mirror, rpg_*, none
        coef: 0.1
        anchor: ref                  # ref (frozen reference) | old (rollout policy, RPG)
        placement: loss              # loss (per-token term) | reward (penalty before advantages)
                                     # | advantage (future penalty after normalisation)
        estimator: sample            # sample (sampled token) | full (exact, whole vocabulary)
        params: {}
        control: null                # {target: 0.02, measure: kl, horizon: 10}: coef (then the
                                     # first step's) moves so that the drift tracks the target
      aggregation: dr_grpo           # AGGREGATIONS: grpo | bnpo | dr_grpo | seq_mean_token_sum
      rollout_correction:            # sampler vs trainer log-probs (off by default everywhere)
        mode: none                   # ROLLOUT_CORRECTIONS: none | tis | mis | icepop
        level: token                 # token | sequence
        low: null                    # lower bound of the ratio (icepop: required)
        high: 2.0                    # upper bound (tis cap / mis, icepop mask)
        off_policy_mask_threshold: null   # DeepSeek-V3.2 off-policy sequence mask, delta

``regularizer:`` is one term (a mapping) or a list of terms, whose divergences are summed
(e.g. ``[{name: prob_l2, coef: 0.05}, {name: kl_k3, coef: 0.01}]``); each term has its own
coefficient, anchor, placement, estimator and parameters, and two terms may not share a name.

The same section is the ``objective:`` of ``gbmpo train``'s config (``TrainConfig.objective`` is
an :class:`ObjectiveSpec`), the ``objective=`` of the TRL drop-in
(``gbmpo.integrations.trl.GBMPOConfig``) and what ``gbmpo train --engine verl`` turns into
verl's overrides. :meth:`ObjectiveSpec.load` reads a dict, a YAML file (either the section
itself or a whole config holding an ``objective:`` key) or a spec; :meth:`ObjectiveSpec.check`
checks every name against its registry (unknown names list the valid ones) and builds the
surrogate and regularizer once, so a bad parameter is reported before anything runs.

This module imports the registries of ``gbmpo.objectives`` (and ``gbmpo.registry``), nothing
above them.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from gbmpo.objectives.advantages import ADVANTAGES
from gbmpo.objectives.aggregate import AGGREGATIONS
from gbmpo.objectives.drift_control import DriftControl
from gbmpo.objectives.estimators import check_estimator
from gbmpo.objectives.regularizers import REGULARIZERS, get_regularizer
from gbmpo.objectives.rollout_correction import check_correction
from gbmpo.objectives.surrogates import get_surrogate
from gbmpo.registry import UnknownNameError

__all__ = [
    "ANCHORS",
    "PLACEMENTS",
    "FORMER_KEYS",
    "BuiltObjective",
    "BuiltTerm",
    "ObjectiveSpec",
    "RegularizerSpec",
    "RolloutCorrectionSpec",
    "SpecError",
    "SurrogateSpec",
    "parse_coefficient",
    "parse_number",
    "refuse_former_keys",
]

#: Former names of objective settings -> the one name that replaces each: refused (a
#: :class:`SpecError` naming the replacement), not read as aliases.
FORMER_KEYS: dict[str, str] = {
    "monitor_reference": "monitor_regularizers",
    "log_all_regularizers": "monitor_regularizers",
}

#: ``regularizer.anchor`` values.
ANCHORS: tuple[str, ...] = ("ref", "old")

#: ``regularizer.placement`` values: ``loss`` adds ``coef * D`` per token to the loss;
#: ``reward`` subtracts ``coef * sum_t D(pi_old || pi_ref)`` from each sequence's reward before
#: the advantages are computed; ``advantage`` subtracts the future penalty
#: ``coef * sum_{s >= t} D_s(pi_old || pi_ref)`` from each token's advantage after they are
#: normalised (FRPO; docs/methods.md, "Where the divergence goes").
PLACEMENTS: tuple[str, ...] = ("loss", "reward", "advantage")


class SpecError(ValueError):
    """A malformed objective spec (unknown key, wrong type, bad value); the message names the
    key by its dotted path."""


@dataclass
class SurrogateSpec:
    """Policy-gradient surrogate from ``SURROGATES`` (``clip``, ``gspo``, ``atr``, ``rpg_*``)."""

    name: str = "clip"
    #: keyword arguments of the surrogate (e.g. eps_low, eps_high, delta)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class RegularizerSpec:
    """Per-token regularizer from ``REGULARIZERS`` and its coefficient."""

    name: str = "prob_l2"
    #: coefficient lambda (beta for KL): per-token loss = surrogate + coef * D
    coef: float = 0.05
    #: "ref": anchor at the frozen reference policy (initial weights / adapters disabled);
    #: "old": anchor at the rollout policy of the current batch (RPG's iterative reference)
    anchor: str = "ref"
    #: keyword arguments of the regularizer (e.g. clamp, mirror=path/to/mirror.json)
    params: dict[str, Any] = field(default_factory=dict)
    #: "loss": coef * D per token in the loss; "reward": coef * sum_t D(pi_old || pi_ref) of the
    #: rollout, detached, subtracted from each sequence's reward before the advantages;
    #: "advantage": coef * sum_{s >= t} D_s(pi_old || pi_ref), detached, subtracted from each
    #: token's advantage after the normalisation (FRPO; gbmpo.objectives.placement)
    placement: str = "loss"
    #: "sample": the regularizer's formula on the sampled token; "full": the exact divergence
    #: over the whole vocabulary at each position (KL family: KL(pi || pi_ref); prob_l2:
    #: sum_v (p_v - q_v)^2; neural_mirror: sum_v D_h(p_v, q_v); gbmpo.objectives.estimators)
    estimator: str = "sample"
    #: a controlled coefficient: ``coef`` (the first step's) moves each step so that a drift
    #: measure tracks a target (``{target, measure, horizon, min, max}``;
    #: gbmpo.objectives.drift_control); ``None``: the coefficient is fixed
    control: DriftControl | None = None

    def __post_init__(self) -> None:
        _lift_anchor(self, "objective.regularizer")


@dataclass
class RolloutCorrectionSpec:
    """Correction of the sampler / trainer mismatch (``gbmpo.objectives.rollout_correction``):
    the surrogate of each token is weighted by a function of the ratio of the trainer's old
    log-probs to the sampler's. Off (``none``) by default on every engine."""

    #: ROLLOUT_CORRECTIONS: none | tis (truncated IS: clip the ratio to [low, high]) | mis
    #: (masked IS: 0 outside [low, high]) | icepop (token-level mis with both bounds)
    mode: str = "none"
    #: token (one ratio per token) | sequence (the product over the completion, per sequence)
    level: str = "token"
    #: lower bound of the ratio (``None``: none; icepop needs it, e.g. 0.5)
    low: float | None = None
    #: upper bound of the ratio (the TIS cap; mis / icepop mask above it)
    high: float | None = 2.0
    #: DeepSeek-V3.2's off-policy sequence mask: drop a sequence with a negative advantage whose
    #: mean log(sampler / current policy) exceeds this delta (``None``: off)
    off_policy_mask_threshold: float | None = None

    @property
    def active(self) -> bool:
        """Whether the correction changes the loss (a mode other than ``none``, or the
        off-policy sequence mask)."""
        return self.mode != "none" or self.off_policy_mask_threshold is not None

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "level": self.level, "low": self.low, "high": self.high,
                "off_policy_mask_threshold": self.off_policy_mask_threshold}  # fmt: skip

    def check(self, where: str = "objective.rollout_correction") -> None:
        """:class:`SpecError` (``UnknownNameError`` for the mode) naming a bad value."""
        try:
            check_correction(self.mode, self.level, self.low, self.high,
                             self.off_policy_mask_threshold, where)  # fmt: skip
        except UnknownNameError:
            raise
        except ValueError as err:
            raise SpecError(str(err)) from None


@dataclass
class ObjectiveSpec:
    """Advantages -> surrogate + coef * regularizer per token -> aggregation."""

    #: advantage estimator from ``ADVANTAGES`` (grpo | batch | dr_grpo | rpg)
    advantage: str = "dr_grpo"
    surrogate: SurrogateSpec = field(default_factory=SurrogateSpec)
    #: one term, or a list of terms whose divergences are summed (see :attr:`terms`)
    regularizer: RegularizerSpec | list[RegularizerSpec] = field(default_factory=RegularizerSpec)
    #: aggregation mode from ``AGGREGATIONS`` (grpo | bnpo | dr_grpo | seq_mean_token_sum)
    aggregation: str = "dr_grpo"
    #: log ``reg/<name>`` = D(pi_old || pi_ref) of every registered regularizer each step (the
    #: optimised ones are always logged when the reference's log-probs exist), even when the
    #: loss needs no reference (then one extra no-grad reference forward per step, on every
    #: engine that honours it)
    monitor_regularizers: bool = True
    #: the sampler / trainer mismatch correction (off by default on every engine)
    rollout_correction: RolloutCorrectionSpec = field(default_factory=RolloutCorrectionSpec)

    # ------------------------------------------------------------------ reading

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "objective") -> ObjectiveSpec:
        """Build from a mapping (missing keys keep their defaults; unknown keys and wrong types
        raise :class:`SpecError` naming ``where.key``)."""
        d = _mapping(data, where)
        refuse_former_keys(d, where)
        _known(d, where, ("advantage", "surrogate", "regularizer", "aggregation",
                          "monitor_regularizers", "rollout_correction"))  # fmt: skip
        spec = cls()
        if "advantage" in d:
            spec.advantage = _text(d["advantage"], f"{where}.advantage")
        if "aggregation" in d:
            spec.aggregation = _text(d["aggregation"], f"{where}.aggregation")
        if "monitor_regularizers" in d:
            v = d["monitor_regularizers"]
            if not isinstance(v, bool):
                raise SpecError(f"'{where}.monitor_regularizers' must be bool, got {v!r}")
            spec.monitor_regularizers = v
        if "surrogate" in d:
            s = _mapping(d["surrogate"], f"{where}.surrogate")
            _known(s, f"{where}.surrogate", ("name", "params"))
            if "name" in s:
                spec.surrogate.name = _text(s["name"], f"{where}.surrogate.name")
            if "params" in s:
                spec.surrogate.params = _params(s["params"], f"{where}.surrogate.params")
        if "regularizer" in d:
            r = d["regularizer"]
            if isinstance(r, (list, tuple)):
                if not r:
                    raise SpecError(
                        f"'{where}.regularizer' is an empty list; give one term or more"
                    )
                spec.regularizer = [_term(t, f"{where}.regularizer[{i}]") for i, t in enumerate(r)]
            else:
                spec.regularizer = _term(r, f"{where}.regularizer")
        if "rollout_correction" in d:
            spec.rollout_correction = _correction(d["rollout_correction"],
                                                  f"{where}.rollout_correction")
        return spec

    @classmethod
    def from_yaml(cls, path: str | Path) -> ObjectiveSpec:
        """Read a YAML file holding either the objective section itself or a whole gbmpo config
        with an ``objective:`` key (whose other sections are ignored)."""
        p = Path(path)
        if not p.is_file():
            raise SpecError(f"objective file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise SpecError(f"objective file {str(path)!r} is not valid YAML: {err}") from err
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise SpecError(f"objective file {str(path)!r} must hold a mapping")
        if "objective" in data:
            return cls.from_dict(data["objective"] or {}, "objective")
        return cls.from_dict(data, "objective")

    @classmethod
    def load(cls, spec: ObjectiveSpec | Mapping[str, Any] | str | Path) -> ObjectiveSpec:
        """A spec from a spec (returned as is), a mapping or a YAML file path."""
        if isinstance(spec, ObjectiveSpec):
            return spec
        if isinstance(spec, Mapping):
            if set(spec) == {"objective"}:
                return cls.from_dict(spec["objective"] or {}, "objective")
            return cls.from_dict(spec)
        if isinstance(spec, (str, Path)):
            return cls.from_yaml(spec)
        raise SpecError(
            f"an objective spec is a mapping, a YAML file path or an ObjectiveSpec, got "
            f"{type(spec).__name__}"
        )

    @property
    def terms(self) -> list[RegularizerSpec]:
        """The regularizer terms: ``[regularizer]`` for one mapping, else the list."""
        r = self.regularizer
        return list(r) if isinstance(r, (list, tuple)) else [r]

    @property
    def regularizer_label(self) -> str:
        """The regularizer's name, or the terms' names joined by ``+`` (``prob_l2+kl_k3``): the
        ``regularizer`` of ``summary.json`` and of run-directory names."""
        return "+".join(t.name for t in self.terms)

    @property
    def coef_label(self) -> float | list[float]:
        """The coefficient, or the list of the terms' coefficients: ``summary.json``'s
        ``coef``."""
        if isinstance(self.regularizer, (list, tuple)):
            return [t.coef for t in self.regularizer]
        return self.regularizer.coef

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plain nested dict that :meth:`from_dict` reads back."""

        def term(t: RegularizerSpec) -> dict[str, Any]:
            out = {
                "name": t.name,
                "coef": t.coef,
                "anchor": t.anchor,
                "placement": t.placement,
                "estimator": t.estimator,
                "params": dict(t.params),
            }
            if t.control is not None:  # absent when fixed: specs written before it read alike
                out["control"] = t.control.to_dict()
            return out

        r = self.regularizer
        return {
            "advantage": self.advantage,
            "surrogate": {"name": self.surrogate.name, "params": dict(self.surrogate.params)},
            "regularizer": [term(t) for t in r] if isinstance(r, (list, tuple)) else term(r),
            "aggregation": self.aggregation,
            "monitor_regularizers": self.monitor_regularizers,
            "rollout_correction": self.rollout_correction.to_dict(),
        }

    # ------------------------------------------------------------------ checking / building

    def check(self, where: str = "objective") -> ObjectiveSpec:
        """Check every name against its registry and build the surrogate and regularizer once.

        Raises :class:`gbmpo.registry.UnknownNameError` (listing the valid names) or
        :class:`SpecError`, naming the key. Returns ``self``."""
        self.build(where)
        return self

    def build(self, where: str = "objective") -> BuiltObjective:
        """The objects this spec names (see :class:`BuiltObjective`); errors as :meth:`check`."""
        for key, registry, name in (
            ("advantage", ADVANTAGES, self.advantage),
            ("aggregation", AGGREGATIONS, self.aggregation),
        ):
            if name not in registry:
                raise UnknownNameError(
                    f"{where}.{key}: unknown name {name!r}; valid names: "
                    f"{', '.join(registry.names())}"
                )
        rc = self.rollout_correction
        if not isinstance(rc, RolloutCorrectionSpec):
            raise SpecError(f"'{where}.rollout_correction' must be a section, got {rc!r}")
        rc.check(f"{where}.rollout_correction")
        s = self.surrogate
        try:
            surrogate = get_surrogate(s.name, **s.params)
        except UnknownNameError as err:
            raise UnknownNameError(f"{where}.surrogate.name: {err}") from None
        except (TypeError, ValueError) as err:
            raise SpecError(f"{where}.surrogate ({s.name!r}): {err}") from None
        listed = isinstance(self.regularizer, (list, tuple))
        if listed and not self.regularizer:
            raise SpecError(f"'{where}.regularizer' is an empty list; give one term or more")
        terms: list[BuiltTerm] = []
        for i, r in enumerate(self.terms):
            at = f"{where}.regularizer[{i}]" if listed else f"{where}.regularizer"
            terms.append(_build_term(r, at))
        names = [t.name for t in terms]
        for name in names:
            if names.count(name) > 1:
                raise SpecError(
                    f"'{where}.regularizer' lists {name!r} twice; give each regularizer once "
                    "(its coefficients add up)"
                )
        if listed and "none" in names:
            raise SpecError(f"'{where}.regularizer' lists 'none' beside other terms; leave it out")
        measures = [t.control.monitor(t.name) for t in terms if t.control is not None]
        for read in measures:
            if measures.count(read) > 1:
                raise SpecError(
                    f"'{where}.regularizer': {measures.count(read)} terms' controls track "
                    f"reg/{read}; "
                    "two controllers of one measure have no single answer (any split of the "
                    "drift between the terms holds it): give one of them control, or measure: "
                    "term to each"
                )
        # reg/<name>: the optimised regularizers always, every registered one when monitoring
        built = {t.name: t.regularizer for t in terms}
        monitors: dict[str, Any] = {}
        reads = {t.control.monitor(t.name) for t in terms if t.control is not None}
        for name in REGULARIZERS.names():
            if name in built and name != "none":
                monitors[name] = built[name]
            elif name != "none" and (self.monitor_regularizers or name in reads):
                monitors[name] = get_regularizer(name)  # a controller's measure is always logged
        return BuiltObjective(
            spec=self,
            advantage=ADVANTAGES.get(self.advantage),
            surrogate=surrogate,
            terms=tuple(terms),
            aggregation=self.aggregation,
            monitors=monitors,
        )


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


def _build_term(r: RegularizerSpec, at: str) -> BuiltTerm:
    """Build one :class:`RegularizerSpec` (errors name ``at``, the term's dotted key)."""
    _lift_anchor(r, at)
    try:
        regularizer = get_regularizer(r.name, **r.params)
    except UnknownNameError as err:
        raise UnknownNameError(f"{at}.name: {err}") from None
    except (TypeError, ValueError) as err:  # a missing mirror file stays FileNotFoundError
        raise SpecError(f"{at} ({r.name!r}): {err}") from None
    coef = parse_coefficient(r.coef, f"{at}.coef")  # a spec built by hand is parsed here
    if r.anchor not in ANCHORS:
        raise SpecError(f"'{at}.anchor' must be 'ref' or 'old', got {r.anchor!r}")
    if r.placement not in PLACEMENTS:
        raise SpecError(
            f"'{at}.placement' must be one of {', '.join(PLACEMENTS)}, got {r.placement!r}"
        )
    try:
        check_estimator(r.name, r.estimator, r.anchor, r.params, regularizer)
    except ValueError as err:
        raise SpecError(f"'{at}.estimator' ({r.name!r}): {err}") from None
    if r.control is not None:  # a spec built by hand may hold the mapping
        r.control = _control(r.control, f"{at}.control")
    term = BuiltTerm(r.name, regularizer, coef, r.anchor, r.placement, r.estimator, r.control)
    if r.control is not None:
        try:
            r.control.check(coef)
        except ValueError as err:
            raise SpecError(f"'{at}.control': {err}") from None
    if r.control is not None and (r.name == "none" or (
            r.control.measure == "term" and not term.needs_ref)):
        raise SpecError(
            f"'{at}.control' is set with measure {r.control.measure!r} on {r.name!r} (anchor "
            f"{r.anchor!r}): the measure is the term's divergence from the frozen reference; "
            "use measure: kl, or a regularizer anchored on the reference"
        )
    if r.placement in ("reward", "advantage") and term.active and not term.needs_ref:
        raise SpecError(
            f"'{at}.placement'={r.placement} with {r.name!r} (anchor {r.anchor!r}"
            f"): the in-{r.placement} penalty is D(pi_old || pi_ref) on the rollout, which is 0 "
            "when the anchor is the rollout policy itself; use anchor: ref (a regularizer "
            "anchored on the frozen reference) or placement: loss"
        )
    return term


@dataclass(frozen=True)
class BuiltObjective:
    """What an :class:`ObjectiveSpec` names, built once and used as is by every engine (the own
    trainer, ``GBMPOTrainer`` and the verl plugin): the advantage function, the surrogate, the
    regularizer terms (one regularizer is a list of one), the aggregation mode's name and the
    regularizers monitored as ``reg/<name>``."""

    #: the spec this was built from
    spec: ObjectiveSpec
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


# ---------------------------------------------------------------------- parsing helpers


def _term(value: Any, where: str) -> RegularizerSpec:
    """One regularizer term from a mapping (or a :class:`RegularizerSpec`, kept as is)."""
    if isinstance(value, RegularizerSpec):
        return value
    r = _mapping(value, where)
    _known(r, where, ("name", "coef", "anchor", "placement", "estimator", "params", "control"))
    term = RegularizerSpec()
    if "name" in r:
        term.name = _text(r["name"], f"{where}.name")
    if r.get("control") is not None:
        term.control = _control(r["control"], f"{where}.control")
    if "coef" in r:
        term.coef = parse_coefficient(r["coef"], f"{where}.coef")
    if "anchor" in r:
        term.anchor = _text(r["anchor"], f"{where}.anchor")
    if "placement" in r:
        term.placement = _text(r["placement"], f"{where}.placement")
    if "estimator" in r:
        term.estimator = _text(r["estimator"], f"{where}.estimator")
    if "params" in r:
        term.params = _params(r["params"], f"{where}.params")
    _lift_anchor(term, where)
    return term


def _control(value: Any, where: str) -> DriftControl:
    """A controlled coefficient from its ``control:`` mapping (errors name ``where``)."""
    if isinstance(value, DriftControl):
        return value
    try:
        return DriftControl.from_dict(_mapping(value, where),
                                      lambda v, k: parse_number(v, f"{where}.{k}"))
    except KeyError as err:
        raise SpecError(f"'{where}': {err.args[0]}") from None
    except ValueError as err:  # a SpecError from parse_number names its key already
        raise err if isinstance(err, SpecError) else SpecError(f"'{where}': {err}") from None


def _correction(value: Any, where: str) -> RolloutCorrectionSpec:
    """The ``rollout_correction`` section from a mapping (or a spec, kept as is); values are
    checked by :meth:`RolloutCorrectionSpec.check`."""
    if isinstance(value, RolloutCorrectionSpec):
        return value
    d = _mapping(value, where)
    _known(d, where, ("mode", "level", "low", "high", "off_policy_mask_threshold"))
    rc = RolloutCorrectionSpec()
    if "mode" in d:
        rc.mode = _text(d["mode"], f"{where}.mode")
    if "level" in d:
        rc.level = _text(d["level"], f"{where}.level")
    for key in ("low", "high", "off_policy_mask_threshold"):
        if key in d:
            v = d[key]
            setattr(rc, key, None if v is None else parse_number(v, f"{where}.{key}"))
    return rc


#: A number in YAML 1.2's core syntax (``5e-2``, ``1E5``, ``0.05``, ``-3``, ``.5``).
_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
#: The numbers among them that YAML 1.1 (PyYAML) reads as text: an exponent without a dot
#: (``5e-2``, ``1e5``) or without a sign (``1.0e5``).
_EXPONENT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


def parse_number(value: Any, where: str) -> float:
    """The one rule for a float value of the objective: an int or a float (not a bool), or a
    string written as a number (YAML 1.2 syntax: PyYAML, a YAML 1.1 reader, returns ``5e-2`` or
    ``1e5`` unquoted in a file as the string ``"5e-2"``, and a quoted ``"0.05"`` is a string
    too), as a float; anything else is a :class:`SpecError` naming ``where``."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"'{where}' must be float, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        raise SpecError(f"'{where}' must be float, got an int out of float range") from None


def parse_coefficient(value: Any, where: str) -> float:
    """A regularizer coefficient: :func:`parse_number`, finite and ``>= 0``.

    Negative coefficients are refused on every path (the ``objective:`` section, the TRL
    drop-in's ``regularizer_coef`` / ``beta``): every registered regularizer is a divergence
    from the anchor (``>= 0`` per token, or in expectation for ``kl_k1``), so ``coef < 0`` would
    reward moving away from the anchor, not penalise it; 0 switches the term off."""
    coef = parse_number(value, where)
    if not math.isfinite(coef) or coef < 0:
        raise SpecError(
            f"'{where}' must be finite and >= 0, got {coef:g}: the regularizer is a divergence "
            "from the anchor, so a negative coefficient would reward drifting away from it; "
            "use 0 to switch the term off"
        )
    return coef


def _param_value(value: Any) -> Any:
    """A free parameter as given, except a number that YAML 1.1 left as text (``5e-2``), which
    becomes the float YAML 1.2 reads (names and paths stay strings)."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value)
    return value


def _lift_anchor(term: RegularizerSpec, where: str) -> None:
    """Move a deprecated ``params.anchor`` (the ``rpg_*`` regularizers' own anchor parameter,
    now gone) to the term's ``anchor``, with a DeprecationWarning; :class:`SpecError` when both
    are given and differ. The anchor is one setting of the term, for every regularizer."""
    if not isinstance(term.params, Mapping) or "anchor" not in term.params:
        return
    params = dict(term.params)
    value = params.pop("anchor")
    warnings.warn(
        f"'{where}.params.anchor' is deprecated: the anchor is '{where}.anchor' "
        f"(ref | old), for every regularizer; using anchor: {value!r}",
        DeprecationWarning,
        stacklevel=3,
    )
    if term.anchor != "ref" and term.anchor != value:
        raise SpecError(
            f"'{where}.anchor'={term.anchor!r} and the deprecated '{where}.params.anchor'="
            f"{value!r} disagree; give '{where}.anchor' only"
        )
    term.anchor = value if isinstance(value, str) else str(value)
    term.params = params


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{where!r} must be a mapping (section), got {type(value).__name__}")
    return value


def refuse_former_keys(d: Mapping[str, Any], where: str) -> None:
    """:class:`SpecError` for a former name of a setting (:data:`FORMER_KEYS`), naming the one
    that replaces it: a setting is honoured or refused, never silently aliased."""
    for key in d:
        if key in FORMER_KEYS:
            raise SpecError(
                f"'{where}.{key}' was renamed: use '{where}.{FORMER_KEYS[key]}' (one setting "
                "for the monitored divergences reg/<name> on every engine)"
            )


def _known(d: Mapping[str, Any], where: str, valid: tuple[str, ...]) -> None:
    for key in d:
        if key not in valid:
            hint = did_you_mean(str(key), valid, prefix=f"{where}.")
            raise SpecError(
                f"unknown key '{where}.{key}'; valid keys under {where!r}: {', '.join(valid)}"
                f"{hint}"
            )


def did_you_mean(word: str, candidates: Mapping[str, str] | Sequence[str], *,
                 prefix: str = "") -> str:
    """``"; did you mean 'NAME'?"`` for the candidate closest to ``word``, or ``""`` when none
    is close (:func:`difflib.get_close_matches`, ratio >= 0.75, case, ``-`` and ``_`` ignored).

    ``candidates``: names, or a mapping of names to what to suggest for each (an alias to
    itself, a field name to its dotted key); ``prefix`` is put before a suggested plain name.
    """
    table = dict(candidates) if isinstance(candidates, Mapping) else {
        c: f"{prefix}{c}" for c in candidates}
    norm: dict[str, str] = {}
    for name, shown in table.items():
        norm.setdefault(name.lower().replace("-", "_"), shown)
    key = word.lower().replace("-", "_")
    best = difflib.get_close_matches(key, list(norm), n=1, cutoff=0.75)
    return f"; did you mean {norm[best[0]]!r}?" if best else ""


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise SpecError(f"{where!r} must be str, got {type(value).__name__} {value!r}")
    return value


def _params(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    d = _mapping(value, where)
    for k in d:
        if not isinstance(k, str):
            raise SpecError(f"{where!r} keys must be strings, got {k!r}")
    return {k: _param_value(v) for k, v in d.items()}
