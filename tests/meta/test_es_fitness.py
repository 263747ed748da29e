"""ES fitness: validation carved disjoint from inner training; a member = a short Trainer run;
the ``gbmpo es`` command (tiny settings, in-process backend) and its resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from gbmpo.cli import main as cli_main
from gbmpo.meta.backends import SerialBackend
from gbmpo.meta.config import load_es_config
from gbmpo.meta.fitness import HeldOutSplitTask, TrainingFitness, default_inner_config
from gbmpo.objectives.mirror import VECTOR_SIZE, NeuralMirrorMap
from gbmpo.tasks import get_task

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _prompts(examples):
    return {ex["prompt"] for ex in examples}


def test_validation_is_carved_disjoint_from_inner_training() -> None:
    base = get_task("arithmetic", num_train=600, num_test=50)
    task = HeldOutSplitTask(base, size=100, seed=3)
    inner, val = task.split("train"), task.split("validation")
    assert len(val) == 100 and len(_prompts(val)) == 100
    assert not _prompts(inner) & _prompts(val)
    # every training example is either validation or inner training
    source = base.split("train")
    assert _prompts(inner) | _prompts(val) == _prompts(source)
    # the task's own held-out test split is untouched and disjoint from both
    assert task.split("test") == base.split("test")
    assert not _prompts(task.split("test")) & (_prompts(inner) | _prompts(val))
    # seeded: same seed, same split; another seed, another one
    assert HeldOutSplitTask(base, size=100, seed=3).split("validation") == val
    assert HeldOutSplitTask(base, size=100, seed=4).split("validation") != val
    assert task.train_split == "train" and task.eval_split == "validation"
    assert task.kind == "math"
    ex = val[:2]
    assert task.reward([e["prompt"] for e in ex], [f"#### {e['answer']}" for e in ex],
                       **task.columns(ex)) == [1.0, 1.0]


def test_duplicated_training_prompts_never_leak_into_validation() -> None:
    class Dup:
        name, kind, train_split = "dup", "math", "train"

        def split(self, name):
            rows = [{"prompt": f"q{i % 5}", "answer": "1"} for i in range(20)]
            return rows

    task = HeldOutSplitTask(Dup(), size=2, seed=0)  # type: ignore[arg-type]
    inner, val = task.split("train"), task.split("validation")
    assert len(val) == 2 and len(inner) == 12  # 3 distinct prompts x 4 copies stay
    assert not _prompts(inner) & _prompts(val)
    with pytest.raises(ValueError, match="leaves no training prompts"):
        HeldOutSplitTask(Dup(), size=5)  # type: ignore[arg-type]


@pytest.mark.skipif(not (DATA / "gsm8k" / "train.jsonl").is_file(), reason="no GSM8K data")
def test_gsm8k_validation_does_not_overlap_inner_training() -> None:
    """The authors' inner split (first 80% unshuffled) overlaps their shuffled validation 20%
    (docs/methods.md, "Choices" item 10); the carve here is disjoint by construction."""
    base = get_task("gsm8k", path=str(DATA / "gsm8k"))
    task = HeldOutSplitTask(base, size=1495, seed=42)
    inner, val = task.split("train"), task.split("validation")
    assert len(val) == 1495 and len(inner) + len(val) == len(base.split("train"))
    assert not _prompts(inner) & _prompts(val)
    authors_inner = base.split("train")[: int(0.8 * len(base.split("train")))]
    assert _prompts(authors_inner) & _prompts(val)  # what the authors' split would leak


def _tiny_train_config() -> dict:
    cfg = default_inner_config()
    cfg["rollout"].update(prompts_per_step=2, num_generations=2, max_new_tokens=24)
    cfg["task"]["params"] = {"num_train": 200, "num_test": 20}
    cfg["eval"] = {"max_new_tokens": 24}
    cfg["optim"]["mini_batch_size"] = None  # the whole (4-completion) batch
    return cfg


def test_fitness_config_checks() -> None:
    bad = _tiny_train_config()
    bad["objective"]["regularizer"]["name"] = "prob_l2"
    with pytest.raises(ValueError, match="neural_mirror"):
        TrainingFitness(train_config=bad)
    with pytest.raises(ValueError, match="inner steps"):
        TrainingFitness(train_config=_tiny_train_config(), steps=0)
    cfg = TrainingFitness(train_config=_tiny_train_config(), steps=3).resolved_config(None)
    assert cfg.run.steps == 3 and cfg.run.time_budget_seconds is None
    assert cfg.eval.every == 0 and not cfg.eval.before and not cfg.eval.after
    assert cfg.eval.split == "validation" and cfg.run.output_dir is None


def test_member_fitness_is_a_validation_score_and_nan_members_fail() -> None:
    fit = TrainingFitness(train_config=_tiny_train_config(), steps=1, validation_size=8)
    theta = NeuralMirrorMap.random(scale=0.01, seed=42).to_unconstrained().numpy()
    # a map whose potential overflows (exp units with huge offsets) makes the loss non-finite
    blown = np.zeros(VECTOR_SIZE)
    blown[105:126] = 1.0  # v of the exp units
    blown[126 + 105 : 126 + 126] = 1.0  # w
    blown[252 + 105 : 252 + 126] = 1000.0  # b: exp(1000) = inf
    score, again, failed = SerialBackend(threads=1).evaluate(fit, [theta, theta, blown])
    assert 0.0 <= score <= 1.0 and score * 8 == round(score * 8)  # accuracy on 8 problems
    assert again == score  # same map, same seed: same member
    assert isinstance(failed, FloatingPointError) and "non-finite" in str(failed)


def test_es_command_runs_resumes_and_exports_a_trainable_map(tmp_path, capsys) -> None:
    cfg = {
        "es": {"population": 4, "iterations": 1, "sigma0": 0.05, "seed": 0},
        "fitness": {"steps": 1, "validation_size": 8},
        "train": _tiny_train_config(),
        "backend": {"name": "serial"},
    }
    path = tmp_path / "es.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert cli_main(["es", "--config", str(path), "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fitness mean" in printed and "ACCEPTED" in printed  # first iteration accepts
    assert cli_main(["es", "--resume", str(out), "--iterations", "2"]) == 0
    printed = capsys.readouterr().out
    assert "iter   1" in printed and "iter   0" not in printed
    doc = json.loads((out / "es_state.json").read_text())
    assert doc["iteration"] == 2 and len(doc["history"]) == 2
    assert doc["run"]["fitness"]["steps"] == 1
    mirror = NeuralMirrorMap.load(out / "best_mirror.json")
    from gbmpo.config import load_config, validate

    train_cfg = load_config(overrides=[("regularizer", "neural_mirror"),
                                       ("mirror", str(out / "best_mirror.json"))])
    validate(train_cfg)  # what `gbmpo train --regularizer neural_mirror --mirror FILE` checks
    assert mirror.to_vector().shape == (VECTOR_SIZE,)


def test_es_command_reports_bad_input(tmp_path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("es: {population: 5}\n")
    assert cli_main(["es", "--config", str(path), "--output-dir", str(tmp_path / "x")]) == 2
    assert "even" in capsys.readouterr().err
    path.write_text("fitnes: {steps: 2}\n")
    with pytest.raises(ValueError, match="unknown ES config section"):
        load_es_config(path)
    assert cli_main(["es", "--resume", str(tmp_path / "nothing")]) == 2
