"""Configuration: YAML round trip, overrides, unknown keys, wrong types, registry names."""

from __future__ import annotations

import pytest
import yaml

from gbmpo.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    validate,
)
from gbmpo.registry import UnknownNameError


def test_defaults_are_the_embedded_recipe():
    cfg = validate(TrainConfig())
    assert cfg.model.path == "tiny" and cfg.task.name == "arithmetic"
    assert cfg.objective.advantage == "dr_grpo" and cfg.objective.aggregation == "dr_grpo"
    assert cfg.objective.regularizer.name == "prob_l2"
    assert (cfg.rollout.prompts_per_step, cfg.rollout.num_generations) == (8, 8)
    assert cfg.rollout.max_new_tokens == 40 and cfg.rollout.temperature == 1.0
    assert cfg.optim.lr == 5e-5 and cfg.optim.schedule == "cosine" and cfg.optim.min_lr_ratio == 0
    assert cfg.optim.mu == 1 and cfg.optim.mini_batch_size == 16


def test_yaml_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            ("optim.lr", "1e-4"),
            ("optim.betas", "[0.8, 0.95]"),
            ("objective.surrogate.params.eps_high", "0.28"),
            ("lora.target_modules", "q_proj,v_proj"),
            ("run.time_budget_seconds", "null"),
        ],
    )
    path = tmp_path / "c.yaml"
    dump_yaml(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert again.optim.betas == (0.8, 0.95)
    assert again.objective.surrogate.params == {"eps_high": 0.28}
    assert again.lora.target_modules == ["q_proj", "v_proj"]
    assert again.run.time_budget_seconds is None
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_yaml_file_then_cli_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 5e-5\n  mu: 3\nrun:\n  steps: 7\n")
    cfg = load_config(path, [("--lr", "3e-4"), ("--steps", "9")])
    assert cfg.optim.lr == 3e-4 and cfg.optim.mu == 3 and cfg.run.steps == 9


@pytest.mark.parametrize(
    ("alias", "value", "attr", "expected"),
    [
        ("--regularizer", "kl_k3", ("objective", "regularizer", "name"), "kl_k3"),
        ("--coef", "0.1", ("objective", "regularizer", "coef"), 0.1),
        ("--seed", "3", ("run", "seed"), 3),
        ("--output-dir", "x/y", ("run", "output_dir"), "x/y"),
        ("--lora", "true", ("lora", "enabled"), True),
        ("--report-to", "tensorboard,wandb", ("run", "report_to"), ["tensorboard", "wandb"]),
        ("--optim.grad-clip", "none", ("optim", "grad_clip"), None),
        (
            "--objective.regularizer.name",
            "prob_l2",
            ("objective", "regularizer", "name"),
            "prob_l2",
        ),
    ],
)
def test_aliases_and_dotted_keys(alias, value, attr, expected):
    cfg = load_config(None, [(alias, value)])
    node = cfg
    for a in attr:
        node = getattr(node, a)
    assert node == expected


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([("optim.learning_rate", "1")], "unknown key 'optim.learning_rate'"),
        ([("nosuch", "1")], "unknown key 'nosuch'"),
        ([("rollout.num_generations", "eight")], "'rollout.num_generations' must be int"),
        ([("optim.lr", "fast")], "'optim.lr' must be float"),
        ([("lora.enabled", "maybe")], "'lora.enabled' must be bool"),
        ([("optim.betas", "[0.9]")], "'optim.betas' must be a list of 2 values"),
        ([("run.steps", "null")], "'run.steps' must be int, got 'null'"),
        ([("optim.lr.x", "1")], "'optim.lr' is a float, it has no key 'x'"),
        ([("optim", "1")], "'optim' is a section"),
    ],
)
def test_override_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "optim:\n  learning_rate: 1\n",
            "unknown key 'optim.learning_rate'; valid keys under 'optim'",
        ),
        ("rollout:\n  num_generations: 2.5\n", "'rollout.num_generations' must be int, got float"),
        ("lora:\n  enabled: 1\n", "'lora.enabled' must be bool"),
        ("task: arithmetic\n", "'task' must be a mapping"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("optim: {lr: [1\n", "not valid YAML"),
    ],
)
def test_yaml_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


