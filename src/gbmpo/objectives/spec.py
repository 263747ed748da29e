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
        params: {}
      aggregation: dr_grpo           # AGGREGATIONS: grpo | bnpo | dr_grpo | seq_mean_token_sum

The same section is the ``objective:`` of ``gbmpo train``'s config (:class:`ObjectiveSpec` is
that config's ``ObjectiveConfig``), the ``objective=`` of the TRL drop-in
(``gbmpo.integrations.trl.GBMPOConfig``) and what ``gbmpo train --engine verl`` turns into
verl's overrides. :meth:`ObjectiveSpec.load` reads a dict, a YAML file (either the section
itself or a whole config holding an ``objective:`` key) or a spec; :meth:`ObjectiveSpec.check`
checks every name against its registry (unknown names list the valid ones) and builds the
surrogate and regularizer once, so a bad parameter is reported before anything runs.

This module is pure: it imports the registries only inside :meth:`ObjectiveSpec.check` and
:meth:`ObjectiveSpec.build`, and nothing above ``gbmpo.objectives``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ANCHORS",
    "BuiltObjective",
    "ObjectiveSpec",
    "RegularizerSpec",
    "SpecError",
    "SurrogateSpec",
]

#: ``regularizer.anchor`` values.
ANCHORS: tuple[str, ...] = ("ref", "old")


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


