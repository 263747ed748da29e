"""The ``results.json`` structure of a comparison: :func:`build_results` aggregates finished runs
(:class:`~gbmpo.experiments.runs.RunRecord`) into one table per task and one row per group (runs
with the same label: the seeds of one setting). Each row reports, over seeds, the final held-out
metric (accuracy for math tasks, pass@1 for code tasks) as mean +- sample std (ddof = 1) and
min - max, the metric before training and the gain, the paired difference to a baseline row
(same seeds) with its paired t-test p-value, the held-out response length, the number of RL
steps and the wall time per run; a second table gives the training dynamics: policy entropy at
the start and the end of training and the fractions of tokens the surrogate's clip acted on. For
a sweep (rows ``ARM@key=value``) each task also has the accuracy-versus-drift frontier
(:mod:`gbmpo.experiments.frontier`). :mod:`gbmpo.experiments.report` renders it.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gbmpo import __version__
from gbmpo.experiments.frontier import build_frontier
from gbmpo.experiments.runs import RunRecord, config_differences, flatten, main_metric
from gbmpo.experiments.stats import (
    bootstrap_std_interval,
    paired_differences,
    paired_t_test,
    spread,
    std_interval,
    variance_ratio_test,
)

__all__ = [
    "DYNAMICS",
    "LAST_STEPS",
    "SETTING_KEYS",
    "STD_NOTE",
    "build_results",
    "group_runs",
    "machine_info",
]

STD_NOTE = "sample standard deviation over seeds (ddof=1)"
#: configuration keys shown under each task table (their common value, or "varies")
SETTING_KEYS = (
    "model.path",
    "objective.advantage",
    "objective.surrogate.name",
    "objective.aggregation",
    "objective.regularizer.anchor",
    "optim.lr",
    "rollout.prompts_per_step",
    "rollout.num_generations",
    "rollout.max_new_tokens",
    "rollout.temperature",
    "run.steps",
    "run.time_budget_seconds",
    "eval.split",
    "eval.limit",
    "eval.max_new_tokens",
    "eval.samples",
)
LAST_STEPS = 10


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured: OS, Python, CPU count, torch version."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_1_5_15min"] = [round(x, 2) for x in os.getloadavg()]
    info["torch"] = torch.__version__
    info["gbmpo"] = __version__
    return info


def group_runs(records: Sequence[RunRecord]) -> dict[str, dict[str, list[RunRecord]]]:
    """``task -> label -> runs`` (sorted by seed), in order of first appearance.

    Raises ``ValueError`` if a group holds the same seed twice (two runs of one setting).
    """
    out: dict[str, dict[str, list[RunRecord]]] = {}
    for rec in records:
        out.setdefault(rec.task, {}).setdefault(rec.label, []).append(rec)
    for task, groups in out.items():
        for label, runs in groups.items():
            runs.sort(key=lambda r: r.seed)
            seeds = [r.seed for r in runs]
            dup = sorted({s for s in seeds if seeds.count(s) > 1})
            if dup:
                paths = ", ".join(str(r.path) for r in runs if r.seed in dup)
                raise ValueError(
                    f"{task}/{label}: seed(s) {dup} appear in several runs ({paths}); "
                    "pass each run once"
                )
    return out


def _spread_or_none(values: Sequence[float]) -> dict[str, Any] | None:
    return spread(values).to_dict() if values else None


def _passk_frontier(
    groups: Mapping[str, Sequence[RunRecord]], rows: Sequence[dict[str, Any]], measure: str
) -> dict[str, Any] | None:
    """The accuracy-versus-drift frontier read with the largest pass@k every group reports
    (k > 1), or None (no such k, or no sweep)."""
    keys = [set(g.get("pass_at_k") or {}) for g in rows]
    common = set.intersection(*keys) if keys else set()
    ks = sorted((int(k[5:]) for k in common), reverse=True)
    if not ks or ks[0] < 2:
        return None
    return build_frontier(groups, metric=f"pass@{ks[0]}", measure=measure)


def _pass_at_k_spread(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``pass@k`` -> spread over the runs of an arm, for the k every run reports (in k order);
    empty when the runs evaluated one sample per problem."""
    keys = [set(r.get("pass_at_k") or {}) for r in rows]
    common = set.intersection(*keys) if keys else set()
    return {k: _spread_or_none([float(r["pass_at_k"][k]) for r in rows])
            for k in sorted(common, key=lambda k: int(k[5:]))}  # fmt: skip


def _mean_last(run: RunRecord, key: str, k: int = LAST_STEPS) -> float | None:
    vals = [
        float(r[key])
        for r in run.metrics
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
    ]
    return sum(vals[-k:]) / len(vals[-k:]) if vals else None


def _mean_first(run: RunRecord, key: str, k: int = LAST_STEPS) -> float | None:
    vals = _logged(run, key)
    return sum(vals[:k]) / len(vals[:k]) if vals else None