# --- renamed keys: rollout.engine -> rollout.generator ---------------------------------------


def test_old_generator_key_is_read_with_a_deprecation_warning(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  engine: hf\n")
    with pytest.warns(DeprecationWarning, match="'rollout.engine' is deprecated: it is now "
                      "'rollout.generator'"):
        assert load_config(path).rollout.generator == "hf"
    with pytest.warns(DeprecationWarning, match="rollout.generator"):
        assert load_config(None, [("rollout.engine", "hf")]).rollout.generator == "hf"
    with pytest.warns(DeprecationWarning, match="rollout.generator"):
        assert config_from_dict({"rollout": {"engine": "hf"}}).rollout.generator == "hf"
    assert "engine" not in config_to_dict(load_config(None))["rollout"]  # saved as the new key


@pytest.mark.parametrize("source", ["yaml", "overrides", "dict"])
def test_old_and_new_generator_keys_together_are_refused(tmp_path, source):
    both = "both 'rollout.engine' and 'rollout.generator' are given"
    with pytest.raises(ConfigError, match=both):
        if source == "yaml":
            path = tmp_path / "both.yaml"
            path.write_text("rollout:\n  engine: hf\n  generator: gbmpo\n")
            load_config(path)
        elif source == "overrides":
            load_config(None, [("rollout.generator", "gbmpo"), ("--rollout.engine", "hf")])
        else:
            config_from_dict({"rollout": {"engine": "hf", "generator": "gbmpo"}})


def test_cli_notes_the_old_generator_key(capsys):
    from gbmpo.cli import main

    assert main(["train", "--rollout.engine", "hf", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "note: 'rollout.engine' is deprecated: it is now 'rollout.generator'" in err
    assert "generator: hf" in out
    assert main(["train", "--rollout.engine", "hf", "--rollout.generator", "hf",
                 "--print-config"]) == 2
    assert "both 'rollout.engine' and 'rollout.generator' are given" in capsys.readouterr().err


def test_saved_config_yaml_is_plain(tmp_path):
    text = dump_yaml(TrainConfig())
    data = yaml.safe_load(text)
    assert data["objective"]["regularizer"]["name"] == "prob_l2"
    assert data["optim"]["betas"] == [0.9, 0.99]


@pytest.mark.parametrize(
    ("key", "value", "valid_name"),
    [
        ("objective.regularizer.name", "prob_l3", "prob_l2"),
        ("objective.surrogate.name", "clipp", "gspo"),
        ("objective.advantage", "ppo", "dr_grpo"),
        ("objective.aggregation", "mean", "bnpo"),
        ("task.name", "gsm9k", "arithmetic"),
    ],
)
def test_unknown_names_list_valid_ones(key, value, valid_name):
    cfg = load_config(None, [(key, value)])
    with pytest.raises(UnknownNameError) as err:
        validate(cfg)
    msg = str(err.value)
    assert key in msg and repr(value) in msg and valid_name in msg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([("objective.surrogate.params.eps_hgh", "0.3")], "eps_hgh"),
        ([("objective.regularizer.params.clamp", "1")], "clamp"),
        ([("optim.schedule", "linear")], "'optim.schedule'"),
        ([("optim.mini_batch_size", "48")], "must divide the rollout batch"),
        ([("optim.micro_batch_size", "5")], "must divide the mini-batch"),
        ([("rollout.temperature", "0")], "'rollout.temperature'"),
        ([("objective.regularizer.anchor", "base")], "'objective.regularizer.anchor'"),
        ([("run.report_to", "mlflow")], "unknown logger 'mlflow'"),
        ([("model.dtype", "float8")], "'model.dtype'"),
        ([("run.steps", "0")], "'run.steps'"),
        ([("rollout.num_generations", "1")], "a group of one has advantage 0"),
    ],
)
def test_invalid_values(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value)


def test_report_to_missing_package_is_named():
    import importlib.util

    missing = [
        n for n in ("tensorboard", "wandb", "trackio") if importlib.util.find_spec(n) is None
    ]
    if not missing:
        pytest.skip("every tracker package is installed")
    cfg = load_config(None, [("run.report_to", missing[0])])
    with pytest.raises(ConfigError, match=f"needs the {missing[0]} package"):
        validate(cfg)
