"""The verl engine's run directory from verl's file logger: metrics.jsonl in the one metrics
schema (verl-only metrics under ``verl/``), and summary.json with every schema key, the
evaluation before training and the *final* evaluation after it.

verl's ``FileLogger`` (``verl.utils.tracking``) writes one compact JSON object
``{"step": N, "data": {...}}`` per ``Tracking.log`` call: the evaluation before training as the
row of step 0, each training step's metrics as the row of that step, with the validation
metrics of a step that validated merged into it (``RayPPOTrainer.fit``). The rows below have that
shape; ``tests_verl`` writes them with verl's own logger and validation-metric code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gbmpo.config import load_config
from gbmpo.engines.verl.metrics import summarize_run
from gbmpo.io.metrics import STEP_METRICS, SUMMARY_KEYS, is_shared

VERL_OK: list[tuple[str, Any]] = [("engine", "verl"), ("model.device", "cuda")]


def _val(acc: float, reward: float, ds: str = "gbmpo/arithmetic") -> dict[str, float]:
    # what RayPPOTrainer._val_metrics_update reports for greedy n=1 validation with a reward
    # function returning {"score", "acc"}: acc is the core variable
    return {f"val-core/{ds}/acc/mean@1": acc, f"val-aux/{ds}/reward/mean@1": reward,
            f"val-aux/{ds}/score/mean@1": reward}  # fmt: skip


def _train(step: int) -> dict[str, float]:
    return {
        "training/global_step": step, "training/epoch": 0,
        "actor/pg_loss": 0.1 * step, "actor/pg_clipfrac": 0.01, "actor/ppo_kl": 0.001,
        "actor/pg_clipfrac_lower": 0.0, "actor/gbmpo/clip_frac_low": 0.004,
        "actor/kl_loss": 0.02, "actor/kl_coef": 0.05, "actor/grad_norm": 1.5 + step,
        "actor/lr": 1e-6, "actor/loss": 0.12, "actor/entropy": 0.9,
        "critic/score/mean": 0.25 * step, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": 0.25 * step, "response_length/mean": 30.5,
        "response_length/max": 40, "response_length/min": 3, "response_length/clip_ratio": 0.1,
        "timing_s/step": 2.5, "timing_s/gen": 1.0, "perf/mfu/actor": 0.3,
        "perf/max_memory_allocated_gb": 1.5 + step,
        # gbmpo's driver hooks (gbmpo.engines.verl.driver)
        "reg/prob_l2": 0.003, "reg/kl_k3": 0.002, "gbmpo/entropy": 0.8,
        "gbmpo/rl_seconds": 2.5 * step, "gbmpo/reward_failures": float(step % 2),
    }  # fmt: skip


def _write_log(run_dir: Path, rows: list[tuple[int, dict[str, Any]]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "verl_metrics.jsonl").open("w") as f:
        for step, data in rows:  # orjson.dumps: compact, one object per line
            f.write(json.dumps({"step": step, "data": data}, separators=(",", ":")) + "\n")


def _run(tmp_path: Path, rows: list[tuple[int, dict[str, Any]]], *settings: tuple[str, Any],
         kind: str = "math") -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    cfg = load_config(None, [*VERL_OK, *settings])
    run_dir = tmp_path / "run"
    _write_log(run_dir, rows)
    summary = summarize_run(cfg, run_dir, kind=kind, wall_seconds=12.0, n_eval=20)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics


def test_eval_after_is_the_final_validation(tmp_path: Path) -> None:
    rows = [(0, _val(0.2, 0.2)), (1, _train(1)), (2, _train(2)),
            (3, {**_train(3), **_val(0.5, 0.5)})]  # fmt: skip
    summary, _ = _run(tmp_path, rows, ("eval.every", 0), ("run.steps", 3))
    assert summary["steps"] == 3
    assert summary["eval_before"] == {"accuracy": 0.2, "mean_reward": 0.2, "n": 20, "samples": 1}
    assert summary["eval_after"] == {"accuracy": 0.5, "mean_reward": 0.5, "n": 20, "samples": 1}


def test_no_final_validation_gives_no_eval_after(tmp_path: Path) -> None:
    """Without a validation at the last step there is no "after" evaluation: the evaluation
    before training is not reported as the one after it."""
    rows = [(0, _val(0.2, 0.2)), (1, _train(1)), (2, _train(2))]
    summary, _ = _run(tmp_path, rows, ("eval.every", 0), ("run.steps", 2))
    assert summary["eval_before"]["accuracy"] == 0.2
    assert summary["eval_after"] is None


def test_periodic_validation_is_not_the_final_one(tmp_path: Path) -> None:
    rows = [(0, _val(0.1, 0.1)), (1, _train(1)), (2, {**_train(2), **_val(0.3, 0.3)}),
            (3, _train(3))]  # fmt: skip
    summary, _ = _run(tmp_path, rows, ("eval.every", 2), ("run.steps", 3))
    assert summary["eval_after"] is None


def test_eval_switches_off(tmp_path: Path) -> None:
    rows = [(0, _val(0.2, 0.2)), (1, {**_train(1), **_val(0.4, 0.4)})]
    summary, _ = _run(tmp_path, rows, ("eval.before", False), ("eval.after", False),
                      ("eval.every", 1), ("run.steps", 1))  # fmt: skip
    assert summary["eval_before"] is None and summary["eval_after"] is None


def test_code_tasks_report_pass_at_1(tmp_path: Path) -> None:
    ds = "gbmpo/mbpp"
    rows = [(0, _val(0.2, 0.3, ds)), (1, {**_train(1), **_val(0.25, 0.35, ds)})]
    summary, metrics = _run(tmp_path, rows, ("task.name", "mbpp"), ("eval.every", 0),
                            ("run.steps", 1), kind="code")  # fmt: skip
    assert summary["eval_before"]["pass@1"] == 0.2 and summary["eval_after"]["pass@1"] == 0.25
    assert metrics[1]["eval/pass@1"] == 0.25


def test_summary_has_every_schema_key(tmp_path: Path) -> None:
    rows = [(0, _val(0.2, 0.2)), (1, {**_train(1), **_val(0.4, 0.4)})]
    summary, _ = _run(tmp_path, rows, ("eval.every", 0), ("run.steps", 1),
                      ("model.dtype", "bfloat16"), ("run.seed", 3))  # fmt: skip
    missing = set(SUMMARY_KEYS) - set(summary)
    assert not missing, missing
    assert summary["engine"] == "verl" and summary["stop_reason"] == "steps"
    assert summary["wall_seconds"] == 12.0 and summary["seed"] == 3
    assert summary["dtype"] == "bfloat16" and summary["fp32_master_weights"] is True
    assert summary["device"] == "cuda"
    assert summary["final_model"].endswith("checkpoints/global_step_1/actor")


def test_metrics_use_the_schema_names(tmp_path: Path) -> None:
    rows = [(0, _val(0.2, 0.2)), (1, _train(1)), (2, {**_train(2), **_val(0.4, 0.4)})]
    _, metrics = _run(tmp_path, rows, ("eval.every", 0), ("run.steps", 2),
                      ("objective.aggregation", "bnpo"))  # fmt: skip
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[0] == {"step": 0, "eval/accuracy": 0.2, "eval/mean_reward": 0.2,
                          "eval/n": 20, "eval/samples": 1,
                          **{f"verl/{k}": v for k, v in _val(0.2, 0.2).items()}}  # fmt: skip
    m = metrics[2]
    assert m["pg_loss"] == pytest.approx(0.2) and m["grad_norm"] == 3.5
    assert m["reward_mean"] == 0.5 and m["response_length_mean"] == 30.5
    assert m["response_length_max"] == 40 and m["step_seconds"] == 2.5
    assert m["entropy"] == 0.8  # the driver's token mean, not verl's aggregate actor/entropy
    assert m["reg/prob_l2"] == 0.003 and m["reg/kl_k3"] == 0.002
    assert m["time/rl_seconds"] == 5.0
    assert m["eval/accuracy"] == 0.4
    # not the schema's definitions: kept only under verl/
    for name in ("lr", "truncated_frac", "clip_frac_low", "loss"):
        assert name not in m
    assert m["verl/actor/lr"] == 1e-6 and m["verl/response_length/clip_ratio"] == 0.1
    for key in m:
        assert key == "step" or is_shared(key) or key.startswith("verl/"), key
    for key in ("step", "pg_loss", "grad_norm", "reward_mean", "entropy"):
        assert key in STEP_METRICS


@pytest.mark.parametrize("aggregation", ["dr_grpo", "grpo", "bnpo", "seq_mean_token_sum"])
def test_entropy_is_the_token_mean_with_every_aggregation(tmp_path: Path, aggregation: str
                                                          ) -> None:  # fmt: skip
    """``entropy``: the driver's token mean at pi_old (verl's ``actor/entropy`` aggregates with
    ``loss_agg_mode``, the token mean only for bnpo; kept under ``verl/``)."""
    rows = [(1, _train(1))]
    _, metrics = _run(tmp_path, rows, ("eval.every", 0), ("eval.before", False),
                      ("run.steps", 1), ("objective.aggregation", aggregation))  # fmt: skip
    assert metrics[0]["entropy"] == 0.8 and metrics[0]["verl/actor/entropy"] == 0.9


def test_summary_keys_of_every_engine(tmp_path: Path) -> None:
    """rl_seconds (the driver's clock), reward_failures (summed over the steps),
    peak_memory_gib (verl's workers' peak, GiB; none on the CPU), drift (set by the runner)."""
    rows = [(0, _val(0.2, 0.2)), (1, _train(1)), (2, _train(2)), (3, _train(3))]
    summary, _ = _run(tmp_path, rows, ("eval.every", 0), ("run.steps", 3))
    assert summary["rl_seconds"] == 7.5 and summary["reward_failures"] == 2
    assert summary["peak_memory_gib"] == 4.5 and summary["stop_reason"] == "steps"
    assert summary["drift"] is None and summary["drift_seconds"] is None
    cpu, _ = _run(tmp_path / "cpu", rows, ("eval.every", 0), ("run.steps", 3),
                  ("model.device", "cpu"))  # fmt: skip
    assert cpu["peak_memory_gib"] is None


def test_a_run_the_budget_ended_says_time_budget(tmp_path: Path) -> None:
    rows = [(1, _train(1)), (2, _train(2))]  # 5 s of RL by step 2
    summary, _ = _run(tmp_path, rows, ("run.steps", 10), ("run.time_budget_seconds", 4.0))
    assert summary["steps"] == 2 and summary["stop_reason"] == "time_budget"
    summary, _ = _run(tmp_path / "b", rows, ("run.steps", 10), ("run.time_budget_seconds", 9.0))
    assert summary["stop_reason"] == "steps"  # (verl's log ended early for another reason)


@pytest.mark.parametrize(
    ("limit", "auto_limit", "rows"),
    [(None, 50, 50), (None, 500, 200), (30, 50, 30), (None, None, 200)],
)
def test_held_out_file_holds_what_the_own_engine_evaluates(
    tmp_path: Path, limit: int | None, auto_limit: int | None, rows: int
) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from gbmpo.engines.verl.args import write_data
    from gbmpo.train.setup import build_task, eval_limit, load_tokenizer

    cfg = load_config(None, [*VERL_OK, ("eval.limit", limit), ("eval.auto_limit", auto_limit)])
    task = build_task(cfg, load_tokenizer(cfg))
    n_eval = len(task.split(task.eval_split))  # 200 arithmetic problems
    assert (eval_limit(cfg, n_eval) or n_eval) == rows  # the own engine's evaluation size
    counts = write_data(cfg, task, tmp_path)
    test = pd.read_parquet(tmp_path / "test.parquet")
    assert counts["test"] == len(test) == rows
    first = [ex["prompt"] for ex in task.split(task.eval_split)[:rows]]
    assert [p[0]["content"] for p in test["prompt"]] == first


def test_rollout_correction_metrics_from_verls() -> None:
    """verl's rollout_corr/* -> rollout_correction/* where verl's numbers carry the schema's
    definition (the values' agreement with gbmpo's own statistics is checked on verl's real
    output in tests_verl/test_rollout_correction_parity.py)."""
    from gbmpo.engines.verl.metrics import convert_row

    rc = "objective.rollout_correction."
    data = {"rollout_corr/rollout_is_mean": 0.9, "rollout_corr/rollout_is_min": 0.2,
            "rollout_corr/rollout_is_max": 4.0, "rollout_corr/rollout_is_oob_ratio": 0.1}
    row = {"step": 1, "data": data}
    off = convert_row(load_config(None, VERL_OK), row, "math")
    assert not any(k.startswith("rollout_correction/") for k in off)
    assert off["verl/rollout_corr/rollout_is_mean"] == 0.9
    ice = convert_row(load_config(None, [*VERL_OK, (rc + "mode", "icepop"), (rc + "low", 0.5),
                                         (rc + "high", 5.0)]), row, "math")  # fmt: skip
    assert {k: v for k, v in ice.items() if k.startswith("rollout_correction/")} == {
        "rollout_correction/weight_mean": 0.9, "rollout_correction/weight_min": 0.2,
        "rollout_correction/weight_max": 4.0, "rollout_correction/masked_frac": 0.1}
    seq = convert_row(load_config(None, [*VERL_OK, (rc + "mode", "tis"),
                                         (rc + "level", "sequence")]), row, "math")  # fmt: skip
    assert seq["rollout_correction/weight_max"] == 2.0  # the cap of the raw maximum
    assert seq["rollout_correction/masked_frac"] == 0.0
    for name in ("weight_mean", "weight_min", "weight_max", "masked_frac"):
        assert is_shared(f"rollout_correction/{name}")