def _mean_all(run: RunRecord, key: str) -> float | None:
    vals = _logged(run, key)
    return sum(vals) / len(vals) if vals else None


def _logged(run: RunRecord, key: str) -> list[float]:
    """The training-step values of ``key`` in a run's metrics, in step order."""
    return [
        float(r[key])
        for r in run.metrics
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
    ]


#: training dynamics per run: key in the run row -> (metrics key, reduction)
DYNAMICS: dict[str, tuple[str, str]] = {
    "entropy_first": ("entropy", "first"),
    "entropy_last": ("entropy", "last"),
    "clip_frac_low": ("clip_frac_low", "all"),
    "clip_frac_high": ("clip_frac_high", "all"),
    "clip_frac_dual": ("clip_frac_dual", "all"),
}


def _dynamics(run: RunRecord) -> dict[str, float | None]:
    reduce = {"first": _mean_first, "last": _mean_last, "all": _mean_all}
    return {k: reduce[how](run, key) for k, (key, how) in DYNAMICS.items()}


#: the drift columns of a run row (:func:`_drift`), each also spread over seeds per group
DRIFT_KEYS: tuple[str, ...] = ("drift_target", "drift_measure_last", "drift_coef_last",
                               "train_kl_k3_last", "drift_kl_final")


def _drift(run: RunRecord) -> dict[str, Any]:
    """The run's drift: with one controlled coefficient its target, the mean over the last
    steps of the measure it read and of the coefficient (``drift_measure/<term>``,
    ``drift_coef/<term>``); for every run the last steps' ``reg/kl_k3`` of the rollouts and the
    end-of-run exact KL on held-out prompts (``summary.json``'s ``drift.kl``, the frontier's)."""
    controlled = [t for t in run.terms if t.get("control")]
    one = controlled[0] if len(controlled) == 1 else None
    drift = run.summary.get("drift")
    final = drift.get("kl") if isinstance(drift, dict) else None
    return {
        "drift_target": None if one is None else float(one["control"]["target"]),
        "drift_measure_last": None if one is None
        else _mean_last(run, f"drift_measure/{one['name']}"),
        "drift_coef_last": None if one is None else _mean_last(run, f"drift_coef/{one['name']}"),
        "train_kl_k3_last": _mean_last(run, "reg/kl_k3"),
        "drift_kl_final": float(final) if isinstance(final, (int, float)) else None,
    }  # fmt: skip


def _run_row(run: RunRecord, metric: str, base: Path | None) -> dict[str, Any]:
    final = run.final_eval or {}
    before = run.eval_before or {}
    path = Path(os.path.relpath(run.path, base)) if base is not None else run.path
    return {
        "label": run.label,
        "seed": run.seed,
        "run_dir": str(path),
        "regularizer": run.regularizer,
        "coef": run.coef,
        "params": run.regularizer_params,
        "final": final.get(metric),
        "before": before.get(metric),
        # the pass@k curve and the diversity measures of the final evaluation (eval.samples > 1)
        "pass_at_k": {k: float(v) for k, v in final.items()
                      if k.startswith("pass@") and k[5:].isdigit()},
        "distinct_answers": final.get("distinct_answers"),
        "token_entropy": final.get("token_entropy"),
        "eval_n": final.get("n"),
        "response_tokens": final.get("mean_response_tokens"),
        "train_reward_last": _mean_last(run, "reward_mean"),
        "train_response_length_last": _mean_last(run, "response_length_mean"),
        **_dynamics(run),
        **_drift(run),
        "steps": run.summary.get("steps"),
        "stop_reason": run.summary.get("stop_reason"),
        "wall_seconds": run.summary.get("wall_seconds"),
        "rl_seconds": run.summary.get("rl_seconds"),
    }


