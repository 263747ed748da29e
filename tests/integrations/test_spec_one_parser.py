"""One parser for the objective: the ``objective:`` section of a YAML config and the TRL
drop-in's alias fields (``GBMPOConfig(regularizer=..., regularizer_coef=..., clip_mode=...)``)
give the same :class:`ObjectiveSpec` for the same objective, with one rule for types (a numeric
string such as the ``"5e-2"`` PyYAML reads from an unquoted ``5e-2`` is 0.05) and for signs (a
negative coefficient is refused on both paths)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("trl")

from gbmpo.config import ConfigError, load_config  # noqa: E402
from gbmpo.engines.trl.objective import objective_spec  # noqa: E402
from gbmpo.integrations.trl import GBMPOConfig  # noqa: E402
from gbmpo.objectives.spec import (  # noqa: E402
    ObjectiveSpec,
    SpecError,
    parse_coefficient,
    parse_number,
)

# use_bias_correction_kl defaults to True as in GRPOConfig (kl_k3 -> kl_k3_is); off, the alias
# names the regularizer the section names
BASE: dict[str, Any] = {"output_dir": "unused", "use_cpu": True, "bf16": False,
                        "report_to": "none", "use_bias_correction_kl": False}  # fmt: skip

#: regularizers both paths can spell (neural_mirror needs a file), those that take ``clamp``
NAMES = ("kl_k1", "kl_k2", "kl_k3", "kl_k3_is", "prob_l2", "log_l2", "rpg_fkl", "rpg_rkl",
         "rpg_ufkl", "rpg_urkl", "none")  # fmt: skip
CLAMPABLE = ("kl_k3", "kl_k3_is", "rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl")
#: aggregation -> TRL loss_type, advantage -> TRL scale_rewards
LOSS_TYPE = {"grpo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo", "seq_mean_token_sum": "luspo"}
SCALE = {"grpo": "group", "batch": "batch", "dr_grpo": "none"}
#: ways to write a number: Python's repr, exponent forms PyYAML reads as a float ("5.0e-02")
#: and as a string ("5e-02", "5E-2" without a dot), %g
FORMATS = ("{!r}", "{:e}", "{:.0e}", "{:.1E}", "{:g}")


@st.composite
def number_text(draw: st.DrawFn, lo: float, hi: float) -> str:
    x = draw(st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_subnormal=False))
    return draw(st.sampled_from(FORMATS)).format(x)


@st.composite
def objectives(draw: st.DrawFn) -> dict[str, Any]:
    """One objective, as the text of each number (unquoted in the YAML)."""
    name = draw(st.sampled_from(NAMES))
    o: dict[str, Any] = {
        "name": name,
        "coef": draw(st.one_of(number_text(-1.0, 1.0), st.just("0.0"))),
        "anchor": draw(st.sampled_from(("ref", "old"))),
        "clamp": draw(st.none() | number_text(1.0, 20.0)) if name in CLAMPABLE else None,
        "surrogate": draw(st.sampled_from(("clip", "atr", "divergence_clip"))),
        "eps_low": draw(number_text(0.05, 0.4)),
        "eps_high": draw(number_text(0.05, 0.4)),
        "delta": draw(number_text(0.005, 0.5)),
        "delta_high": draw(number_text(0.005, 0.5)),
        "measure": draw(st.sampled_from(("ratio", "k1", "k2", "k3", "prob_l2"))),
        "dual_clip_c": draw(st.none() | number_text(1.5, 5.0)),
        "aggregation": draw(st.sampled_from(sorted(LOSS_TYPE))),
        "advantage": draw(st.sampled_from(sorted(SCALE))),
        "monitor": draw(st.booleans()),
        "strings": draw(st.booleans()),  # alias fields given as the text, not the float
    }
    return o


def _yaml_text(o: dict[str, Any]) -> str:
    """The objective as a config file a user writes (numbers unquoted)."""
    dual = f", dual_clip_c: {o['dual_clip_c']}" if o["dual_clip_c"] is not None else ""
    if o["surrogate"] == "clip":
        params = f"eps_low: {o['eps_low']}, eps_high: {o['eps_high']}{dual}"
    elif o["surrogate"] == "atr":
        params = f"delta: {o['delta']}{dual}"
    else:
        params = (f"measure: {o['measure']}, delta_low: {o['delta']}, "
                  f"delta_high: {o['delta_high']}{dual}")  # fmt: skip
    reg_params = f"{{clamp: {o['clamp']}}}" if o["clamp"] is not None else "{}"
    return (
        "objective:\n"
        f"  advantage: {o['advantage']}\n"
        f"  surrogate: {{name: {o['surrogate']}, params: {{{params}}}}}\n"
        f"  regularizer: {{name: {o['name']}, coef: {o['coef']}, anchor: {o['anchor']}, "
        f"params: {reg_params}}}\n"
        f"  aggregation: {o['aggregation']}\n"
        f"  monitor_regularizers: {str(o['monitor']).lower()}\n"
    )


def _alias_fields(o: dict[str, Any]) -> dict[str, Any]:
    """The same objective in GBMPOConfig's alias fields (TRL's spelling)."""

    def num(text: str | None) -> Any:
        if text is None:
            return None
        return text if o["strings"] else float(text)

    kw: dict[str, Any] = {
        "regularizer": o["name"],
        "regularizer_coef": num(o["coef"]),
        "regularizer_anchor": o["anchor"],
        "regularizer_clamp": float(o["clamp"]) if o["clamp"] is not None else None,
        "dual_clip_c": float(o["dual_clip_c"]) if o["dual_clip_c"] is not None else None,
        "loss_type": LOSS_TYPE[o["aggregation"]],
        "scale_rewards": SCALE[o["advantage"]],
        "monitor_regularizers": o["monitor"],
    }
    if o["surrogate"] == "clip":
        kw.update(epsilon=float(o["eps_low"]), epsilon_high=float(o["eps_high"]))
    elif o["surrogate"] == "atr":
        kw.update(clip_mode="atr", atr_delta=float(o["delta"]))
    else:
        kw.update(clip_mode="divergence", clip_measure=o["measure"],
                  clip_delta=float(o["delta"]), clip_delta_high=float(o["delta_high"]))  # fmt: skip
    return kw


def _outcome(fn: Any) -> ObjectiveSpec | ValueError:
    try:
        return fn()
    except ValueError as err:  # SpecError and ConfigError are ValueErrors
        return err


@settings(max_examples=60, deadline=None)
@given(o=objectives())
@example(o={"name": "kl_k3", "coef": "5e-2", "anchor": "ref", "clamp": None, "surrogate": "atr",
            "eps_low": "0.2", "eps_high": "0.28", "delta": "2e-2", "delta_high": "0.1",
            "measure": "k3", "dual_clip_c": None, "aggregation": "bnpo", "advantage": "grpo",
            "monitor": False, "strings": True})  # fmt: skip
@example(o={"name": "prob_l2", "coef": "-0.1", "anchor": "ref", "clamp": None,
            "surrogate": "clip", "eps_low": "0.2", "eps_high": "0.28", "delta": "0.1",
            "delta_high": "0.1", "measure": "k3", "dual_clip_c": None, "aggregation": "dr_grpo",
            "advantage": "dr_grpo", "monitor": True, "strings": False})  # fmt: skip
def test_yaml_section_and_trl_aliases_give_the_same_objective(o: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(_yaml_text(o))
        from_yaml = _outcome(lambda: load_config(path).objective.check())
    aliases = _outcome(lambda: GBMPOConfig(**BASE, **_alias_fields(o)))
    coef = float(o["coef"])
    if coef < 0:  # one rule for signs: refused on both paths, the message naming the key
        assert isinstance(from_yaml, ConfigError) and "objective.regularizer.coef" in str(
            from_yaml) and ">= 0" in str(from_yaml)  # fmt: skip
        assert isinstance(aliases, ValueError) and "regularizer_coef" in str(aliases)
        assert ">= 0" in str(aliases)
        return
    assert isinstance(from_yaml, ObjectiveSpec), from_yaml
    if o["name"] == "none" and coef != 0:
        # the one deliberate difference: TRL's alias refuses a coefficient next to "none" (it
        # would otherwise replace TRL's beta silently); the section keeps the term inactive
        assert isinstance(aliases, ValueError) and "regularizer='none'" in str(aliases)
        assert not from_yaml.build().terms[0].active
        return
    assert isinstance(aliases, GBMPOConfig), aliases
    from_aliases = objective_spec(aliases)
    assert from_yaml.to_dict() == from_aliases.to_dict()
    assert from_yaml.terms[0].coef == from_aliases.terms[0].coef == coef
    assert aliases.regularizer_coef == coef and isinstance(aliases.regularizer_coef, float)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.05, 0.05), (1, 1.0), ("5e-2", 0.05), ("5E-2", 0.05), ("1e5", 1e5), ("1.0e5", 1e5),
     ("0.05", 0.05), (" .5 ", 0.5), ("-3", -3.0)],
)
def test_parse_number_reads_what_yaml_leaves_as_text(value: Any, expected: float) -> None:
    assert parse_number(value, "k") == expected


@pytest.mark.parametrize("value", [True, None, "big", "1_000", "nan", "0x10", [1.0], {"a": 1}])
def test_parse_number_refuses_non_numbers(value: Any) -> None:
    with pytest.raises(SpecError, match=r"'k' must be float"):
        parse_number(value, "k")


@pytest.mark.parametrize("value", [-0.1, "-5e-2", math.inf, math.nan, -1])
def test_parse_coefficient_refuses_negative_and_non_finite(value: Any) -> None:
    with pytest.raises(SpecError, match=r"'k' must be finite and >= 0"):
        parse_coefficient(value, "k")


def test_yaml_exponent_in_free_params_is_a_number_and_names_stay_text() -> None:
    data = yaml.safe_load("surrogate: {name: atr, params: {delta: 2e-2}}\n"
                          "regularizer: {name: kl_k3, coef: 5e-2, params: {clamp: 1e1}}")
    assert data["surrogate"]["params"]["delta"] == "2e-2"  # PyYAML (YAML 1.1) reads text
    spec = ObjectiveSpec.from_dict(data)
    assert spec.surrogate.params == {"delta": 0.02} and spec.terms[0].params == {"clamp": 10.0}
    assert spec.terms[0].coef == 0.05
    built = spec.build()
    assert built.surrogate.delta == 0.02 and built.terms[0].coef == 0.05
    kept = ObjectiveSpec.from_dict({"surrogate": {"name": "divergence_clip",
                                                  "params": {"measure": "k3", "delta_low": 0.1}}})
    assert kept.surrogate.params["measure"] == "k3"


def test_a_spec_built_by_hand_follows_the_same_rule() -> None:
    """A RegularizerSpec made in Python (not read from a mapping) is checked when built."""
    spec = ObjectiveSpec.from_dict({})
    spec.terms[0].coef = -0.1
    with pytest.raises(SpecError, match=r"objective.regularizer.coef' must be finite and >= 0"):
        spec.build()
