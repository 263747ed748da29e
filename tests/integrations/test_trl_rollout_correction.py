"""``rollout_correction/*`` on TRL (gbmpo.engines.trl.correction): the schema's statistics
of TRL's importance-sampling weights and off-policy mask, token-weighted over a logging window
(window extremes for min / max), equal to gbmpo's own ``weight_stats``; and a TRL engine run
with the off-policy sequence mask writes them to metrics.jsonl."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from gbmpo.cli import main  # noqa: E402
from gbmpo.engines.trl.correction import log_rollout_correction  # noqa: E402
from gbmpo.engines.trl.formulas import window_means  # noqa: E402
from gbmpo.objectives.rollout_correction import weight_stats  # noqa: E402


def _one_process_trainer() -> SimpleNamespace:
    acc = SimpleNamespace(reduce=lambda t, reduction="sum": t, gather=lambda t: t)
    return SimpleNamespace(accelerator=acc, _metrics={"train": defaultdict(list)})


def test_window_statistics_equal_the_own_engines() -> None:
    g = torch.Generator().manual_seed(0)
    ratio = torch.rand(6, 5, generator=g) * 3
    ratio[ratio > 2.5] = 0.0  # masked IS zeros
    keep = torch.tensor([[1.0], [0.0], [1.0], [1.0], [1.0], [1.0]])
    mask = torch.ones(6, 5)
    mask[2, 3:] = 0
    tr = _one_process_trainer()
    for rows in (slice(0, 2), slice(2, 6)):  # two micro-batches of one window
        log_rollout_correction(tr, "train", ratio[rows], keep[rows], mask[rows])
    metrics = tr._metrics["train"]
    window_means(metrics, tr._token_weights["train"])
    own = weight_stats(ratio, mask, keep)
    for key, value in own.items():
        assert metrics[f"rollout_correction/{key}"] == [pytest.approx(value, rel=1e-6)], key
    assert own["masked_frac"] > 0.2  # the mask and the zeros both count


def test_a_trl_run_writes_the_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--engine", "trl", "--rollout.prompts_per_step", "2", "--num-generations",
            "4", "--max-new-tokens", "8", "--optim.mini_batch_size", "4", "--optim.mu", "2",
            "--eval.before", "false", "--eval.after", "false", "--eval.drift", "false",
            "--run.steps", "1", "--run.time_budget_seconds", "null", "--run.checkpoint_every",
            "0", "--objective.monitor_regularizers", "false",
            "--objective.rollout_correction.off_policy_mask_threshold", "0.0",
            "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "rollout_correction/weight_mean" in r)
    # no vLLM: the weights are 1 and only the off-policy mask can drop tokens
    assert row["rollout_correction/weight_mean"] == row["rollout_correction/weight_min"] == 1.0
    assert 0.0 <= row["rollout_correction/masked_frac"] <= 1.0
