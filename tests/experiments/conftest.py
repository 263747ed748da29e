"""Helpers for the comparison tests: fabricated run directories and the ``compare`` / ``report``
entry point (:func:`gbmpo.cli.main`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gbmpo.cli import main
from gbmpo.config import TrainConfig, dump_yaml
from gbmpo.objectives.drift_control import DriftControl


def cli(argv: Sequence[str]) -> int:
    """``gbmpo compare|report ...`` through the ``gbmpo`` command's entry point."""
    return main(list(argv))


def fake_run(
    path: Path,
    *,
    regularizer: str,
    seed: int,
    final: float,
    before: float = 0.5,
    coef: float = 0.05,
    task: str = "arithmetic",
    steps: int = 20,
    lr: float = 5e-5,
    finished: bool = True,
    response_tokens: float = 25.0,
    wall: float = 100.0,
    drift: dict[str, Any] | None = None,
    eval_extra: dict[str, Any] | None = None,
    control: DriftControl | None = None,
) -> Path:
    """A run directory as the trainer writes it, with made-up numbers (``drift``: the summary's
    ``drift`` record, absent when ``None``; ``eval_extra``: more final-evaluation metrics,
    e.g. a pass@k curve; ``control``: a controlled coefficient, whose ``drift_coef/<name>`` is
    ``coef * (1 + step / 100)`` and whose ``drift_measure/<name>`` is the step's ``reg/kl_k3``)."""
    cfg = TrainConfig()
    cfg.task.name = task
    cfg.objective.regularizer.name = regularizer
    cfg.objective.regularizer.coef = coef
    cfg.objective.regularizer.control = control
    cfg.run.seed = seed
    cfg.run.steps = steps
    cfg.optim.lr = lr
    cfg.run.output_dir = str(path)
    path.mkdir(parents=True)
    dump_yaml(cfg, path / "config.yaml")
    records: list[dict[str, Any]] = [{"step": 0, "eval/accuracy": before, "eval/n": 200}]
    for s in range(1, steps + 1):
        rec: dict[str, Any] = {
            "step": s,
            "reward_mean": before + (final - before) * s / steps + 0.01 * seed,
            "response_length_mean": 30.0 - s * 0.1,
            "reg/kl_k3": 1e-3 * s,
            "reg/prob_l2": 2e-4 * s,
        }
        if control is not None:
            rec[f"drift_coef/{regularizer}"] = coef * (1 + s / 100)
            rec[f"drift_measure/{regularizer}"] = rec["reg/kl_k3"]
        if s % 10 == 0:
            rec["eval/accuracy"] = before + (final - before) * s / steps
        records.append(rec)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        summary = {
            "status": "finished",
            "steps": steps,
            "stop_reason": "steps",
            "wall_seconds": wall,
            "rl_seconds": wall - 10,
            "eval_before": {"accuracy": before, "n": 200, "mean_response_tokens": 26.0},
            "eval_after": {"accuracy": final, "n": 200, "mean_response_tokens": response_tokens,
                           **(eval_extra or {})},
            "task": task,
            "regularizer": regularizer,
            "coef": coef,
            "seed": seed,
        }
        if drift is not None:
            summary["drift"] = drift
        (path / "summary.json").write_text(json.dumps(summary))
    return path


@pytest.fixture(scope="session")
def gbmpo_cli():  # noqa: ANN201 - the cli function
    return cli


@pytest.fixture(scope="session")
def make_run():  # noqa: ANN201 - the fake_run function
    return fake_run
