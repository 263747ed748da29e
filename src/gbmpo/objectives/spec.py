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
above them. The value readers (:class:`SpecError`, :func:`parse_number`, ...) live in
:mod:`gbmpo.objectives.spec_values` and the built objective in
:mod:`gbmpo.objectives.built_objective`; both are re-exported here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gbmpo.objectives.advantages import ADVANTAGES
from gbmpo.objectives.aggregate import AGGREGATIONS
from gbmpo.objectives.built_objective import BuiltObjective, BuiltTerm
from gbmpo.objectives.drift_control import DriftControl
from gbmpo.objectives.estimators import check_estimator
from gbmpo.objectives.regularizers import REGULARIZERS, get_regularizer
from gbmpo.objectives.rollout_correction import check_correction
from gbmpo.objectives.spec_values import (
    FORMER_KEYS,
    SpecError,
    _known,
    _mapping,
    _params,
    _text,
    did_you_mean,
    parse_coefficient,
    parse_number,
    refuse_former_keys,
)
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
    "did_you_mean",
    "parse_coefficient",
    "parse_number",
    "refuse_former_keys",
]


#: ``regularizer.anchor`` values.
ANCHORS: tuple[str, ...] = ("ref", "old")

#: ``regularizer.placement`` values: ``loss`` adds ``coef * D`` per token to the loss;
#: ``reward`` subtracts ``coef * sum_t D(pi_old || pi_ref)`` from each sequence's reward before
#: the advantages are computed; ``advantage`` subtracts the future penalty
#: ``coef * sum_{s >= t} D_s(pi_old || pi_ref)`` from each token's advantage after they are
#: normalised (FRPO; docs/methods.md, "Where the divergence goes").
PLACEMENTS: tuple[str, ...] = ("loss", "reward", "advantage")


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

