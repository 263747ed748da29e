"""The objective spec: one section read from a dict, a YAML file or a whole config; checked
against the registries; the same class as the training config's ``objective`` section."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gbmpo.config import ConfigError, TrainConfig, load_config
from gbmpo.engines.hosts import clip_params
from gbmpo.objectives.spec import ObjectiveSpec, SpecError
from gbmpo.registry import UnknownNameError

ATR = {
    "advantage": "grpo",
    "surrogate": {"name": "atr", "params": {"delta": 0.02}},
    "regularizer": {"name": "kl_k3", "coef": 0.01, "anchor": "ref"},
    "aggregation": "bnpo",
}


def test_round_trip_and_config_section_are_the_same_thing(tmp_path: Path) -> None:
    spec = ObjectiveSpec.from_dict(ATR)
    assert ObjectiveSpec.from_dict(spec.to_dict()) == spec
    assert isinstance(TrainConfig().objective, ObjectiveSpec)
    # a whole gbmpo config file: its objective section is the spec
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "tiny"}, "objective": ATR}))
    assert ObjectiveSpec.load(path) == spec == load_config(path).objective
    # the bare section as a file, and a dict wrapped in {"objective": ...}
    bare = tmp_path / "objective.yaml"
    bare.write_text(yaml.safe_dump(ATR))
    assert ObjectiveSpec.load(str(bare)) == spec == ObjectiveSpec.load({"objective": ATR})
    assert ObjectiveSpec.load({}) == TrainConfig().objective


def test_check_builds_the_named_objects() -> None:
    built = ObjectiveSpec.from_dict(ATR).build()
    assert built.surrogate.name == "atr" and built.surrogate.delta == 0.02
    (term,) = built.terms
    assert term.regularizer.name == "kl_k3" and term.coef == 0.01 and term.anchor == "ref"


@pytest.mark.parametrize(
    ("data", "err", "match"),
    [
        ({"regulariser": {}}, SpecError, r"unknown key 'objective.regulariser'; valid keys"),
        ({"surrogate": {"name": "atr", "parms": {}}}, SpecError, r"objective.surrogate.parms"),
        ({"regularizer": {"coef": "big"}}, SpecError, r"regularizer.coef' must be float"),
        ({"surrogate": "atr"}, SpecError, r"'objective.surrogate' must be a mapping"),
    ],
)
def test_malformed_spec_names_the_key(data: dict, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        ObjectiveSpec.from_dict(data)


@pytest.mark.parametrize(
    ("data", "err", "match"),
    [
        ({"advantage": "gae"}, UnknownNameError, r"objective.advantage: .*valid names: .*grpo"),
        ({"surrogate": {"name": "atr"}}, SpecError, r"objective.surrogate \('atr'\)"),
        ({"regularizer": {"name": "kl9"}}, UnknownNameError, r"regularizer.name.*prob_l2"),
        ({"regularizer": {"anchor": "init"}}, SpecError, r"anchor' must be 'ref' or 'old'"),
    ],
)
def test_check_names_the_bad_value(data: dict, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        ObjectiveSpec.from_dict(data).check()


def test_config_errors_are_spec_errors() -> None:
    """The CLI reports both as bad input (exit 2)."""
    assert issubclass(ConfigError, SpecError)


def test_clip_params_maps_host_settings_per_surrogate() -> None:
    kw = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0, "ratio_cap": 2.0}
    assert clip_params("clip", **kw) == {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0,
                                         "ratio_cap": 2.0}  # fmt: skip
    assert clip_params("atr", **kw) == {"dual_clip_c": 3.0}
    assert clip_params("rpg_clip", **kw) == {"eps_low": 0.2, "eps_high": 0.28, "c": 3.0}
    assert clip_params("clip", eps_low=0.1) == {"eps_low": 0.1}
    assert clip_params("some_plugin_surrogate", **kw) == {}


def test_deprecated_regularizer_anchor_parameter_becomes_the_terms_anchor() -> None:
    """The rpg_* regularizers' former ``anchor`` parameter is the term's anchor now: accepted
    under ``params`` with a DeprecationWarning, refused when it contradicts ``anchor``."""
    with pytest.warns(DeprecationWarning, match=r"regularizer.params.anchor' is deprecated"):
        spec = ObjectiveSpec.from_dict(
            {"regularizer": {"name": "rpg_ufkl", "coef": 0.1, "params": {"anchor": "old"}}}
        )
    term = spec.terms[0]
    assert term.anchor == "old" and term.params == {}
    built = spec.build()
    assert built.terms[0].anchor == "old" and not built.anchored_on_ref
    assert not built.terms[0].needs_ref
    with pytest.warns(DeprecationWarning), pytest.raises(SpecError, match="disagree"):
        ObjectiveSpec.from_dict(
            {"regularizer": {"name": "rpg_ufkl", "anchor": "old", "params": {"anchor": "ref"}}}
        )
