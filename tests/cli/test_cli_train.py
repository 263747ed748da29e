"""``gbmpo train`` through :func:`gbmpo.cli.main`: bad input -> exit 2 and no finished-looking
run directory; dry run; resume; overrides reach the saved config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gbmpo.cli import main, parse_overrides
from gbmpo.lifecycle.logging import read_metrics
from gbmpo.tasks import TASKS, Task

SMALL = [
    "--rollout.prompts_per_step",
    "2",
    "--num-generations",
    "2",
    "--max-new-tokens",
    "6",
    "--eval.before",
    "false",
    "--eval.after",
    "false",
    "--eval-every",
    "0",
    "--time-budget",
    "null",
    "--run.progress",
    "false",
    "--mu",
    "1",
    "--optim.mini_batch_size",
    "null",
]


def _finished(run: Path) -> bool:
    return (run / "summary.json").exists()


def test_overrides_parsing():
    assert parse_overrides(["--lr", "1e-4", "--lora", "--steps=5", "--coef", "-0.1"]) == [
        ("lr", "1e-4"),
        ("lora", "true"),
        ("steps", "5"),
        ("coef", "-0.1"),
    ]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--regularizer", "prob_l3"], "valid names"),
        (["--surrogate", "nope"], "valid names"),
        (["--optim.learning_rate", "1"], "unknown key 'optim.learning_rate'"),
        (["--steps", "many"], "'run.steps' must be int"),
        (["--steps"], "--steps needs a value"),
        (["stray"], "unexpected argument 'stray'"),
        (["--objective.surrogate.params.eps_hgh", "0.3"], "eps_hgh"),
        (["--config", "/nonexistent/c.yaml"], "does not exist"),
        (["--model", "/nonexistent/model-dir"], "/nonexistent/model-dir"),
        (["--rollout.num_generations", "1", "--dry-run"], "a group of one has advantage 0"),
    ],
)
def test_bad_input_exit_2_without_run_dir(tmp_path, capsys, args, needle):
    run = tmp_path / "run"
    code = main(["train", "--output-dir", str(run), *SMALL, *args])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and err.startswith("gbmpo train: error:")
    assert not run.exists()


def test_unknown_regularizer_lists_every_registered_name(capsys):
    from gbmpo.objectives.regularizers import REGULARIZERS

    assert main(["train", "--regularizer", "prob_l3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    for name in REGULARIZERS.names():
        assert name in err


def test_empty_training_split_exit_2(micro_model_dir, tmp_path, capsys, monkeypatch):
    class EmptyTask(Task):
        name = "empty_for_test"

        def split(self, name):
            return []

        def reward(self, prompts, completions, **columns):
            return [0.0] * len(completions)

    monkeypatch.setitem(TASKS._items, "empty_for_test", EmptyTask)
    run = tmp_path / "run"
    args = [
        "train",
        "--model",
        str(micro_model_dir),
        "--task",
        "empty_for_test",
        "--output-dir",
        str(run),
        *SMALL,
    ]
    assert main(args) == 2
    assert "training split 'train' is empty" in capsys.readouterr().err
    assert not run.exists()
    assert main([*args, "--dry-run"]) == 2


def test_bad_task_params_exit_2(micro_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--model", str(micro_model_dir), "--task.params.num_train", "0"]
    assert main([*args, "--output-dir", str(run), *SMALL]) == 2
    assert "num_train" in capsys.readouterr().err
    assert not run.exists()


def test_existing_output_dir_is_refused(micro_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "something").write_text("x")
    assert main(["train", "--model", str(micro_model_dir), "--output-dir", str(run), *SMALL]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not _finished(run)


def test_dry_run_builds_without_run_dir(micro_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--model", str(micro_model_dir), "--output-dir", str(run), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "dry run OK" in out and '"model_type": "qwen3"' in out
    assert not run.exists()


def test_print_config_is_loadable_yaml(capsys):
    assert main(["train", "--regularizer", "kl_k3", "--coef", "0.02", "--print-config"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["objective"]["regularizer"] == {
        "name": "kl_k3",
        "coef": 0.02,
        "anchor": "ref",
        "params": {},
        "placement": "loss",
        "estimator": "sample",
        "control": None,  # a fixed coefficient (objective.regularizer.control)
    }


def test_train_writes_run_dir_and_resume_refuses_finished(micro_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        "--model",
        str(micro_model_dir),
        "--output-dir",
        str(run),
        "--steps",
        "2",
        "--regularizer",
        "kl_k3",
        "--coef",
        "0.01",
        *SMALL,
    ]
    assert main(args) == 0
    assert "finished 2 steps" in capsys.readouterr().out
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["objective"]["regularizer"]["name"] == "kl_k3"
    assert saved["run"]["steps"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["regularizer"] == "kl_k3"
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "response_length_mean",
        "entropy",
        "lr",
        "grad_norm",
        "clip_frac_low",
        "clip_frac_high",
        "step_seconds",
        "tokens_per_second",
        "reg/kl_k3",
        "reg/prob_l2",
        "reg/rpg_ufkl",
        "reg_value",
    ):
        assert key in records[0], key
    assert main(["train", "--resume", str(run)]) == 2
    assert "already finished" in capsys.readouterr().err


def test_resume_rejects_changing_the_objective(micro_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(micro_model_dir)}}))
    assert main(["train", "--resume", str(run), "--regularizer", "kl_k3"]) == 2
    assert "cannot change 'objective.regularizer.name'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "is a directory; name a YAML file in it, e.g. "),
        ("", "is empty (no settings)"),
        ("# nothing but a comment\n", "is empty (no settings)"),
        ('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "vocab_size": 10}',
         "is not a gbmpo training config: its top-level keys (architectures, hidden_size, "
         "vocab_size) are none of engine, model"),
        ("optim:\n  lrr: 1e-4\n", "unknown key 'optim.lrr'; valid keys under 'optim': lr, "),
        ("regulariser: kl_k3\n", "did you mean 'objective.regularizer.name'? (in a YAML file: "
         "objective: regularizer: name: ...)"),
        ("lr: 1e-4\n", "did you mean 'optim.lr'? (in a YAML file: optim: lr: ...)"),
    ],
)
def test_config_files_of_the_wrong_kind_get_one_clear_line(tmp_path, capsys, content, needle):
    """A directory, an empty file, another kind of file and unknown keys (with the command
    line's "did you mean", pointing an alias or a bare field name to its nested key)."""
    path = tmp_path / "cfg"
    if content is None:
        (path / "paper").mkdir(parents=True)
        (path / "paper" / "a.yaml").write_text("task:\n  name: arithmetic\n")
    else:
        path.write_text(content)
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    if content is None:
        assert str(path / "paper" / "a.yaml") in err[0]
