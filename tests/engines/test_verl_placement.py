"""verl and ``objective.regularizer.placement``: ``reward`` becomes verl's in-reward KL through
the gbmpo plugin's ``gbmpo_<name>`` KL types; an in-reward term in a list of terms, and an
in-reward term with parameters, are refused before anything runs (a list of loss terms is one KL
loss, ``gbmpo_sum``: tests_verl/test_parity.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gbmpo.config import ConfigError, load_config
from gbmpo.config.support import VERL_REQUIRED, check_support
from gbmpo.engines.verl.args import overrides
from gbmpo.engines.verl.metrics import convert_row
from gbmpo.engines.verl.objective import verl_objective_overrides

VERL_OK: list[tuple[str, Any]] = [("engine", "verl"), *VERL_REQUIRED.items()]


def _cfg(*settings: tuple[str, Any]) -> Any:
    return load_config(None, [*VERL_OK, *settings])


def test_reward_placement_is_verl_kl_in_reward(tmp_path: Path) -> None:
    cfg = _cfg(("objective.regularizer.name", "kl_k1"), ("objective.regularizer.coef", 0.3),
               ("objective.regularizer.placement", "reward"))  # fmt: skip
    assert check_support(cfg, "verl") == []
    out = overrides(cfg, tmp_path / "run")
    for expected in ("algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=gbmpo_kl_k1",
                     "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.3",
                     "actor_rollout_ref.actor.use_kl_loss=false"):  # fmt: skip
        assert expected in out, expected
    assert not any(o.startswith("actor_rollout_ref.actor.kl_loss_type") for o in out)
    # the loss placement keeps verl's KL loss and no in-reward KL
    loss = overrides(_cfg(("objective.regularizer.name", "kl_k1")), tmp_path / "run2")
    assert "algorithm.use_kl_in_reward=false" in loss
    assert "actor_rollout_ref.actor.kl_loss_type=gbmpo_kl_k1" in loss
    assert sum(o.startswith("algorithm.use_kl_in_reward") for o in out) == 1


@pytest.mark.parametrize(
    "regularizer",
    [[{"name": "prob_l2", "coef": 0.05}, {"name": "kl_k3", "coef": 0.01, "placement": "reward"}],
     {"name": "kl_k3", "coef": 0.1, "placement": "reward", "params": {"clamp": 5.0}}],
)  # fmt: skip
def test_what_verl_cannot_express_is_refused(regularizer: Any) -> None:
    cfg = _cfg(("objective.regularizer", regularizer))
    with pytest.raises(ConfigError, match=r"'objective.regularizer'=.*engine 'verl'"):
        check_support(cfg, "verl")
    with pytest.raises(ValueError):
        verl_objective_overrides(cfg.objective, max_response_length=8)


def test_a_list_of_loss_terms_is_one_sum_kl_loss(tmp_path: Path) -> None:
    import json

    terms = [{"name": "prob_l2", "coef": 0.05}, {"name": "rpg_ufkl", "coef": 0.01,
                                                 "anchor": "old", "params": {"clamp": 5.0}},
             {"name": "kl_k3", "coef": 0.0}]  # fmt: skip
    cfg = _cfg(("objective.regularizer", terms))
    assert check_support(cfg, "verl") == []
    out = overrides(cfg, tmp_path / "run")
    a = "actor_rollout_ref.actor"
    for expected in (f"{a}.use_kl_loss=true", f"{a}.kl_loss_coef=1.0",
                     f"{a}.kl_loss_type=gbmpo_sum", "algorithm.use_kl_in_reward=false"):
        assert expected in out, expected
    assert not [o for o in out if ".gbmpo_kl." in o or ".gbmpo_surrogate." in o]
    (line,) = [o for o in out if o.startswith(f"+{a}.policy_loss.gbmpo_objective=")]
    # the whole spec, which the plugin builds into the own engine's BuiltObjective
    spec = json.loads(line.split("=", 1)[1][1:-1])
    assert spec == json.loads(json.dumps(cfg.objective.to_dict()))
    assert [(t["name"], t["coef"], t["anchor"], t["params"]) for t in spec["regularizer"]] == [
        ("prob_l2", 0.05, "ref", {}), ("rpg_ufkl", 0.01, "old", {"clamp": 5.0}),
        ("kl_k3", 0.0, "ref", {})]
    bad = _cfg(("objective.regularizer", [{"name": "prob_l2", "coef": 0.05, "anchor": "old"},
                                          {"name": "kl_k3", "coef": 0.01}]))  # fmt: skip
    with pytest.raises(ConfigError, match=r"'objective.regularizer.anchor'=.*engine 'verl'"):
        check_support(bad, "verl")


def test_reward_penalty_is_score_minus_shaped_reward() -> None:
    cfg = _cfg(("objective.regularizer.name", "kl_k1"),
               ("objective.regularizer.placement", "reward"))  # fmt: skip
    row = {"step": 1, "data": {"critic/score/mean": 0.75, "critic/rewards/mean": 0.5}}
    out = convert_row(cfg, row, "math")
    assert out["reward_mean"] == 0.75 and out["reward_penalty"] == pytest.approx(0.25)
    assert "reward_penalty" not in convert_row(_cfg(), row, "math")