@dataclass
class ObjectiveSpec:
    """Advantages -> surrogate + coef * regularizer per token -> aggregation."""

    #: advantage estimator from ``ADVANTAGES`` (grpo | batch | dr_grpo | rpg)
    advantage: str = "dr_grpo"
    surrogate: SurrogateSpec = field(default_factory=SurrogateSpec)
    regularizer: RegularizerSpec = field(default_factory=RegularizerSpec)
    #: aggregation mode from ``AGGREGATIONS`` (grpo | bnpo | dr_grpo | seq_mean_token_sum)
    aggregation: str = "dr_grpo"
    #: log the value of every registered regularizer (vs the frozen reference) each step, even
    #: when the optimised one needs no reference (then one extra no-grad forward per step)
    monitor_regularizers: bool = True

    # ------------------------------------------------------------------ reading

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "objective") -> ObjectiveSpec:
        """Build from a mapping (missing keys keep their defaults; unknown keys and wrong types
        raise :class:`SpecError` naming ``where.key``)."""
        d = _mapping(data, where)
        _known(d, where, ("advantage", "surrogate", "regularizer", "aggregation",
                          "monitor_regularizers"))  # fmt: skip
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
            r = _mapping(d["regularizer"], f"{where}.regularizer")
            _known(r, f"{where}.regularizer", ("name", "coef", "anchor", "params"))
            if "name" in r:
                spec.regularizer.name = _text(r["name"], f"{where}.regularizer.name")
            if "coef" in r:
                c = r["coef"]
                if isinstance(c, bool) or not isinstance(c, (int, float)):
                    raise SpecError(f"'{where}.regularizer.coef' must be float, got {c!r}")
                spec.regularizer.coef = float(c)
            if "anchor" in r:
                spec.regularizer.anchor = _text(r["anchor"], f"{where}.regularizer.anchor")
            if "params" in r:
                spec.regularizer.params = _params(r["params"], f"{where}.regularizer.params")
        return spec

    @classmethod
    def from_yaml(cls, path: str | Path) -> ObjectiveSpec:
        """Read a YAML file holding either the objective section itself or a whole gbmpo config
        with an ``objective:`` key (whose other sections are ignored)."""
        import yaml

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

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plain nested dict that :meth:`from_dict` reads back."""
        return {
            "advantage": self.advantage,
            "surrogate": {"name": self.surrogate.name, "params": dict(self.surrogate.params)},
            "regularizer": {
                "name": self.regularizer.name,
                "coef": self.regularizer.coef,
                "anchor": self.regularizer.anchor,
                "params": dict(self.regularizer.params),
            },
            "aggregation": self.aggregation,
            "monitor_regularizers": self.monitor_regularizers,
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
        from gbmpo.objectives.advantages import ADVANTAGES
        from gbmpo.objectives.aggregate import AGGREGATIONS
        from gbmpo.objectives.regularizers import get_regularizer
        from gbmpo.objectives.surrogates import get_surrogate
        from gbmpo.registry import UnknownNameError

        for key, registry, name in (
            ("advantage", ADVANTAGES, self.advantage),
            ("aggregation", AGGREGATIONS, self.aggregation),
        ):
            if name not in registry:
                raise UnknownNameError(
                    f"{where}.{key}: unknown name {name!r}; valid names: "
                    f"{', '.join(registry.names())}"
                )
        s, r = self.surrogate, self.regularizer
        try:
            surrogate = get_surrogate(s.name, **s.params)
        except UnknownNameError as err:
            raise UnknownNameError(f"{where}.surrogate.name: {err}") from None
        except (TypeError, ValueError) as err:
            raise SpecError(f"{where}.surrogate ({s.name!r}): {err}") from None
        try:
            regularizer = get_regularizer(r.name, **r.params)
        except UnknownNameError as err:
            raise UnknownNameError(f"{where}.regularizer.name: {err}") from None
        except (TypeError, ValueError) as err:  # a missing mirror file stays FileNotFoundError
            raise SpecError(f"{where}.regularizer ({r.name!r}): {err}") from None
        if not math.isfinite(r.coef):
            raise SpecError(f"'{where}.regularizer.coef' must be finite, got {r.coef}")
        if r.anchor not in ANCHORS:
            raise SpecError(
                f"'{where}.regularizer.anchor' must be 'ref' or 'old', got {r.anchor!r}"
            )
        from gbmpo.objectives.regularizers import REGULARIZERS

        # reg/<name>: the optimised regularizer always, every registered one when monitoring
        monitors: dict[str, Any] = {}
        for name in REGULARIZERS.names():
            if name == r.name != "none":
                monitors[name] = regularizer
            elif name != "none" and self.monitor_regularizers:
                monitors[name] = get_regularizer(name)
        return BuiltObjective(
            spec=self,
            advantage=ADVANTAGES.get(self.advantage),
            surrogate=surrogate,
            regularizer=regularizer,
            coef=float(r.coef),
            anchor=r.anchor,
            aggregation=self.aggregation,
            monitors=monitors,
        )


@dataclass(frozen=True)
class BuiltObjective:
    """What an :class:`ObjectiveSpec` names, built once and used as is by every engine (the own
    trainer, ``GBMPOTrainer`` and the verl plugin): the advantage function, the surrogate and
    regularizer objects, the coefficient, the anchor, the aggregation mode's name and the
    regularizers monitored as ``reg/<name>``."""

    #: the spec this was built from
    spec: ObjectiveSpec
    #: ``(rewards [N], group_size) -> advantages [N]`` from ``ADVANTAGES``
    advantage: Any
    #: ``(logp, old_logp, advantages, mask) -> (per-token loss, diagnostics)``
    surrogate: Any
    #: ``(logp, ref_logp, old_logp, mask) -> per-token divergence``
    regularizer: Any
    coef: float
    #: ``ref`` (frozen reference) or ``old`` (the rollout policy)
    anchor: str
    aggregation: str
    #: the regularizers logged as ``reg/<name>`` = D(pi_old || pi_ref): the optimised one (the
    #: same object) and, with ``monitor_regularizers``, every registered one but ``none``
    monitors: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_ref(self) -> bool:
        """Whether the reference policy's log-probs are needed: the regularizer is anchored on
        it, or every regularizer is monitored against it."""
        anchored = bool(getattr(self.regularizer, "needs_ref", True)) and self.anchor == "ref"
        return anchored or self.spec.monitor_regularizers

    @property
    def anchored_on_ref(self) -> bool:
        """Whether the optimised term needs the reference's log-probs (a nonzero coefficient on
        a regularizer anchored on the frozen reference): TRL's ``beta != 0``."""
        reg_needs = bool(getattr(self.regularizer, "needs_ref", True))
        return self.spec.regularizer.name != "none" and reg_needs and self.anchor == "ref" \
            and self.coef != 0


# ---------------------------------------------------------------------- parsing helpers


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{where!r} must be a mapping (section), got {type(value).__name__}")
    return value


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
    import difflib

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
    return dict(d)
