"""``GBMPOTrainer`` with a controlled coefficient (``objective.regularizer.control``): the
coefficient moves at each optimizer step by the own engine's update from the window's measure,
is logged, saved in the checkpoint and restored on resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from gbmpo.engines.trl.trainer import DRIFT_STATE_FILE  # noqa: E402
from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer  # noqa: E402
from gbmpo.objectives.drift_control import proportional_coef  # noqa: E402

OBJECTIVE = {"regularizer": {"name": "prob_l2", "coef": 0.1,
                             "control": {"target": 1e-4, "horizon": 2}}}  # fmt: skip


def _trainer(out: Path, model: str, data: Any, reward: Any, cpu: dict[str, Any],
             **extra: Any) -> Any:  # fmt: skip
    args = GBMPOConfig(output_dir=str(out), **{**cpu, "save_strategy": "steps", "save_steps": 2},
                       max_completion_length=6, max_steps=4, learning_rate=1e-2,
                       logging_steps=1, objective=OBJECTIVE, **extra)  # fmt: skip
    return GBMPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data)


def test_the_coefficient_moves_is_saved_and_resumes(
    tmp_path: Path, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:  # fmt: skip
    full = _trainer(tmp_path / "full", tiny_model_dir, tiny_dataset, reward_fn, cpu_args)
    full.train()
    logs = [h for h in full.state.log_history if "drift_coef/prob_l2" in h]
    coefs = [h["drift_coef/prob_l2"] for h in logs]
    measures = [h["drift_measure/prob_l2"] for h in logs]
    assert len(logs) == 4 and coefs[0] == 0.1
    assert measures == [h["reg/kl_k3"] for h in logs]  # measure kl: the window's reg/kl_k3
    for i in range(3):  # each step's coefficient is the update of the one before
        assert coefs[i + 1] == proportional_coef(coefs[i], measures[i], target=1e-4,
                                                 horizon=2.0)  # fmt: skip
    saved = json.loads((tmp_path / "full" / "checkpoint-2" / DRIFT_STATE_FILE).read_text())
    assert saved == {"prob_l2": coefs[2]}  # the coefficient of step 3
    resumed = _trainer(tmp_path / "full", tiny_model_dir, tiny_dataset, reward_fn, cpu_args)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    again = [h["drift_coef/prob_l2"] for h in resumed.state.log_history
             if "drift_coef/prob_l2" in h]  # fmt: skip
    assert again[-2] == coefs[2]  # step 3 continues from the saved coefficient, bit for bit


def test_the_coefficient_moves_once_per_generation_batch(
    tmp_path: Path, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:  # fmt: skip
    """Two optimizer steps per generation batch: the coefficient moves after the second (the
    own engine's RL step), from the batch's measure, so it is logged once per batch."""
    trainer = _trainer(tmp_path / "out", tiny_model_dir, tiny_dataset, reward_fn, cpu_args,
                       steps_per_generation=2)  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    assert [("drift_coef/prob_l2" in h) for h in logs] == [False, True, False, True]
    first, second = (h for h in logs if "drift_coef/prob_l2" in h)
    assert first["drift_coef/prob_l2"] == 0.1
    assert second["drift_coef/prob_l2"] == proportional_coef(
        0.1, first["drift_measure/prob_l2"], target=1e-4, horizon=2.0)
