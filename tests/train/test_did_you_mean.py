"""Unknown keys and options get a "did you mean" after the unchanged message (aliases, dotted
keys, YAML sections, the objective spec, a subcommand's own options)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gbmpo.cli import main
from gbmpo.config import ConfigError, config_from_dict, leaf_keys, load_config
from gbmpo.objectives.spec import ObjectiveSpec, SpecError, did_you_mean


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regulariser", "kl_k3"],
         "unknown key 'regulariser'; valid keys: engine, model, task, rollout, objective, optim, "
         "lora, eval, run; did you mean 'regularizer'?"),
        (["--objective.regulariser.name", "kl_k3"],
         "unknown key 'objective.regulariser'; valid keys under 'objective': advantage, "
         "surrogate, regularizer, aggregation, monitor_regularizers, rollout_correction; "
         "did you mean 'objective.regularizer'?"),
        (["--objective.regularizer.nme", "kl"], "did you mean 'objective.regularizer.name'?"),
        (["--num_generation", "3"], "did you mean 'num-generations'?"),
        (["--grad-clip", "1"], "did you mean 'optim.grad_clip'?"),
        (["--lrr", "1"], "did you mean 'lr'?"),
        (["--dry-rn"], "unknown key 'dry_rn'; valid keys: engine, model, task, rollout, "
                       "objective, optim, lora, eval, run; did you mean '--dry-run'?"),
        (["--confg", "x.yaml"], "did you mean '--config'?"),
    ],
)
def test_train_unknown_key_suggests(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    args: list[str], message: str) -> None:
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gbmpo train: error: ") and message in err
    assert err.count("\n") == 1 and not run.exists()


def test_no_suggestion_when_nothing_is_close(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--zzzqqq", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'zzzqqq'" in err and "did you mean" not in err


def test_yaml_sections_suggest(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optim:\n  grad_clp: 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optim.grad_clp'; valid keys under "
                       r"'optim': .*; did you mean 'optim.grad_clip'\?$"):
        load_config(cfg)
    with pytest.raises(ConfigError, match=r"did you mean 'rollout'\?$"):
        config_from_dict({"rolout": {}})


def test_objective_spec_suggests() -> None:
    with pytest.raises(SpecError, match=r"unknown key 'objective.regulariser'; valid keys .*; "
                       r"did you mean 'objective.regularizer'\?$"):
        ObjectiveSpec.from_dict({"regulariser": {}})
    with pytest.raises(SpecError, match=r"did you mean 'objective.surrogate.params'\?$"):
        ObjectiveSpec.from_dict({"surrogate": {"parms": {}}})


def test_subcommand_options_suggest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--task", "arithmetic", "--limt", "3"]) == 2
    err = capsys.readouterr().err
    assert err == ("gbmpo eval: error: unrecognized arguments: --limt 3; "
                   "did you mean '--limit'?\n")


def test_did_you_mean_helper() -> None:
    assert did_you_mean("regulariser", ["regularizer", "surrogate"]) == (
        "; did you mean 'regularizer'?")
    assert did_you_mean("Num_Generations", {"num-generations": "num-generations"}) == (
        "; did you mean 'num-generations'?")
    assert did_you_mean("x", ["regularizer"]) == ""
    assert did_you_mean("nme", ["name"], prefix="a.b.") == "; did you mean 'a.b.name'?"


def test_leaf_keys_cover_every_value() -> None:
    keys = leaf_keys()
    assert "optim.lr" in keys and "objective.regularizer.name" in keys and "engine" in keys
    assert "objective.regularizer.params" in keys  # a free dict is one key
    assert not any(k in ("optim", "run", "objective") for k in keys)
