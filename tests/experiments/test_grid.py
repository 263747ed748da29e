"""Grid specification, per-run configurations and the reuse / resume / fresh decision."""

from __future__ import annotations

import copy
import json

import pytest

from gbmpo.config import dump_yaml
from gbmpo.experiments.execute import plan_action
from gbmpo.experiments.grid import (
    DEFAULT_COEFS,
    GridEntry,
    GridError,
    check_overrides,
    parse_coefs,
    parse_regularizers,
    parse_seeds,
    plan_grid,
)
from gbmpo.train import load_config


def test_parse_regularizers_labels():
    entries = parse_regularizers("kl_k3, prob_l2,nm_es=neural_mirror")
    assert [(e.label, e.regularizer) for e in entries] == [
        ("kl_k3", "kl_k3"), ("prob_l2", "prob_l2"), ("nm_es", "neural_mirror")
    ]
    with pytest.raises(GridError, match="appears twice"):
        parse_regularizers("kl_k3,kl_k3")
    with pytest.raises(GridError, match="bad label"):
        parse_regularizers("a/b=kl_k3")
    with pytest.raises(GridError, match="empty"):
        parse_regularizers(" , ")


def test_parse_seeds_and_coefs():
    assert parse_seeds("0,1,2") == [0, 1, 2]
    assert parse_seeds("0-2,7") == [0, 1, 2, 7]
    bad_inputs = (("1,1", "twice"), ("x", "not an integer"), ("3-1", "empty range"), ("", "empty"))
    for bad, msg in bad_inputs:
        with pytest.raises(GridError, match=msg):
            parse_seeds(bad)
    assert parse_coefs("kl_k3=0.1, none=0") == {"kl_k3": 0.1, "none": 0.0}
    assert parse_coefs(None) == {}
    with pytest.raises(GridError, match="LABEL=VALUE"):
        parse_coefs("kl_k3")
    with pytest.raises(GridError, match="not a number"):
        parse_coefs("kl_k3=big")


def test_grid_keys_cannot_be_overridden():
    check_overrides([("lr", "1e-4"), ("run.time_budget_seconds", "60")])
    for key, option in (("regularizer", "--regularizers"), ("coef", "--coefs"),
                        ("seed", "--seeds"), ("run.output_dir", "--output-dir"),
                        ("task", "--task")):
        with pytest.raises(GridError, match=option):
            check_overrides([(key, "x")])


def test_plan_grid_configs_and_coefficients(tmp_path):
    base = load_config(None, [("objective.regularizer.coef", "0.2"), ("lr", "1e-4")])
    entries = parse_regularizers("kl_k3,prob_l2,neural_mirror,none,b=prob_l2")
    runs = plan_grid(base, entries, [0, 3], tmp_path, coefs={"b": 0.5})
    assert len(runs) == 10
    by = {(r.label, r.seed): r for r in runs}
    # base regularizer is prob_l2 at 0.2: used for prob_l2; documented defaults for the others
    assert by[("prob_l2", 0)].config.objective.regularizer.coef == 0.2
    assert by[("prob_l2", 0)].coef_source == "config"
    assert by[("kl_k3", 0)].config.objective.regularizer.coef == DEFAULT_COEFS["kl_k3"]
    assert by[("neural_mirror", 3)].config.objective.regularizer.coef == 1.0
    assert by[("none", 0)].config.objective.regularizer.coef == 0.0
    assert by[("b", 3)].config.objective.regularizer.coef == 0.5
    assert by[("b", 3)].coef_source == "--coefs"
    run = by[("kl_k3", 3)]
    assert run.config.run.seed == 3 and run.config.optim.lr == 1e-4
    assert run.run_dir == tmp_path / "runs" / "arithmetic" / "kl_k3" / "seed3"
    assert run.config.run.output_dir == str(run.run_dir)
    assert run.config.run.progress is False
    assert not (tmp_path / "runs").exists()  # planning creates nothing