def _values(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def _seed_spread(
    finals: Sequence[float], baseline: Sequence[float] | None
) -> dict[str, Any] | None:
    """The run-to-run spread of an arm's final metric: sample std with a chi-square and a
    bootstrap 95% interval, and the F-test of its variance against the baseline arm's."""
    if len(finals) < 2:
        return None
    out: dict[str, Any] = {
        "std": spread(finals).std,
        "chi2_95": std_interval(finals),
        "bootstrap_95": bootstrap_std_interval(finals),
        "f_vs_baseline": None,
    }
    if baseline is not None and len(baseline) >= 2:
        test = variance_ratio_test(finals, baseline)
        if test is not None:
            out["f_vs_baseline"] = {"F": test[0], "p_value": test[1]}
    return out


def _settings(runs: Sequence[RunRecord]) -> dict[str, Any]:
    flat = [flatten(r.config) for r in runs]
    out: dict[str, Any] = {}
    for key in SETTING_KEYS:
        vals = [f.get(key) for f in flat]
        out[key] = vals[0] if all(v == vals[0] for v in vals) else "varies"
    return out


def build_results(
    records: Sequence[RunRecord],
    *,
    baseline: str | None = None,
    output_dir: str | Path | None = None,
    extra: Mapping[str, Any] | None = None,
    drift_measure: str = "kl",
) -> dict[str, Any]:
    """Aggregate finished runs into the ``results.json`` structure (module docstring).

    ``baseline``: label of the row the others are compared with, seed by seed (default:
    ``kl_k3`` when a task has that row). ``output_dir``: run paths are stored relative to it.
    ``extra`` is stored as is (e.g. the grid specification and the failures). ``drift_measure``:
    the ``drift`` key the frontier of a sweep is drawn against.
    """
    base = Path(output_dir) if output_dir is not None else None
    tasks: list[dict[str, Any]] = []
    for task, groups in group_runs(records).items():
        all_runs = [r for runs in groups.values() for r in runs]
        metric = next(
            (m for r in all_runs if (m := main_metric(r.final_eval or r.eval_before))), None
        )
        metric = metric or "accuracy"
        base_label = baseline if baseline is not None else ("kl_k3" if "kl_k3" in groups else None)
        if base_label is not None and base_label not in groups:
            raise ValueError(
                f"baseline {base_label!r} is not a group of task {task!r}; groups: "
                f"{', '.join(groups)}"
            )
        base_final = (
            {r.seed: float(r.final_eval[metric]) for r in groups[base_label]
             if r.final_eval and metric in r.final_eval}
            if base_label is not None
            else {}
        )
        rows_out: list[dict[str, Any]] = []
        for label, runs in groups.items():
            rows = [_run_row(r, metric, base) for r in runs]
            gains = [
                float(r["final"]) - float(r["before"])
                for r in rows
                if isinstance(r["final"], (int, float)) and isinstance(r["before"], (int, float))
            ]
            finals = {r["seed"]: float(r["final"]) for r in rows
                      if isinstance(r["final"], (int, float))}
            paired: dict[str, Any] | None = None
            if base_label is not None and label != base_label:
                seeds, sp = paired_differences(finals, base_final)
                if sp is not None:
                    test = paired_t_test([finals[s] - base_final[s] for s in seeds])
                    paired = {
                        "baseline": base_label,
                        "seeds": seeds,
                        **sp.to_dict(),
                        "t": None if test is None else test[0],
                        "p_value": None if test is None else test[1],
                    }
            differing = sorted(
                {
                    k
                    for r in runs[1:]
                    for k in config_differences(runs[0].config, r.config)
                    if k != "run.seed"
                }
            )
            rows_out.append(
                {
                    "label": label,
                    "surrogate": str(runs[0].config["objective"]["surrogate"]["name"]),
                    "surrogate_params": dict(
                        runs[0].config["objective"]["surrogate"].get("params") or {}
                    ),
                    "regularizer": runs[0].regularizer,
                    "coef": runs[0].coef,
                    "params": runs[0].regularizer_params,
                    "seeds": [r.seed for r in runs],
                    "n_seeds": len(runs),
                    "final": _spread_or_none(list(finals.values())),
                    "seed_spread": _seed_spread(
                        list(finals.values()),
                        list(base_final.values())
                        if base_label is not None and label != base_label
                        else None,
                    ),
                    "before": _spread_or_none(_values(rows, "before")),
                    "gain": _spread_or_none(gains),
                    "paired_vs_baseline": paired,
                    "pass_at_k": _pass_at_k_spread(rows),
                    "distinct_answers": _spread_or_none(_values(rows, "distinct_answers")),
                    "token_entropy": _spread_or_none(_values(rows, "token_entropy")),
                    "response_tokens": _spread_or_none(_values(rows, "response_tokens")),
                    "train_reward_last": _spread_or_none(_values(rows, "train_reward_last")),
                    **{k: _spread_or_none(_values(rows, k)) for k in DYNAMICS},
                    **{k: _spread_or_none(_values(rows, k)) for k in DRIFT_KEYS},
                    "steps": _spread_or_none(_values(rows, "steps")),
                    "wall_seconds": _spread_or_none(_values(rows, "wall_seconds")),
                    "rl_seconds": _spread_or_none(_values(rows, "rl_seconds")),
                    "config_differences_within_group": differing,
                    "runs": rows,
                }
            )
        eval_n = sorted({r.final_eval.get("n") for r in all_runs if r.final_eval} - {None})
        tasks.append(
            {
                "task": task,
                "metric": metric,
                "eval_n": eval_n,
                "baseline": base_label,
                "settings": _settings(all_runs),
                "groups": rows_out,
                "frontier": build_frontier(groups, metric=metric, measure=drift_measure),
                # with eval.samples > 1: the frontier of the largest pass@k too
                "frontier_passk": _passk_frontier(groups, rows_out, drift_measure),
            }
        )
    return {
        "generated": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "std": STD_NOTE,
        "last_steps_window": LAST_STEPS,
        "machine": machine_info(),
        "tasks": tasks,
        **dict(extra or {}),
    }
