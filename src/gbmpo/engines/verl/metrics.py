"""verl's file log back into the run directory: ``metrics.jsonl`` under the schema's names
(:mod:`gbmpo.io.metrics`, verl's own under ``verl/``: :func:`convert_row`) and the run's summary
(:func:`summarize_run`), for ``gbmpo train --engine verl`` (:mod:`gbmpo.engines.verl.runner`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gbmpo.engines.checks import run_identity
from gbmpo.engines.verl.args import data_source
from gbmpo.engines.verl.driver import (
    ENTROPY_METRIC,
    FAILURES_METRIC,
    RL_SECONDS_METRIC,
)
from gbmpo.io import write_atomic
from gbmpo.io.metrics import DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX, MONITOR_PREFIX, host_name

__all__ = [
    "SHARED_METRICS",
    "VERL_EARLIER_METRICS_FILE",
    "VERL_METRICS_FILE",
    "convert_row",
    "eval_metrics",
    "read_verl_log",
    "rollout_correction_metrics",
    "summarize_run",
]

#: verl's log rows of the parts before a resume (verl's file logger starts its file afresh):
#: the rows up to the checkpoint each resume continues from
VERL_EARLIER_METRICS_FILE = "verl_metrics_before_resume.jsonl"


#: verl's file logger output in the run directory (``VERL_FILE_LOGGER_PATH``): one JSON object
#: ``{"step": N, "data": {metric: value}}`` per ``Tracking.log`` call
VERL_METRICS_FILE = "verl_metrics.jsonl"

#: verl metric -> metrics.jsonl schema name (:mod:`gbmpo.io.metrics`), where verl's definition is
#: the schema's. Kept only under ``verl/``: ``actor/lr`` (read after the step's scheduler step:
#: the next step's rate), ``response_length/clip_ratio`` (length equal to the limit, which also
#: counts an EOS in the last position), ``actor/pg_clipfrac*`` / ``actor/gbmpo/*`` (means of
#: per-micro-batch fractions, not fractions of the step's tokens), ``actor/loss``.
SHARED_METRICS: dict[str, str] = {
    "actor/pg_loss": "pg_loss",
    "actor/grad_norm": "grad_norm",
    "critic/score/mean": "reward_mean",
    "response_length/mean": "response_length_mean",
    "response_length/max": "response_length_max",
    "timing_s/step": "step_seconds",
}


def eval_metrics(cfg: Any, data: dict[str, Any], kind: str, n_eval: int | None = None
                 ) -> dict[str, Any] | None:  # fmt: skip
    """The own engine's evaluation metrics from one verl log row's validation metrics, or
    ``None`` when the row holds none.

    verl validates greedily (``val_kwargs``: ``do_sample=false``, ``n=1``) on data/test.parquet
    and reports ``val-core/<data_source>/acc/mean@1``, the mean over the examples of the reward
    function's ``acc`` (:func:`gbmpo.engines.verl.reward.compute_score`: the own evaluation's
    ``correct``), i.e. ``accuracy`` (``pass@1`` for code tasks), and
    ``val-aux/<data_source>/reward/mean@1``, the mean reward (``mean_reward``)."""
    ds = data_source(cfg)
    acc = data.get(f"val-core/{ds}/acc/mean@1")
    reward = data.get(f"val-aux/{ds}/reward/mean@1")
    if acc is None and reward is None:
        return None
    out: dict[str, Any] = {}
    if acc is not None:
        out["pass@1" if kind == "code" else "accuracy"] = float(acc)
    if reward is not None:
        out["mean_reward"] = float(reward)
    if n_eval is not None:
        out["n"] = n_eval
    out["samples"] = 1
    return out


def convert_row(cfg: Any, row: dict[str, Any], kind: str, n_eval: int | None = None
                ) -> dict[str, Any]:  # fmt: skip
    """One verl file-logger row -> one metrics.jsonl row: the schema names of
    :data:`SHARED_METRICS`, those of gbmpo's driver hooks
    (:mod:`gbmpo.engines.verl.driver`: ``reg/<name>``, ``drift_coef/<term>``,
    ``drift_measure/<term>``, ``entropy`` = the token mean of the
    entropy at pi_old over the step's batch, whatever the aggregation, ``time/rl_seconds``),
    ``eval/<metric>`` (:func:`eval_metrics`), and every verl metric under ``verl/<name>``."""
    data = row["data"]
    out: dict[str, Any] = {"step": int(row["step"])}
    for key, value in data.items():
        out[host_name("verl", key)] = value
        if key in SHARED_METRICS:
            out[SHARED_METRICS[key]] = value
        elif key.startswith((MONITOR_PREFIX, DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX)):
            out[key] = value  # the driver hooks' reg/<name> and drift_*/<term>: the schema's
    if ENTROPY_METRIC in data:
        out["entropy"] = data[ENTROPY_METRIC]
    if RL_SECONDS_METRIC in data:
        out["time/rl_seconds"] = data[RL_SECONDS_METRIC]
    reward_placed = [t for t in cfg.objective.terms if t.placement == "reward" and t.coef != 0]
    if reward_placed and "critic/score/mean" in data and "critic/rewards/mean" in data:
        # in-reward KL: score = task reward, rewards = score - kl_coef * sum_t D (per sequence)
        score, shaped = data["critic/score/mean"], data["critic/rewards/mean"]
        out["reward_penalty"] = float(score) - float(shaped)
    out.update(rollout_correction_metrics(cfg, data))
    ev = eval_metrics(cfg, data, kind, n_eval)
    if ev is not None:
        out.update({f"eval/{k}": v for k, v in ev.items()})
    return out


def rollout_correction_metrics(cfg: Any, data: dict[str, Any]) -> dict[str, float]:
    """``rollout_correction/*`` (:mod:`gbmpo.io.metrics`) from verl's ``rollout_corr/*``, where
    verl's numbers give the schema's definition (over the valid tokens of the applied weights):
    ``weight_mean`` is verl's ``rollout_is_mean`` (a token mean of the applied weights at both
    levels); at token level ``weight_min`` / ``weight_max`` are verl's ``rollout_is_min`` /
    ``_max``; at sequence level verl reports the raw ratios' extremes, so ``tis`` (a cap) has
    ``min`` = the raw min and ``max`` = min(raw max, high), and ``mis`` has them only when no
    sequence is masked (``min`` 0 otherwise); ``masked_frac`` is verl's ``rollout_is_oob_ratio``
    (mis, icepop) and 0 for ``tis`` (a capped weight is never 0: verl bounds the log-ratio at
    -20)."""
    rc = cfg.objective.rollout_correction
    p = "rollout_corr/rollout_is_"
    if rc.mode == "none" or f"{p}mean" not in data:
        return {}
    out: dict[str, float] = {"rollout_correction/weight_mean": float(data[f"{p}mean"])}
    lo, hi = data.get(f"{p}min"), data.get(f"{p}max")
    masked = 0.0 if rc.mode == "tis" else data.get(f"{p}oob_ratio")
    if masked is not None:
        out["rollout_correction/masked_frac"] = float(masked)
    if rc.level == "token" or (rc.mode != "tis" and masked == 0.0):
        if lo is not None:
            out["rollout_correction/weight_min"] = float(lo)
        if hi is not None:
            out["rollout_correction/weight_max"] = float(hi)
    elif rc.mode == "tis":
        if lo is not None:
            out["rollout_correction/weight_min"] = float(lo)
        if hi is not None:
            out["rollout_correction/weight_max"] = min(float(hi), float(rc.high))
    elif masked:
        out["rollout_correction/weight_min"] = 0.0
    return out


def read_verl_log(path: Path) -> list[dict[str, Any]]:
    """The rows of verl's file logger (:data:`VERL_METRICS_FILE`); ``[]`` when absent."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(
    cfg: Any,
    run_dir: Path,
    *,
    kind: str,
    wall_seconds: float,
    n_eval: int | None = None,
) -> dict[str, Any]:
    """Write metrics.jsonl (:func:`convert_row`) from verl's log and return the summary (every
    key of :data:`gbmpo.io.metrics.SUMMARY_KEYS`).

    verl logs the evaluation before training as the row of step 0 and each later one in the
    row of its training step. ``eval_before``: step 0's evaluation (with ``eval.before``);
    ``eval_after``: the evaluation in the row of the last training step (with ``eval.after``;
    :func:`validation_freq` makes verl validate there), ``None`` where there is none.
    ``rl_seconds``: the driver hooks' RL clock at the last step; ``stop_reason`` ``time_budget``
    where it reached ``run.time_budget_seconds`` before ``run.steps``; ``reward_failures``: the
    steps' failures summed; ``peak_memory_gib``: verl's workers' peak (``None`` on the CPU);
    ``drift`` / ``drift_seconds``: ``None`` here (the runner measures them on the merged
    model)."""
    # the parts before a resume (up to its checkpoint), then the last part
    rows = read_verl_log(run_dir / VERL_EARLIER_METRICS_FILE)
    rows += read_verl_log(run_dir / VERL_METRICS_FILE)
    converted = [convert_row(cfg, r, kind, n_eval) for r in rows]
    write_atomic(run_dir / "metrics.jsonl",
                 "".join(json.dumps(r, default=str) + "\n" for r in converted))  # fmt: skip
    steps = max((int(r["step"]) for r in rows if "training/global_step" in r["data"]),
                default=0)  # fmt: skip

    def eval_at(step: int) -> dict[str, Any] | None:
        found = None
        for r in rows:
            if int(r["step"]) == step:
                found = eval_metrics(cfg, r["data"], kind, n_eval) or found
        return found

    train = [r["data"] for r in rows if "training/global_step" in r["data"]]
    rl_seconds = max((float(d.get(RL_SECONDS_METRIC, 0.0)) for d in train), default=0.0)
    budget = cfg.run.time_budget_seconds
    stopped = budget is not None and steps < cfg.run.steps and rl_seconds >= budget
    peaks = [float(d["perf/max_memory_allocated_gb"]) for d in train
             if "perf/max_memory_allocated_gb" in d]  # fmt: skip
    return {
        "status": "finished",
        "engine": "verl",
        "steps": steps,
        "stop_reason": "time_budget" if stopped else "steps",
        "wall_seconds": wall_seconds,
        "rl_seconds": rl_seconds,
        "reward_failures": int(sum(float(d.get(FAILURES_METRIC, 0.0)) for d in train)),
        # verl's workers report torch's peak allocation in GiB (max_memory_allocated / 1024**3);
        # none on the CPU, as the own engine
        "peak_memory_gib": max(peaks) if peaks and cfg.model.device != "cpu" else None,
        "drift": None,
        "drift_seconds": None,
        "eval_before": eval_at(0) if cfg.eval.before else None,
        "eval_after": eval_at(steps) if cfg.eval.after and steps > 0 else None,
        **run_identity(cfg),
        "device": cfg.model.device,
        "gpus": cfg.run.num_processes * cfg.run.num_nodes if cfg.model.device != "cpu" else 0,
        "dtype": cfg.model.dtype,
        "fp32_master_weights": cfg.model.dtype == "bfloat16",
        "run_dir": str(run_dir),
        "final_model": str(run_dir / "checkpoints" / f"global_step_{steps}" / "actor"),
    }