def test_plan_grid_errors(tmp_path):
    base = load_config(None)
    with pytest.raises(GridError, match="valid names"):
        plan_grid(base, parse_regularizers("prob_l3"), [0], tmp_path)
    with pytest.raises(GridError, match="no coefficient for 'x'"):
        plan_grid(base, parse_regularizers("x=log_l2"), [0], tmp_path)
    with pytest.raises(GridError, match="unknown label"):
        plan_grid(base, parse_regularizers("kl_k3"), [0], tmp_path, coefs={"kl": 1.0})
    with pytest.raises(GridError, match="nm"):
        plan_grid(base, parse_regularizers("nm=neural_mirror"), [0], tmp_path,
                  params={"nm": {"mirror": str(tmp_path / "missing.json")}})


def test_plan_grid_task_and_regularizer_params(tmp_path):
    from gbmpo.objectives.mirror import NeuralMirrorMap

    mirror = NeuralMirrorMap.random(scale=0.01, seed=3).save(tmp_path / "m.json")
    base = load_config(None, [("objective.regularizer.params.unused", "1")])
    runs = plan_grid(
        base,
        [GridEntry("nm", "neural_mirror"), GridEntry("kl_k3", "kl_k3")],
        [0],
        tmp_path,
        params={"nm": {"mirror": str(mirror)}},
        tasks=["arithmetic"],
    )
    # params of the base regularizer (prob_l2) are not carried over to other regularizers
    assert runs[0].config.objective.regularizer.params == {"mirror": str(mirror)}
    assert runs[1].config.objective.regularizer.params == {}


def _finish(run_dir, config):
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(config, run_dir / "config.yaml")
    (run_dir / "summary.json").write_text(json.dumps({"status": "finished"}))


def test_plan_action_reuse_resume_fresh(tmp_path):
    base = load_config(None, [("steps", "5")])
    (run,) = plan_grid(base, parse_regularizers("kl_k3"), [0], tmp_path)
    assert plan_action(run) == ("fresh", [])
    run.run_dir.mkdir(parents=True)
    assert plan_action(run) == ("fresh", [])  # empty directory

    dump_yaml(run.config, run.run_dir / "config.yaml")  # unfinished, same config
    assert plan_action(run) == ("resume", [])
    longer = copy.deepcopy(run)
    longer.config.run.steps = 9  # the trainer may change run.steps on resume
    assert plan_action(longer) == ("resume", [("run.steps", 9)])
    other = copy.deepcopy(run)
    other.config.optim.lr = 1e-3  # not resumable: start over
    assert plan_action(other) == ("fresh", [])

    _finish(run.run_dir, run.config)
    assert plan_action(run) == ("reuse", [])
    # where it writes and whether it shows a progress bar does not matter
    moved = copy.deepcopy(run)
    moved.config.run.progress = True
    assert plan_action(moved) == ("reuse", [])
    with pytest.raises(GridError, match="optim.lr"):
        plan_action(other)
    (run.run_dir / "summary.json").write_text("{broken")
    assert plan_action(run) == ("resume", [])


def test_plan_action_reuses_a_run_saved_under_an_old_key_name(tmp_path):
    base = load_config(None, [("steps", "5")])
    (run,) = plan_grid(base, parse_regularizers("kl_k3"), [0], tmp_path)
    _finish(run.run_dir, run.config)
    text = (run.run_dir / "config.yaml").read_text()
    assert "  generator: gbmpo\n" in text
    old = text.replace("  generator: gbmpo\n", "  engine: gbmpo\n")  # saved before the rename
    (run.run_dir / "config.yaml").write_text(old)
    with pytest.warns(DeprecationWarning, match="rollout.generator"):
        assert plan_action(run) == ("reuse", [])


def test_plan_action_reuses_a_run_saved_before_a_key_existed(tmp_path):
    """A key added later (here ``objective.regularizer.estimator``) compares with its default:
    a finished grid stays reusable after an upgrade."""
    base = load_config(None, [("steps", "5")])
    (run,) = plan_grid(base, parse_regularizers("kl_k3"), [0], tmp_path)
    _finish(run.run_dir, run.config)
    text = (run.run_dir / "config.yaml").read_text()
    assert "    estimator: sample\n" in text
    (run.run_dir / "config.yaml").write_text(text.replace("    estimator: sample\n", ""))
    assert plan_action(run) == ("reuse", [])
    full = copy.deepcopy(run)  # the key's value still matters when it is not the default
    full.config.objective.regularizer.estimator = "full"
    with pytest.raises(GridError, match="estimator"):
        plan_action(full)
