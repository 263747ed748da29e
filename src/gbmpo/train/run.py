"""The pieces of the own trainer's run (:meth:`gbmpo.train.Trainer.train`: its training loop,
checkpoints, final model and summary) that hold no state: the placement line, the metrics
logging, the drift reference, the model export and the summary.

The lifecycle around the run (the lock, ``status.json``, SIGTERM / SIGINT, ``summary.json``) is
every engine's :class:`gbmpo.lifecycle.RunLifecycle`. A resumed run continues from its last
intact checkpoint with the metrics rows that checkpoint counted.

SIGTERM / SIGINT (:mod:`gbmpo.io.stop`): the step under way finishes, a checkpoint is written,
``status.json`` says ``preempted`` / ``interrupted`` with the step and the checkpoint, and
:class:`gbmpo.io.RunStopped` is raised (its message: the checkpoint and the resume command); a
second signal stops at once (the last complete checkpoint is kept).

The run-directory names and helpers that lived here (``CONFIG_FILE``, ``STATUS_FILE``,
``SUMMARY_FILE``, ``MODEL_DIR``, ``RESUMABLE_OVERRIDES``, ``default_run_dir``,
``refuse_nonempty``, ``resume_config``, ``no_checkpoint_error``, ``write_status``) are
:mod:`gbmpo.lifecycle`'s, and ``final_drift`` / ``fmt_drift`` are
:mod:`gbmpo.eval.drift`'s; they are re-exported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gbmpo.config import TrainConfig
from gbmpo.eval.drift import INITIAL as INITIAL
from gbmpo.eval.drift import final_drift as final_drift
from gbmpo.eval.drift import fmt_drift as fmt_drift
from gbmpo.lifecycle import CONFIG_FILE as CONFIG_FILE
from gbmpo.lifecycle import MODEL_DIR as MODEL_DIR
from gbmpo.lifecycle import RESUMABLE_OVERRIDES as RESUMABLE_OVERRIDES
from gbmpo.lifecycle import STATUS_FILE as STATUS_FILE
from gbmpo.lifecycle import SUMMARY_FILE as SUMMARY_FILE
from gbmpo.lifecycle import default_run_dir as default_run_dir
from gbmpo.lifecycle import no_checkpoint_error as no_checkpoint_error
from gbmpo.lifecycle import refuse_nonempty as refuse_nonempty
from gbmpo.lifecycle import resume_config as resume_config
from gbmpo.lifecycle import write_status as write_status
from gbmpo.lifecycle.console import main_metric
from gbmpo.lifecycle.logging import MetricsWriter, Reporters
from gbmpo.train.device import device_memory_bytes, peak_memory_bytes
from gbmpo.train.precision import MasterWeightOptimizer

__all__ = ["drift_reference", "export_model", "log", "placement", "run_summary"]


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2**30


def log(writer: MetricsWriter, reporters: Reporters, record: dict[str, Any]) -> None:
    """One metrics row: to metrics.jsonl and to every reporter, at the row's step."""
    writer.write(record)
    reporters.log(record, record["step"])


def drift_reference(ref_model: Any, initial_model: Any) -> Any:
    """The reference the own engine holds for the end-of-run drift: its frozen copy, else the
    copy of the initial weights kept when a model object was passed in, else :data:`INITIAL`
    (the initial weights reloaded)."""
    if ref_model is not None:
        return ref_model
    return initial_model if initial_model is not None else INITIAL


def export_model(model: Any, tokenizer: Any, out: Path) -> None:
    """The final model and its tokenizer, saved under ``out`` (``<run dir>/final_model``)."""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def run_summary(
    cfg: TrainConfig, *, steps: int, stop_reason: str, wall_seconds: float, rl_seconds: float,
    eval_before: dict[str, Any] | None, eval_after: dict[str, Any] | None, reward_failures: int,
    device: Any, weights_dtype: Any, optimizer: Any, run_dir: Path | None, objective: Any,
) -> dict[str, Any]:
    """summary.json's fields (before the drift): the run's counters and evaluations, its
    settings, where it ran, each controlled coefficient's setting and final value (from
    ``objective``), and the gain of the main metric from ``eval_before`` to ``eval_after``."""
    summary: dict[str, Any] = {
        "status": "finished",
        "engine": "gbmpo",
        "steps": steps,
        "stop_reason": stop_reason,
        "wall_seconds": wall_seconds,
        "rl_seconds": rl_seconds,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "reward_failures": reward_failures,
        "model": cfg.model.path,
        "task": cfg.task.name,
        "advantage": cfg.objective.advantage,
        "surrogate": cfg.objective.surrogate.name,
        "regularizer": cfg.objective.regularizer_label,
        "coef": cfg.objective.coef_label,
        "aggregation": cfg.objective.aggregation,
        "seed": cfg.run.seed,
        "device": str(device),
        "dtype": str(weights_dtype).removeprefix("torch."),
        "fp32_master_weights": isinstance(optimizer, MasterWeightOptimizer),
        "peak_memory_gib": _gib(peak_memory_bytes(device)),
        "run_dir": str(run_dir),
        "final_model": str(run_dir / MODEL_DIR) if run_dir else None,
    }
    if objective.controlled:  # each controlled coefficient: its setting and final value
        summary["drift_control"] = {
            t.name: {**t.control.to_dict(), "final_coef": t.coef}
            for t in objective.controlled if t.control is not None
        }
    key = main_metric(eval_before or eval_after or {})
    if key and eval_before and eval_after:
        summary["gain"] = {key: eval_after[key] - eval_before[key]}
    return summary


def placement(device: Any, weights_dtype: Any, optimizer: Any) -> str:
    """One line: device, weights dtype, master weights, device memory."""
    dtype = str(weights_dtype).removeprefix("torch.")
    line = f"device {device}, trainable weights {dtype}"
    if isinstance(optimizer, MasterWeightOptimizer):
        line += " (fp32 master weights)"
    total = device_memory_bytes(str(device))
    if total is not None and device.type != "cpu":
        line += f", {total / 2**30:.1f} GiB device memory"
    return line
