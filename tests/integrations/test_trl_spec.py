"""GBMPOConfig(objective=...): the gbmpo objective spec drives the TRL drop-in; the alias fields
(clip_mode, atr_delta, regularizer_*) spell the same objective."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("trl")

from gbmpo.integrations.trl import GBMPOConfig, build_objective, spec_from_trl_fields  # noqa: E402

BASE: dict[str, Any] = {"output_dir": "unused", "use_cpu": True, "bf16": False,
                        "report_to": "none"}  # fmt: skip
ATR = {
    "advantage": "grpo",
    "surrogate": {"name": "atr", "params": {"delta": 0.02, "dual_clip_c": 3.0}},
    "regularizer": {"name": "prob_l2", "coef": 0.1, "anchor": "ref"},
    "aggregation": "dr_grpo",
    "monitor_regularizers": False,
}


def test_spec_and_aliases_build_the_same_objective(tmp_path: Path) -> None:
    aliases = GBMPOConfig(**BASE, clip_mode="atr", atr_delta=0.02, dual_clip_c=3.0,
                          regularizer="prob_l2", regularizer_coef=0.1, loss_type="dr_grpo",
                          scale_rewards="group", monitor_regularizers=False)  # fmt: skip
    path = tmp_path / "objective.yaml"
    path.write_text(yaml.safe_dump({"objective": ATR}))
    for objective in (ATR, str(path)):
        spec_cfg = GBMPOConfig(**BASE, objective=objective)
        assert spec_cfg.objective == spec_from_trl_fields(aliases).to_dict()
        a, b = build_objective(aliases), build_objective(spec_cfg)
        assert a.surrogate == b.surrogate and len(a.terms) == len(b.terms) == 1
        (ta,), (tb,) = a.terms, b.terms
        assert ta.regularizer.name == tb.regularizer.name
        assert (ta.coef, ta.anchor, a.aggregation) == (tb.coef, tb.anchor, b.aggregation)
        # the TRL fields the spec determines
        assert (spec_cfg.loss_type, spec_cfg.scale_rewards) == ("dr_grpo", "group")
        assert spec_cfg.beta == 0.1 and spec_cfg.needs_reference_model


def test_spec_surrogates_without_an_alias() -> None:
    spec = {"advantage": "rpg", "aggregation": "bnpo",
            "surrogate": {"name": "rpg_reinforce", "params": {"variant": "ufkl", "beta": 1e-4}},
            "regularizer": {"name": "none", "coef": 0.0},
            "monitor_regularizers": False}  # fmt: skip
    c = GBMPOConfig(**BASE, objective=spec)
    obj = build_objective(c)
    assert obj.surrogate.name == "rpg_reinforce" and c.beta == 0.0  # no reference needed
    # monitoring (the spec's default) needs the reference: beta switches it on
    assert GBMPOConfig(**BASE, objective={**spec, "monitor_regularizers": True}).beta == 1.0
    assert (c.loss_type, c.scale_rewards) == ("bnpo", "none")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"clip_mode": "atr", "atr_delta": 0.02}, "alias fields must keep their defaults"),
        ({"beta": 0.5}, "beta=0.5 disagrees"),
        ({"objective": {**ATR, "advantage": "batch", "aggregation": "nope"}}, "nope"),
    ],
)
def test_spec_refusals(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GBMPOConfig(**BASE, **{"objective": ATR, **kw})


def test_gbmpo_config_pickles_without_its_built_objective(tmp_path) -> None:
    """HF's Trainer saves its arguments into every checkpoint (torch.save): the objective built
    once by the config is left out and rebuilt from the spec after loading."""
    import pickle

    from gbmpo.integrations.trl import GBMPOConfig, build_objective

    args = GBMPOConfig(str(tmp_path), objective={"regularizer": {"name": "prob_l2", "coef": 0.1}},
                       report_to="none", use_cpu=True)  # fmt: skip
    again = pickle.loads(pickle.dumps(args))
    assert again.objective == args.objective and again.needs_reference_model
    assert build_objective(again).terms[0].coef == 0.1
